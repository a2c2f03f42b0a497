"""Run argument lists (never shell strings), printing each before it runs."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from builder import log


def show(args: Sequence[str | os.PathLike[str]], env: Mapping[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    line = shlex.join(str(a) for a in args)
    return f"+ {prefix} {line}" if prefix else f"+ {line}"


def run(
    args: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    capture: bool = False,
    check: bool = True,
    stdin: bytes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Print ``+ cmd`` and run it; ``env`` adds to the current environment."""
    log.info(show(args, env))
    full_env = {**os.environ, **env} if env else None
    return subprocess.run(
        [str(a) for a in args],
        env=full_env,
        cwd=cwd,
        check=check,
        text=True,
        capture_output=capture,
        input=stdin.decode() if stdin is not None else None,
    )
