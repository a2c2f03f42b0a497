"""The inputs sparkbuild ships with: its ``dockerfiles/`` and ``patches/``.

In a checkout (and an editable install) they are the folders beside the ``builder`` package; a wheel
carries them as package data under ``builder/resources/`` (pyproject.toml maps them there). Standard
library only: the patch engine, which runs inside build containers, asks for the packaged patches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Kind = Literal["dockerfiles", "patches"]


def folder(kind: Kind) -> Path:
    package = Path(__file__).resolve().parent
    installed = package / "resources" / kind
    return installed if installed.is_dir() else package.parent / kind
