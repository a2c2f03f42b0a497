"""pyproject.toml lists sparkbuild's packages (so that dockerfiles/ and patches/ can be mapped into the
wheel as package data): the list must follow the packages on disk."""

from __future__ import annotations

import tomllib
from pathlib import Path

import sparkbuild
from tests.support import ROOT


def test_every_package_on_disk_is_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in Path(sparkbuild.__file__).parent.rglob("__init__.py")}
    mapped = set(config["package-dir"])
    assert set(config["packages"]) == on_disk | mapped | {"sparkbuild.resources"}
    assert config["package-dir"] == {"sparkbuild.resources.dockerfiles": "dockerfiles", "sparkbuild.resources.patches": "patches"}
