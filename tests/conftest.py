"""Shared fixtures. Unit tests need no Docker; tests marked `docker` use the real engine."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Protocol

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECKS = """\
checks:
  alphabet:
    model: alphabet
    prompts:
      - {name: completion, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}
bases:
  deb:
    debootstrap: {suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}
"""


class MatrixWriter(Protocol):
    def __call__(self, body: str, with_checks: bool = True) -> Path: ...


@pytest.fixture
def write_matrix(tmp_path: Path) -> MatrixWriter:
    """Write a matrix (checks and bases are prepended unless given) with a patches/ folder beside it."""

    def write(body: str, with_checks: bool = True) -> Path:
        (tmp_path / "patches" / "one").mkdir(parents=True, exist_ok=True)
        (tmp_path / "patches" / "one" / "fix.diff").write_text("--- a\n+++ b\n")
        (tmp_path / "patches" / "two").mkdir(exist_ok=True)
        (tmp_path / "patches" / "two" / "fix.diff").write_text("two\n")
        text = (CHECKS if with_checks else "") + textwrap.dedent(body)
        path = tmp_path / "matrix.yaml"
        path.write_text(text)
        return path

    return write
