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

from sparkbuild.util import fsutil, runlock

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
    folder.mkdir(parents=True, exist_ok=True)
    # One compile of a key at a time (the suite's two workers): the second waits and reads the first's.
    with runlock.hold(folder / "compile.lock", f"the nvcc compile in {folder}"):
        if not result.is_file():
            filled = [a.format(**{n: str(r.path) for n, r in roots.items()}) for a in args]
            done = subprocess.run([nvcc(), *filled, "-o", str(folder / out_name)], capture_output=True, text=True, check=False)
            # Paths of this run's scratch folders would make cached messages differ from fresh ones.
            stderr = done.stderr
            for name, r in roots.items():
                stderr = stderr.replace(str(r.path), f"{{{name}}}")
            fsutil.write_text(result, json.dumps({"returncode": done.returncode, "stderr": stderr[-6000:]}))
    data = json.loads(result.read_text())
    return Compiled(data["returncode"], data["stderr"], folder / out_name)


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


# vLLM's mixed-arch build in miniature: kernels built for sm_121a in one unit, one built only for sm_120a
# in another, linked into one library (the same units and flags as tests/build/test_check_binary.py, so
# a warm cache compiles nothing).
GOOD_UNIT = (
    "__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }\n"
    "template <int N> __global__ void shift(float* x) { x[threadIdx.x] += N; }\n"
    "template __global__ void shift<3>(float*);\n"
)
SM120A_UNIT = "__global__ void only_sm120a(float* x) { x[threadIdx.x] *= 3.0f; }\n"


def libraries(cache_dir: Path, scratch: Path) -> dict[str, Path]:
    """``libmixed.so`` (an sm_121a unit and an sm_120a-only unit: fails on a GB10) and ``libgood.so``
    (the sm_121a unit alone: runs there), compiled once and cached by content."""
    units = {
        "good": (GOOD_UNIT, "good_sm121a.o", SM121A),
        "only120a": (SM120A_UNIT, "only_sm120a.o", "arch=compute_120a,code=sm_120a"),
    }
    objects: dict[str, Path] = {}
    for unit, (text, name, gencode) in units.items():
        (scratch / f"{unit}.cu").write_text(text)
        args = ["-c", "-Xcompiler", "-fPIC", "-gencode", gencode, "{src}"]
        objects[name] = _made(compile_cached(args, {"src": Root(scratch / f"{unit}.cu")}, name, cache_dir))
    found = {}
    for library, names in (("libmixed.so", ("good_sm121a.o", "only_sm120a.o")), ("libgood.so", ("good_sm121a.o",))):
        roots = {f"o{i}": Root(objects[n]) for i, n in enumerate(names)}
        found[library] = _made(compile_cached(["-shared", *(f"{{{r}}}" for r in roots)], roots, library, cache_dir))
    return found


def _made(done: Compiled) -> Path:
    assert done.returncode == 0, done.stderr
    return done.output
