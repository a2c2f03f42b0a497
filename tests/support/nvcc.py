"""nvcc 13 for the patch tests, with a cache keyed by the content of everything a compile reads.

A CUTLASS GEMM takes one to two minutes to build on two cores, and the tests build every distinct
variant of every patched file for three targets. A compile's result (exit status, stderr, output)
is kept under ``$SPARKBUILD_CACHE/test-nvcc/<key>/``, where the key hashes nvcc's version, the
arguments, and each input: a source tree by the bytes of its files, a large third-party include
folder by its identity (the wheel or torch version it comes from). The same inputs are never
compiled twice; any change to a patched file, a fragment or a flag compiles again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PLAIN_SM121 = "arch=compute_121,code=sm_121"
SM121A = "arch=compute_121a,code=sm_121a"
COMPUTE_120 = "arch=compute_120,code=compute_120"
# The three targets every patched CUDA file must build for: the Spark's arch-specific code, plain
# sm_121, and compute_120 PTX (JIT on any SM12x).
TARGETS = (SM121A, PLAIN_SM121, COMPUTE_120)


@dataclass(frozen=True)
class Root:
    """An input of a compile: its path and, for a large third-party folder, what identifies it."""

    path: Path
    identity: str | None = None  # None: hash the content


@dataclass(frozen=True)
class Compiled:
    returncode: int
    stderr: str
    output: Path  # in the cache; exists when returncode == 0


def nvcc() -> str:
    found = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if found is None:
        pytest.fail("nvcc (CUDA 13) is not on PATH; these tests compile the patched kernels with it")
    return found


@cache
def version() -> str:
    return subprocess.run([nvcc(), "--version"], capture_output=True, text=True, check=True).stdout


def compile_cached(args: list[str], roots: dict[str, Root], out_name: str, cache_dir: Path) -> Compiled:
    """nvcc ``args`` + ``-o OUT``, where ``{name}`` in an argument is replaced by ``roots[name].path``."""
    h = hashlib.sha256(version().encode())
    h.update(json.dumps([args, out_name]).encode())
    for name in sorted(roots):
        h.update(f"\0{name}\0".encode())
        h.update(_content_hash(roots[name]).encode())
    folder = cache_dir / "test-nvcc" / h.hexdigest()[:32]
    result = folder / "result.json"
    if result.is_file():
        data = json.loads(result.read_text())
        return Compiled(data["returncode"], data["stderr"], folder / out_name)
    folder.mkdir(parents=True, exist_ok=True)
    filled = [a.format(**{n: str(r.path) for n, r in roots.items()}) for a in args]
    done = subprocess.run([nvcc(), *filled, "-o", str(folder / out_name)], capture_output=True, text=True, check=False)
    # Paths of this run's scratch folders would make cached messages differ from fresh ones.
    stderr = done.stderr
    for name, r in roots.items():
        stderr = stderr.replace(str(r.path), f"{{{name}}}")
    result.write_text(json.dumps({"returncode": done.returncode, "stderr": stderr[-6000:]}))
    return Compiled(done.returncode, stderr[-6000:], folder / out_name)


def _content_hash(root: Root) -> str:
    if root.identity is not None:
        return root.identity
    if root.path.is_file():
        return hashlib.sha256(root.path.read_bytes()).hexdigest()
    h = hashlib.sha256()
    for path in sorted(p for p in root.path.rglob("*") if p.is_file()):
        h.update(f"\0{path.relative_to(root.path).as_posix()}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()
