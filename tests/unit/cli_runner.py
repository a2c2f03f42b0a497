"""Run ``sparkbuild`` in this process, as ``cli.main`` does for a user, with a time bound.

In-process so that hundreds of inputs take seconds; ``cli.main`` is the real entry point (its
exit codes, its message for a bug), and a hang is stopped by SIGALRM.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

from builder import cli


class Hung(BaseException):
    """Not an Exception: ``cli.main`` must not turn a hang into an exit code."""


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hung


def sparkbuild(*args: str, env: dict[str, str] | None = None, seconds: float = 20) -> Outcome:
    """``sparkbuild ARGS``: its exit code and output; raises Hung after ``seconds``."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    code = 0
    argv = sys.argv
    try:
        with _environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            sys.argv = ["sparkbuild", *args]
            try:
                cli.main()
            except SystemExit as exc:
                code = int(exc.code or 0)
    finally:
        sys.argv = argv
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return Outcome(code, out.getvalue(), err.getvalue())
