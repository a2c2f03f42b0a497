"""The code stays `mypy --strict` and `ruff` clean: part of the one test command."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_mypy_strict() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_ruff() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
