"""The suite on two workers (pytest-xdist; ``-n 2 --dist loadfile`` in pyproject.toml).

Each worker is a pytest session of its own, while the Docker engine, the user's cache and the kept
test registry are one. So:

- what a session does once to that shared state (empty the kept registry, remove an earlier
  session's test images and note the engine's build records, run ``scripts/emulation``) is done by
  the worker that asks first, under a lock, and the other reads its result (``once``);
- what the session leaves in the engine is removed once, by the controller, after both workers
  end (``pytest_sessionfinish`` in tests/conftest.py), with the build records each worker's tests
  marked as the next session's;
- a test marked ``alone`` runs while no other test runs (``turn``): the speed gate's measurements
  (the other worker's load would move them), and the tests that prune or count the engine's build
  records, or remove a stage image other tests share. Every other test runs beside one other.

``--dist loadfile`` keeps a module on one worker: its module fixtures (an image built, a server
started) are made once, and the names a module gives its images are its own. The modules whose lanes
publish to the session cache's registry go to one worker together (``Scheduler``).
``pytest -p no:xdist`` or ``-n 0`` runs the suite in one process, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

# The folder the controller makes for the session and hands each worker (``workerinput``).
SESSION_KEY = "sparkbuild_session"
_session: dict[str, Path] = {}


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def configure(config: pytest.Config) -> None:
    """The session's shared folder: the controller's (or the single process's) own, a worker's from its input."""
    if is_worker(config):
        _session["dir"] = Path(config.workerinput[SESSION_KEY])  # type: ignore[attr-defined]
    else:
        _session["dir"] = Path(tempfile.mkdtemp(prefix="sparkbuild-test-session-"))


def configure_node(node: Any) -> None:
    node.workerinput[SESSION_KEY] = str(_session["dir"])


def unconfigure(config: pytest.Config) -> None:
    if not is_worker(config) and "dir" in _session:
        shutil.rmtree(_session.pop("dir"), ignore_errors=True)


def session_dir() -> Path:
    return _session["dir"]


@contextlib.contextmanager
def _locked(name: str, mode: int) -> Iterator[None]:
    fd = os.open(session_dir() / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def once(name: str, make: Callable[[], Any]) -> Any:
    """``make()`` run by the first worker that asks, its result (JSON) read by every later one; a
    worker that asks meanwhile waits. An exception is not kept: the next one to ask runs it again."""
    done = session_dir() / f"{name}.json"
    with _locked(f"{name}.lock", fcntl.LOCK_EX):
        if done.is_file():
            return json.loads(done.read_text())
        value = make()
        done.write_text(json.dumps(value))
        return value


def done(name: str) -> Any:
    """What ``once(name, ...)`` kept, or None where no worker ran it."""
    path = session_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@contextlib.contextmanager
def turn(config: pytest.Config, alone: bool) -> Iterator[None]:
    """A test's turn: beside the other worker's tests, or ``alone`` with none.

    A readers-writer lock over two files: a test takes ``tests`` shared, an ``alone`` test takes it
    exclusive, each through the turnstile. The turnstile, held by an ``alone`` test while it waits,
    lets no new test start meanwhile, so it waits for the other worker's current test only, never
    for its whole module."""
    if not is_worker(config):
        yield
        return
    with contextlib.ExitStack() as held:
        with _locked("turnstile", fcntl.LOCK_EX):
            held.enter_context(_locked("tests", fcntl.LOCK_EX if alone else fcntl.LOCK_SH))
        yield


# The modules that take most of a minute or more, longest first (seconds on CI's 2 cores, warm, in
# one process, 2026-12-07; the speed gate's 315 s runs alone, at the end): given out first, so that
# the last module a worker starts is a short one and neither waits long for the other at the end. A
# module not named keeps its place after them.
LONGEST_FIRST = (
    "tests/lanes/test_rehearsal.py",  # 605
    "tests/verify/test_multi_node.py",  # 290 (measured in parts, 2026-12-07: its Ray tests about 130)
    "tests/lanes/test_nightly.py",  # 220
    "tests/lanes/test_run_nodes.py",  # 130
    "tests/verify/test_broken_kernels.py",  # 115
    "tests/verify/test_wears_out.py",  # 115
    "tests/verify/test_moe_serving.py",  # 90
    "tests/lanes/test_run.py",  # 85
    "tests/oci/test_faults.py",  # 85
    "tests/lanes/test_rc.py",  # 80
    "tests/verify/test_serving.py",  # 70
    "tests/test_installed.py",  # 70
    "tests/verify/test_kernel_gate.py",  # 60
    "tests/publish/test_attest.py",  # 55
    "tests/build/test_closure.py",  # 55
    "tests/lanes/test_bisect.py",  # 50
    "tests/publish/test_publish_trust.py",  # 50
    "tests/test_fuzz.py",  # 50
    "tests/verify/test_clients.py",  # 45
)


# The modules whose lanes publish to the session cache's embedded registry. Its storage serves one lane at
# a time (a lock beside it: sparkbuild/oci/registry.embedded), so on two workers the second lane waited
# for the first, its worker idle (the rc and the installed tool's nightly about two minutes together
# in a run, measured): one worker runs them in turn.
SESSION_REGISTRY = (
    "tests/lanes/test_nightly.py",
    "tests/lanes/test_rc.py",
    "tests/lanes/test_runs.py",
    "tests/test_installed.py",
)


class Scheduler(LoadFileScheduling):  # type: ignore[misc]  # xdist ships no type information
    """xdist's ``--dist loadfile``, with ``SESSION_REGISTRY``'s modules one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        module = str(super()._split_scope(nodeid))
        return "the session registry's lanes" if module in SESSION_REGISTRY else module


def ordered(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the longest modules first and the modules holding an ``alone`` test last (while
    one runs, the other worker waits: at the end, it has little left to wait with)."""

    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0]
        if module in LONGEST_FIRST:
            return LONGEST_FIRST.index(module)
        return len(LONGEST_FIRST) + (1 if module in alone_modules else 0)

    alone_modules = {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("alone") is not None}
    return sorted(items, key=rank)  # stable: a module's own tests keep their order
