"""Processes on this machine, found by their command line: what a test expects a run to have stopped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def pids_where(match: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids whose argv (as /proc shows it) ``match`` accepts."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that ended while we looked
            continue
        if argv and match(argv):
            found.append(int(proc.name))
    return found
