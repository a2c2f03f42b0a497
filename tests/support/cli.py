"""The one way a test runs ``sparkbuild``.

- ``run``: as a user runs it, a new process (``python -m sparkbuild``, or ``command=`` another
  installation's), its output captured; the tail of its stderr is echoed into the test's output.
- ``start``: the same, left running (a test that interrupts it, or reads its stderr as it comes).
- ``in_process``: through the real entry point (``cli.main``: its exit codes, its message for a bug)
  in this process, so that hundreds of inputs take seconds; a hang is stopped by SIGALRM.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

import sparkbuild
from sparkbuild import cli
from tests.support import ROOT

PACKAGE = sparkbuild.__name__  # the import package: sparkbuild's own code
COMMAND = (sys.executable, "-m", PACKAGE)


def run(
    *args: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    check: bool = False,
    command: Sequence[str | Path] = COMMAND,
    inherit: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``sparkbuild ARGS``: ``env`` added to this process's environment (``inherit=False``: to an
    environment without SPARKBUILD_* and virtualenv variables, as a fresh shell has)."""
    result = subprocess.run(
        [str(a) for a in (*command, *args)], env=environment(env, inherit), cwd=cwd, capture_output=True, text=True
    )
    sys.stderr.write(result.stderr[-4000:])
    if check:
        result.check_returncode()
    return result


def start(
    *args: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    stdout: int | IO[str] | None = subprocess.DEVNULL,
) -> subprocess.Popen[str]:
    """``sparkbuild ARGS`` left running, its stderr a pipe (stdout: discarded unless asked for).
    Each is ended after its test if the test left it running (``tests/conftest.py``)."""
    proc = subprocess.Popen(
        [str(a) for a in (*COMMAND, *args)], env=environment(env, True), cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True
    )
    STARTED.append(proc)
    return proc


# Every process ``start`` began, for the fixture that ends those a failing test left behind.
STARTED: list[subprocess.Popen[str]] = []


def end_started() -> None:
    """End and reap each started process still running (a stopped one is continued first)."""
    for proc in STARTED:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=60)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    STARTED.clear()


def environment(env: Mapping[str, str] | None, inherit: bool) -> dict[str, str]:
    if inherit:
        base = dict(os.environ)
    else:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKBUILD_", "VIRTUAL_ENV", "PYTHON"))}
    return {**base, **(env or {})}


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


def in_process(*args: str, env: dict[str, str] | None = None, seconds: float = 20) -> Outcome:
    """``sparkbuild ARGS`` in this process: its exit code and output; raises Hung after ``seconds``."""
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
