"""One run at a time per cache: an advisory lock (``flock``) on a file that names its holder.

A second nightly, rc or build on the same cache waits, saying who holds it, or with ``--no-wait``
stops at once (exit 13). The kernel drops the lock when its holder exits, even by kill -9, so a
lock is never left stale.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sparkbuild.errors import RunLockBusy
from sparkbuild.util import log

POLL_S = 0.5


def holder(path: Path) -> str:
    """Who holds the lock at ``path``, as its holder wrote it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {data['pid']} on {data['host']} (`{data['command']}`, since {data['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"


@contextmanager
def hold(path: Path, what: str, *, wait: bool = True) -> Iterator[None]:
    """Hold the lock at ``path`` (``what`` names it in messages) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, what, wait)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": shlex.join(["sparkbuild", *sys.argv[1:]]),
            "since": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _acquire(fd: int, path: Path, what: str, wait: bool) -> None:
    waited_since: float | None = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder(path)
            if not wait:
                raise RunLockBusy(f"{what} is held by {who}; wait for it to end, or run without --no-wait to wait") from None
            if waited_since is None:
                waited_since = time.monotonic()
                log.info(f"waiting for {what}: held by {who} ({path})")
            time.sleep(POLL_S)
            continue
        if waited_since is not None:
            log.info(f"got {what} after {log.format_seconds(time.monotonic() - waited_since)}")
        return


@contextmanager
def run(cache: Path, *, wait: bool = True) -> Iterator[None]:
    """The run lock of ``cache``: nightly, rc, build, publish, resolve and bisect hold it."""
    with hold(cache / "run.lock", f"the run lock of {cache}", wait=wait):
        yield
