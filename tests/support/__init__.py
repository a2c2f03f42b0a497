"""What the tests share: the one way to run ``sparkbuild`` (cli), to write a test matrix (matrix),
and to make real git repositories (git)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
