"""Real vLLM sdists from PyPI (sha256 from the simple index), cached in SPARKBUILD_CACHE or ~/.cache/sparkbuild.

Each test gets its own copy of a tree, so applying patches never touches the cache.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from builder import patch, sources
from builder.options import Options
from tests.conftest import ROOT

# The versions the patch set is proven on; 0.16.0 is the last sdist before the arch fixes of 0.19.0.
VERSIONS = ("0.11.0", "0.12.0", "0.16.0", "0.19.0", "0.33.0")
PATCHES = ROOT / "patches"

TreeFactory = Callable[[str], Path]


@pytest.fixture(scope="session")
def pristine() -> TreeFactory:
    """The cached, unpacked sdist of a version (read only)."""
    cache = Options.from_env().cache

    def get(version: str) -> Path:
        return sources.vllm_sdist(version, cache)

    return get


@pytest.fixture
def tree_copy(tmp_path: Path, pristine: TreeFactory) -> TreeFactory:
    """A private copy of a version's tree that a test may patch."""

    def get(version: str) -> Path:
        dest = tmp_path / f"vllm-{version}"
        shutil.copytree(pristine(version), dest, symlinks=True)
        return dest

    return get


@pytest.fixture(scope="session")
def patched(pristine: TreeFactory, tmp_path_factory: pytest.TempPathFactory) -> TreeFactory:
    """A copy of a version's tree with the whole patch set applied (one per session and version)."""
    made: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in made:
            dest = tmp_path_factory.mktemp("patched") / f"vllm-{version}"
            shutil.copytree(pristine(version), dest, symlinks=True)
            patch.apply(patch.check(dest, patch.load(PATCHES), version))
            made[version] = dest
        return made[version]

    return get
