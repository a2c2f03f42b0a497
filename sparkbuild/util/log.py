"""Step logger: ``with log.step("Building x"):`` prints a header, a timing, and CI fold groups."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _on_github() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def info(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def warning(message: str) -> None:
    if _on_github():
        print(f"::warning::{message}", file=sys.stderr, flush=True)
    else:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def error(message: str) -> None:
    if _on_github():
        # GitHub annotations take one line; keep the full text below it.
        print(f"::error::{message.splitlines()[0] if message else ''}", file=sys.stderr, flush=True)
    print(f"error: {message}", file=sys.stderr, flush=True)


@contextmanager
def step(title: str) -> Iterator[None]:
    """Announce a long step, fold its output on GitHub, and report how long it took."""
    start = time.monotonic()
    if _on_github():
        print(f"::group::{title}", file=sys.stderr, flush=True)
    info(f"==> {title}")
    ok = False
    try:
        yield
        ok = True
    finally:
        elapsed = time.monotonic() - start
        if _on_github():
            print("::endgroup::", file=sys.stderr, flush=True)
        info(f"<== {title}: {'done' if ok else 'failed'} in {format_seconds(elapsed)}")


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def step_summary(markdown: str) -> None:
    """Append to the GitHub job summary when running there."""
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if path:
        with Path(path).open("a", encoding="utf-8") as handle:
            handle.write(markdown + "\n")
