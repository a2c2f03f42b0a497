"""What the tests share: the one way to run ``sparkbuild`` (cli), to write a test matrix (matrix),
real git repositories (git), a real upstream of vLLM releases (upstream), vLLM source trees (trees),
nvcc builds cached by content (nvcc), the fault injector (faults) and process checks (procs).

``trees`` and ``upstream`` hold fixtures: tests/conftest.py registers them for every test."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Recorded inputs the tests read: bench results, kernel logs, an image's SBOM sources, a CUDA kernel.
DATA = ROOT / "tests" / "data"
