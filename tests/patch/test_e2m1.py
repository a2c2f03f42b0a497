"""e2m1-software on every distinct variant of vLLM's FP4 header, found by content hash across every
release, proven by compiling with nvcc 13 and by numbers against two independent references.

Compiling: a kernel that calls the header's 8-value conversion is built for ``sm_121a`` (the
instruction is kept), plain ``sm_121`` and ``compute_120`` PTX (JIT on the device). Unpatched, the
plain targets fail in ptxas; patched, all three build, and the PTX for JIT has no e2m1x2 instruction.

Numbers: for each variant, a host program runs ``fp32_to_e2m1_software`` and every conversion
function the rule rewrote (vec8 over float[8] and float2[4], vec16 where the header has it: the
C++ translated from each asm block, the code a plain sm_121 runs), against an exact rational
reference written here, and against CUDA's own host conversion ``__nv_cvt_float_to_fp4``.
Compiles are cached by content (``tests/support/nvcc.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import math
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from sparkbuild import patch
from tests.support import DATA, nvcc
from tests.support.trees import TreeFactory, Variant, variants

pytestmark = pytest.mark.nvcc
HEADER = "nvfp4_utils.cuh"
PLAIN_TARGETS = (nvcc.PLAIN_SM121, nvcc.COMPUTE_120)


def torch_include() -> Path:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None, "torch (the CPU wheel) provides the header-only c10 includes"
    return Path(spec.origin).parent / "include"


def torch_root() -> nvcc.Root:
    import torch

    return nvcc.Root(torch_include(), identity=f"torch {torch.__version__}")


def vec8_name(text: str) -> str:
    return "fp32_vec8_to_e2m1" if "fp32_vec8_to_e2m1" in text else "fp32_vec_to_e2m1"


def compile_kernel(tree: Path, rel: str, gencode: str, kind: str, cache: Path) -> nvcc.Compiled:
    """tests/data/e2m1_kernel.cu against the header at ``rel`` (``kind``: -c, -ptx or a program)."""
    header = (tree / rel).parent
    args = ["-std=c++17", f"-DVEC8={vec8_name((tree / rel).read_text())}", "-gencode", gencode]
    # csrc/ is an include folder of vLLM's own build (0.20-0.22 include "cuda_vec_utils.cuh" from it).
    args += ["-I", "{header}", "-I", "{csrc}", "-I", "{torch}", "-DWITH_MAIN" if kind == "program" else kind, "{kernel}"]
    roots = {"header": nvcc.Root(header), "torch": torch_root(), "kernel": nvcc.Root(DATA / "e2m1_kernel.cu")}
    roots["csrc"] = nvcc.Root(tree / "csrc")
    return nvcc.compile_cached(args, roots, {"-c": "k.o", "-ptx": "k.ptx", "program": "k"}[kind], cache)


def compile_all(jobs: dict[str, tuple[Path, str, str, str]], cache: Path) -> dict[str, nvcc.Compiled]:
    """Every job (name -> tree, header, gencode, kind), two at a time (two cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(compile_kernel, *job, cache) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def header_variants(sweep: dict[str, patch.Report]) -> list[Variant]:
    return variants(sweep, HEADER)


def test_every_header_variant_is_found_by_content(header_variants: list[Variant], sweep: dict[str, patch.Report]) -> None:
    """Each release whose header the rule changes belongs to exactly one variant."""
    covered = sorted(v for variant in header_variants for v in variant.versions)
    changing = sorted(v for v, r in sweep.items() if any(Path(rel).name == HEADER for rel in r.overlay.changed))
    assert covered == changing
    assert len({variant.digest for variant in header_variants}) == len(header_variants) > 1


def test_unpatched_header_fails_for_plain_targets(
    sweep: dict[str, patch.Report], pristine: TreeFactory, source_cache: Path
) -> None:
    jobs = {
        f"{u.version} {u.digest} {gencode}": (pristine(u.version), u.path, gencode, "-c")
        for u in variants(sweep, HEADER, patched=False)
        for gencode in PLAIN_TARGETS
    }
    for name, done in compile_all(jobs, source_cache).items():
        assert done.returncode != 0, name
        assert "Instruction 'cvt with .e2m1x2' not supported on .target" in done.stderr, f"{name}:\n{done.stderr[-2000:]}"


def test_every_patched_variant_builds_for_every_target(
    header_variants: list[Variant], patched: TreeFactory, source_cache: Path
) -> None:
    jobs = {
        f"{v.version} {v.digest} {gencode}": (patched(v.version), v.path, gencode, "-c")
        for v in header_variants
        for gencode in nvcc.TARGETS
    }
    failed = {name: done.stderr[-1500:] for name, done in compile_all(jobs, source_cache).items() if done.returncode != 0}
    assert failed == {}


def test_ptx_keeps_the_instruction_only_where_it_exists(
    header_variants: list[Variant], patched: TreeFactory, source_cache: Path
) -> None:
    for v in header_variants:
        native = compile_kernel(patched(v.version), v.path, "arch=compute_121a,code=compute_121a", "-ptx", source_cache)
        jit = compile_kernel(patched(v.version), v.path, nvcc.COMPUTE_120, "-ptx", source_cache)
        assert native.returncode == 0 and jit.returncode == 0, (native.stderr, jit.stderr)
        assert "cvt.rn.satfinite.e2m1x2.f32" in native.output.read_text(), v
        assert "e2m1x2" not in jit.output.read_text(), v


# --- numbers ---------------------------------------------------------------------------------

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def reference(x: float) -> int:
    """E2M1 code by exact arithmetic: nearest magnitude, ties to the even code, saturate, keep the sign."""
    if math.isnan(x):
        return 0x7  # cvt...satfinite turns NaN into +MAXNORM (cuda_fp4.hpp documents the same)
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= 6.0:
        return sign | 7
    exact = Fraction(a)
    code = min(range(8), key=lambda c: (abs(exact - Fraction(MAGNITUDES[c])), c % 2))
    return sign | code


def f32(values: list[float] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def boundary_cases() -> np.ndarray:
    up, down = np.float32(np.inf), np.float32(-np.inf)
    points = list(MAGNITUDES) + [(a + b) / 2 for a, b in itertools.pairwise(MAGNITUDES)]
    around = [v for p in f32(points) for v in (np.nextafter(p, down), p, np.nextafter(p, up))]
    tiny = np.array([1, 2, 0x7FFFFF, 0x800000, 0x800001], dtype=np.uint32).view(np.float32)  # subnormals, min normal
    big = f32([6.000001, 6.5, 7.0, 12.0, 1e10, 3.4028235e38, np.inf])
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001], dtype=np.uint32).view(np.float32)
    positive = np.concatenate([f32(around), tiny, big, f32([0.0])])
    return np.concatenate([positive, -positive, nans])


