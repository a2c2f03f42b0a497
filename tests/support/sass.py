"""The SASS of a CUDA object's CUTLASS GEMM kernels, read with cuobjdump (PyPI's, with its nvdisasm)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from sparkbuild.build import binaries


def gemm_sass(obj: Path) -> str:
    """The SASS of the CUTLASS GemmUniversal kernels in ``obj``."""
    tool = binaries.cuobjdump()
    # -sass runs nvdisasm; PyPI's nvidia-cuda-nvdisasm puts it beside PyPI's cuobjdump.
    env = {**os.environ, "NVDISASM_PATH": str(tool.parent / "nvdisasm")} if (tool.parent / "nvdisasm").is_file() else None
    done = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True, env=env)
    kernels = re.split(r"\n\s*Function : ", done.stdout)
    return "\n".join(k for k in kernels if k.startswith("_ZN7cutlass13device_kernel") and "GemmUniversal" in k[:200])


def mma_instructions(sass: str) -> set[str]:
    """MMA opcodes with their modifiers (a dot follows; the kernels' mangled names have none)."""
    return set(re.findall(r"\b[A-Z]*MMA\.[A-Z0-9.]+", sass))


def instructions(sass: str) -> int:
    """How many instructions the listing holds (each line of code starts with its address comment)."""
    return len(re.findall(r"(?m)^\s+/\*[0-9a-f]{4,}\*/", sass))
