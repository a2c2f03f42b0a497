"""pyproject.toml lists sparkbuild's packages (so that dockerfiles/ and patches/ can be mapped into the
wheel as package data): the list must follow the packages on disk."""

from __future__ import annotations

import tomllib

from tests.support import ROOT


def test_every_package_of_builder_is_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "builder").rglob("__init__.py")}
    mapped = set(config["package-dir"])
    assert set(config["packages"]) == on_disk | mapped | {"builder.resources"}
    assert config["package-dir"] == {"builder.resources.dockerfiles": "dockerfiles", "builder.resources.patches": "patches"}
