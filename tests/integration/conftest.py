"""Integration fixtures: the real Docker engine, a real registry, the real local base image."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder import base_image, matrix
from builder.engine import Engine
from builder.registry import Registry, embedded
from tests.conftest import ROOT


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sparkbuild's cache for the test session; SPARKBUILD_TEST_CACHE keeps it between runs."""
    keep = os.environ.get("SPARKBUILD_TEST_CACHE")
    return Path(keep) if keep else tmp_path_factory.mktemp("sparkbuild-cache")


@pytest.fixture(scope="session")
def base(engine: Engine, cache: Path) -> str:
    """The shipped matrix's base image, made with debootstrap (cached by content in the engine)."""
    target = matrix.load(ROOT / "matrix.yaml").targets[0]
    return base_image.ensure(engine, target.base, target.platform, cache / "rootfs")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with embedded(tmp_path / "registry") as reg:
        yield reg