def random_cases(n: int = 200_000) -> np.ndarray:
    rng = np.random.default_rng(20261121)
    any_bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near_grid = rng.uniform(-8.0, 8.0, size=n).astype(np.float32)
    scaled = (rng.standard_normal(n) * 2.0).astype(np.float32)
    return np.concatenate([any_bits, near_grid, scaled])


@pytest.fixture(scope="module")
def cases(source_cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """All test values (a multiple of 16) and their exact codes, computed once for every variant.

    Exact arithmetic on 600,000 values takes 15 s; the codes are kept in the cache, keyed by the
    values and the source of ``reference``, so a change to either computes them again.
    """
    values = np.concatenate([boundary_cases(), random_cases()])
    values = np.concatenate([values, np.zeros(-len(values) % 16, dtype=np.float32)])
    key = hashlib.sha256(values.tobytes() + inspect.getsource(reference).encode()).hexdigest()[:24]
    stored = source_cache / "test-e2m1" / f"reference-{key}.npy"
    if not stored.is_file():
        stored.parent.mkdir(parents=True, exist_ok=True)
        np.save(stored, np.array([reference(float(v)) for v in values], dtype=np.uint8))
    return values, np.load(stored)


@dataclass(frozen=True)
class Conversion:
    """A function of the header the rule rewrote: its name, input (float[8], float2[4], float2[8])."""

    name: str
    element: str  # float or float2
    count: int  # array length
    wide: bool  # returns u32x2 (16 codes) instead of uint32_t (8 codes)


_FUNCTION = re.compile(
    r"(?m)^(?P<head>[A-Za-z_][^\n;#]*?\b(?P<name>\w+)\((?P<element>float2?) \(&array\)\[(?P<count>\d+)\]\) \{\n)"
)


def conversions(text: str) -> list[tuple[Conversion, str]]:
    """Each function holding a ``#if SPARKBUILD_E2M1_HW`` block, with its text made ``__host__``."""
    found = []
    for m in _FUNCTION.finditer(text):
        body_end = text.index("\n}\n", m.end()) + 3
        body = text[m.start() : body_end]
        if "#if SPARKBUILD_E2M1_HW" not in body:
            continue
        head = m.group("head")
        conversion = Conversion(m.group("name"), m.group("element"), int(m.group("count")), "u32x2" in head.split("(")[0])
        found.append((conversion, body.replace(head, head.replace("__device__", "__host__ __device__"), 1)))
    return found


HOST_MAIN = """
// Generated by tests/patch/test_e2m1.py: reads float32 values (a multiple of 16) on stdin and
// writes, per value: fp32_to_e2m1_software, CUDA's __nv_cvt_float_to_fp4, then the code each
// rewritten conversion function gives (its output nibble for that element).
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
namespace at {{
using c10::BFloat16;
using c10::Half;
}}  // namespace at
#include <cuda_fp4.h>
#include <cstdio>
#include <vector>
#include "nvfp4_utils.cuh"

namespace vllm {{
namespace host_copy {{
{functions}
}}  // namespace host_copy
}}  // namespace vllm

static unsigned char nibble(uint32_t word, int k) {{ return (word >> (4 * k)) & 0xF; }}

int main() {{
  std::vector<float> in;
  float value;
  while (fread(&value, sizeof(value), 1, stdin) == 1) in.push_back(value);
  const int width = 2 + {count};
  std::vector<unsigned char> out(in.size() * width);
  for (size_t i = 0; i < in.size(); ++i) {{
    out[i * width] = vllm::fp32_to_e2m1_software(in[i]);
    out[i * width + 1] = static_cast<unsigned char>(__nv_cvt_float_to_fp4(in[i], __NV_E2M1, cudaRoundNearest));
  }}
  for (size_t g = 0; g < in.size(); g += 16) {{
{calls}
  }}
  fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}}
"""


def call(index: int, c: Conversion) -> str:
    """C++ that runs ``c`` over a group of 16 values (two calls for an 8-element one) into column 2 + index."""
    per = c.count * (2 if c.element == "float2" else 1)
    column = 2 + index
    lines = []
    for start in range(0, 16, per):
        if c.element == "float":
            fill = f"float a[{c.count}]; for (int k = 0; k < {per}; ++k) a[k] = in[g + {start} + k];"
        else:
            pair = f"in[g + {start} + 2 * k], in[g + {start} + 2 * k + 1]"
            fill = f"float2 a[{c.count}]; for (int k = 0; k < {c.count}; ++k) a[k] = make_float2({pair});"
        result = f"auto r = vllm::host_copy::{c.name}(a);"
        if c.wide:
            lo = f"out[(g + {start} + k) * width + {column}] = nibble(r.lo, k);"
            hi = f"out[(g + {start} + 8 + k) * width + {column}] = nibble(r.hi, k);"
            store = f"for (int k = 0; k < 8; ++k) {{ {lo} {hi} }}"
        else:
            store = f"for (int k = 0; k < {per}; ++k) out[(g + {start} + k) * width + {column}] = nibble(r, k);"
        lines.append(f"    {{\n      {fill}\n      {result}\n      {store}\n    }}")
    return "\n".join(lines)


def host_program(tree: Path, rel: str, work: Path, cache: Path) -> tuple[Path, list[Conversion]]:
    found = conversions((tree / rel).read_text())
    assert found, f"{rel}: no function with the software path; the rule wrote nothing callable"
    source = work / "e2m1_host.cu"
    calls = "\n".join(call(i, c) for i, (c, _) in enumerate(found))
    source.write_text(HOST_MAIN.format(functions="\n".join(text for _, text in found), count=len(found), calls=calls))
    roots = {
        "header": nvcc.Root((tree / rel).parent),
        "csrc": nvcc.Root(tree / "csrc"),
        "torch": torch_root(),
        "src": nvcc.Root(source),
    }
    args = ["-std=c++17", "-DNVFP4_ENABLE_ELTS16=1", "-I", "{header}", "-I", "{csrc}", "-I", "{torch}", "{src}"]
    done = nvcc.compile_cached(args, roots, "e2m1_host", cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.output, [c for c, _ in found]


def mismatches(values: np.ndarray, got: np.ndarray, want: np.ndarray) -> list[str]:
    bad = np.nonzero(got != want)[0][:10]
    return [f"{values[i]!r} (0x{values[i : i + 1].view(np.uint32)[0]:08x}): got 0x{got[i]:x}, want 0x{want[i]:x}" for i in bad]


def test_every_conversion_of_every_variant_is_bit_exact(
    header_variants: list[Variant], patched: TreeFactory, cases: tuple[np.ndarray, np.ndarray], source_cache: Path, tmp_path: Path
) -> None:
    values, exact = cases
    for v in header_variants:
        work = tmp_path / v.digest
        work.mkdir()
        exe, found = host_program(patched(v.version), v.path, work, source_cache)
        out = subprocess.run([exe], input=values.tobytes(), capture_output=True, check=True).stdout
        columns = np.frombuffer(out, dtype=np.uint8).reshape(-1, 2 + len(found))
        assert mismatches(values, columns[:, 0], exact) == [], f"{v}: fp32_to_e2m1_software"
        assert mismatches(values, columns[:, 1], exact) == [], f"{v}: CUDA's __nv_cvt_float_to_fp4"
        for i, c in enumerate(found):
            assert mismatches(values, columns[:, 2 + i], exact) == [], f"{v}: {c}"
        # float[8] and float2[4] in every header; float2[8] (vec16) from 0.16 on.
        assert {(c.element, c.count) for c in found} >= {("float", 8), ("float2", 4)}, (v, found)


def test_reference_itself_on_hand_picked_values() -> None:
    """The rational reference, pinned by hand so that a slip in it cannot hide one in the header."""
    table = {0.25: 0x0, 0.2500001: 0x1, 0.75: 0x2, 1.25: 0x2, 1.75: 0x4, 2.5: 0x4, 3.5: 0x6, 5.0: 0x6}
    table |= {5.0000005: 0x7, 6.0: 0x7, 1e9: 0x7, -0.0: 0x8, -0.1: 0x8, -3.0: 0xD, -math.inf: 0xF, math.nan: 0x7}
    for value, code in table.items():
        assert reference(value) == code, value


# --- on a GPU, when there is one ----------------------------------------------------------------


def gpu_capability() -> tuple[int, int] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    done = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    major, minor = done.stdout.split()[0].split(".")
    return int(major), int(minor)


@pytest.mark.gpu
def test_device_conversion_matches_reference(
    header_variants: list[Variant], patched: TreeFactory, cases: tuple[np.ndarray, np.ndarray], source_cache: Path
) -> None:
    capability = gpu_capability()
    if capability is None:
        pytest.skip("no GPU on this machine (nvidia-smi finds none); the host tests above cover the software path")
    sm = f"{capability[0]}{capability[1]}"
    targets = [f"arch=compute_{sm},code=sm_{sm}"]  # plain target: the software path
    if capability[0] >= 10:
        targets.append(f"arch=compute_{sm}a,code=sm_{sm}a")  # arch-specific: the hardware instruction
    values, exact = cases
    for v in header_variants:
        for gencode in targets:
            done = compile_kernel(patched(v.version), v.path, gencode, "program", source_cache)
            assert done.returncode == 0, done.stderr[-3000:]
            run = subprocess.run([done.output], input=values.tobytes(), capture_output=True, check=True)
            words = np.frombuffer(run.stdout, dtype=np.uint32)
            nibbles = ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8).reshape(-1)
            assert mismatches(values, nibbles, exact) == [], (v, gencode)
