"""Real vLLM sdists from PyPI (sha256 from the simple index), cached in SPARKBUILD_CACHE or ~/.cache/sparkbuild.

Every release's tree is the slice the patches read (``sparkbuild.patch.releases``): downloaded once,
checked, and kept under ``patch-trees/``. A test that edits a tree gets its own copy; applying
patches works on copies too, so the cache is never changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.patch import releases
from sparkbuild.upstream import sources
from tests.support import ROOT

PATCHES = ROOT / "patches"
# Every vLLM release from 0.10.0 through THROUGH with an sdist on PyPI (test_releases.py holds the
# list to the index); the sweep pins each patch's status on each of them.
THROUGH = "0.33.0"
RELEASES = (
    "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1",
    "0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0",
    "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
    "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)  # fmt: skip
WHEELS_ONLY = ("0.15.0", "0.15.1")
# The versions the single-version tests use; 0.16.0 is the last sdist before the arch fixes of 0.19.0.
VERSIONS = ("0.11.0", "0.12.0", "0.16.0", "0.19.0", "0.33.0")

TreeFactory = Callable[[str], Path]


@pytest.fixture(scope="session")
def source_cache() -> Path:
    return Options.from_env().cache


@pytest.fixture(scope="session")
def pristine(source_cache: Path) -> TreeFactory:
    """A release's tree (read only): always the slice, as on a fresh CI machine, even where a full
    sdist is unpacked in the cache."""
    patterns = releases.reads(patch.load(PATCHES))

    def get(version: str) -> Path:
        return releases.tree(version, source_cache, patterns, full_ok=False)

    return get


@pytest.fixture(scope="session")
def every_tree(pristine: TreeFactory, source_cache: Path) -> dict[str, Path]:
    """Every release's tree; the missing ones downloaded four at a time."""
    patterns = releases.reads(patch.load(PATCHES))
    missing = [v for v in RELEASES if not (source_cache / releases.TREES / f"vllm-{v}" / releases.STAMP).is_file()]
    if missing:
        links = sources.index_links("vllm")
        found = [releases.Release(v, sources.sdist_link(v, links)) for v in missing]
        releases.trees(found, source_cache, patterns, full_ok=False)
    return {v: pristine(v) for v in RELEASES}


@pytest.fixture
def tree_copy(tmp_path: Path, pristine: TreeFactory) -> TreeFactory:
    """A private copy of a release's tree that a test may edit in place."""

    def get(version: str) -> Path:
        dest = tmp_path / f"vllm-{version}"
        shutil.copytree(pristine(version), dest, symlinks=True)
        return dest

    return get


def linked_copy(source: Path, dest: Path) -> Path:
    """A copy of ``source`` made of hard links: cheap, and safe for patch.apply, which replaces each
    file it writes (a new file renamed over the link) instead of writing into it. Not for tests
    that edit files in place: they would edit the cache."""
    shutil.copytree(source, dest, symlinks=True, copy_function=os.link)
    return dest


@pytest.fixture(scope="session")
def patched(pristine: TreeFactory, tmp_path_factory: pytest.TempPathFactory) -> TreeFactory:
    """A copy of a release's tree with the whole patch set applied (one per session and release)."""
    made: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in made:
            dest = linked_copy(pristine(version), tmp_path_factory.mktemp("patched") / f"vllm-{version}")
            patch.apply(patch.check(dest, patch.load(PATCHES), version))
            made[version] = dest
        return made[version]

    return get


def tree_hash(tree: Path) -> str:
    """sha256 over every file of a tree (path and bytes): equal when nothing was written."""
    h = hashlib.sha256()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


# --- every release, and the distinct variants of each file the patches change ----------------------


@pytest.fixture(scope="session")
def sweep(every_tree: dict[str, Path]) -> dict[str, patch.Report]:
    """The whole patch set checked on every release (nothing written)."""
    patches = patch.load(PATCHES)
    return {v: patch.check(tree, patches, v) for v, tree in every_tree.items()}


@dataclass(frozen=True)
class Variant:
    """One distinct content of a file across releases, found by its hash."""

    path: str  # the file's path in ``version``'s tree
    digest: str  # sha256 of the content, 12 hex digits
    version: str  # the newest release whose file reads so
    versions: tuple[str, ...]  # every release whose file reads so


def variants(sweep: dict[str, patch.Report], name: str, patched: bool = True) -> list[Variant]:
    """The distinct contents of the files called ``name`` that the patch set changes, patched (or as
    upstream has them), oldest first."""
    found: dict[str, list[tuple[str, str]]] = {}
    for version, report in sweep.items():
        for rel, text in report.overlay.changed.items():
            if Path(rel).name == name:
                content = text if patched else (report.source / rel).read_text()
                found.setdefault(hashlib.sha256(content.encode()).hexdigest()[:12], []).append((version, rel))
    assert found, f"no release has a {name} the patches change"
    return [Variant(uses[-1][1], digest, uses[-1][0], tuple(v for v, _ in uses)) for digest, uses in found.items()]


def status_of(tree: Path, version: str, name: str) -> patch.Result:
    """Patch ``name``'s result on ``tree`` (the release ``version``), checked alone."""
    (result,) = patch.check(tree, patch.load(PATCHES, (name,)), version).results
    return result


def replace_once(path: Path, old: str, new: str) -> None:
    """``old``, which the file holds exactly once, replaced by ``new``."""
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
