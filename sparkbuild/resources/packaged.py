"""The inputs sparkbuild ships with: its ``dockerfiles/`` and ``patches/``.

In a checkout (and an editable install) they are the folders beside the ``sparkbuild`` package; a wheel
carries them as package data under ``sparkbuild/resources/`` (pyproject.toml maps them there). Standard
library only: the patch engine, which runs inside build containers, asks for the packaged patches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Kind = Literal["dockerfiles", "patches"]

# The package's own folder, found from this module's dotted name: the same answer wherever the
# module sits inside the package.
ROOT = Path(__file__).resolve().parents[__name__.count(".") - 1]


def folder(kind: Kind) -> Path:
    installed = ROOT / "resources" / kind
    return installed if installed.is_dir() else ROOT.parent / kind


def resource(name: str) -> Path:
    """A file of the package's ``resources/`` (defaults, kernel paths, the starter matrix, scripts)."""
    return ROOT / "resources" / name
