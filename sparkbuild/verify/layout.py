"""Where verify writes: each check's result file, and its server's log beside it.

Apart from the verify stage (``sparkbuild.verify.verify``) because publish and the lanes read these
paths on every run, also when nothing is verified: a nightly with nothing to build does not load
the stage that serves and checks images (tests/test_startup.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sparkbuild.plan.matrix import Check

# The server's whole log, beside verify.json, pass or fail: what the kernel-path gate read.
SERVER_LOG = "server.log"


def result_files(first: Path, checks: Sequence[Check] | Sequence[str]) -> dict[str, Path]:
    """Where each check's result goes: the target's first check's at ``first``; each further
    check's in ``checks/<name>/`` beside it. Each folder has its server.log, and a benchmarked
    check's its bench/, speed.json and plot."""
    names = [c if isinstance(c, str) else c.name for c in checks]
    return {name: first if i == 0 else first.parent / "checks" / name / first.name for i, name in enumerate(names)}
