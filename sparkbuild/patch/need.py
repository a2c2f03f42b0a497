"""Whether a patch is still needed on a release, for one build (CUDA version, arch list).

A status says what the patch would do to the tree; need says whether the build needs it. A patch
is not needed where upstream has its change (``upstream``), where it has nothing to change
(``not-applicable``), where upstream serves its purpose another way (``upstream.alternatives`` in
patch.yaml: a backend of its own, found by content), or where its rule says the build does not
need it (a rule module's optional ``needed(tree, build)``: ``cmake-arch-sm121`` runs vLLM's own
CMake helpers for the CUDA version, ``e2m1-software`` reads the arch list). Everything else that
applies is needed. The support table has one column per build, and the shipped matrix lists a
patch for a target only where it is needed (tests/patch/test_needed.py holds it to that).

Host only: a rule's ``needed`` may run cmake; the container's patch stage never calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparkbuild.patch import rules
from sparkbuild.patch.meta import Patch
from sparkbuild.patch.overlay import Status

# The Spark build the table judges by default: sm_121's own arch-specific target, on both CUDA
# versions the shipped targets use.
SPARK_ARCH_LIST = "12.1a"
SPARK_CUDA = ("12.9", "13.0")


@dataclass(frozen=True)
class Build:
    cuda: str  # "12.9"
    arch_list: str = SPARK_ARCH_LIST

    @property
    def label(self) -> str:
        return f"CUDA {self.cuda}, {self.arch_list}"


@dataclass(frozen=True)
class Need:
    needed: bool
    why: str

    def to_json(self) -> dict[str, object]:
        return {"needed": self.needed, "why": self.why}


def judge(p: Patch, status: Status, detail: str, tree: Path, build: Build) -> Need:
    """Whether ``build`` needs ``p`` on ``tree`` (the release as published), given its status there."""
    if status == "upstream":
        return Need(False, f"upstream has the change: {detail}")
    if status == "not-applicable":
        return Need(False, f"nothing to change: {detail}")
    if status == "conflict":
        return Need(True, f"unknown: the patch conflicts ({detail})")
    for alt in p.alternatives:
        where = tree / alt.file
        text = where.read_text(encoding="utf-8") if where.is_file() else ""
        if alt.contains in text:
            line = text[: text.index(alt.contains)].count("\n") + 1
            return Need(False, f"{alt.why} ({alt.file}:{line})")
    if p.rule is not None:
        judged = rules.load(p.rule).needed
        if judged is not None:
            needed, why = judged(tree, build.cuda, build.arch_list)
            return Need(needed, why)
    return Need(True, "its change is not in this release")
