"""What the tests share: the one way to run ``sparkbuild`` (cli), to write a test matrix (matrix),
real git repositories (git), a real upstream of vLLM releases (upstream), vLLM source trees (trees),
nvcc builds cached by content (nvcc), the fault injector (faults) and process checks (procs).

``trees`` and ``upstream`` hold fixtures: tests/conftest.py registers them for every test."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Recorded inputs the tests read: bench results, kernel logs, an image's SBOM sources, a CUDA kernel.
DATA = ROOT / "tests" / "data"


def setup_script(name: str) -> tuple[bool, str]:
    """Run ``scripts/NAME`` (a test-only set-up: ``emulation``, ``browser``), printed first: whether it
    succeeded, and its stdout's last line, or where it failed, its own last line of why (the skip's reason)."""
    import subprocess

    args = [str(ROOT / "scripts" / name)]
    print("+", *args)
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return False, f"{' '.join(args)}: {said}"
    return True, (done.stdout.strip().splitlines() or [""])[-1]
