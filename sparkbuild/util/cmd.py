"""Run argument lists (never shell strings), printing each before it runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from sparkbuild.util import log

# The process's own stderr, by descriptor: sys.stderr may be an object without one (a test's capture).
STDERR_FD = 2


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
    """Print ``+ cmd`` and run it; ``env`` adds to the current environment. Unless captured, its
    output goes to stderr with every log line: sparkbuild's stdout holds results alone (``--json``),
    and a tool's chatter there (debootstrap's, making a base) made ``rehearse --json`` unreadable."""
    log.info(show(args, env))
    full_env = {**os.environ, **env} if env else None
    return subprocess.run(
        [str(a) for a in args],
        env=full_env,
        cwd=cwd,
        check=check,
        text=True,
        stdout=subprocess.PIPE if capture else STDERR_FD,
        stderr=subprocess.PIPE if capture else None,
        input=stdin.decode() if stdin is not None else None,
    )


def lines(args: Sequence[str | os.PathLike[str]]) -> Iterator[str]:
    """Print ``+ cmd``, run it and yield its output line by line, for an output too large to hold
    (cuobjdump's PTX of one vLLM library is 650 MB). A non-zero exit raises CalledProcessError
    with its stderr once the output has been read."""
    log.info(show(args))
    # stderr goes to a file: a pipe nobody reads while stdout is read could fill and stall it.
    with tempfile.TemporaryFile(mode="w+") as err:
        with subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            assert proc.stdout is not None
            yield from proc.stdout
        err.seek(0)
        stderr = err.read()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, [str(a) for a in args], stderr=stderr)
