"""e2m1-software, proven by compiling with nvcc 13 and by numbers against two independent references.

Compiling: a kernel that calls the header's 8-value conversion is built for ``sm_121a`` (the
instruction is kept), plain ``sm_121`` and ``compute_120`` PTX (JIT on the device). Unpatched, the
plain targets fail in ptxas; patched, all three build, and the PTX for JIT has no e2m1x2 instruction.

Numbers: ``fp32_to_e2m1_software`` runs on the host against an exact rational reference written
here, and against CUDA's own host conversion ``__nv_cvt_float_to_fp4`` from ``cuda_fp4.h``.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.patches.conftest import VERSIONS, TreeFactory

pytestmark = pytest.mark.nvcc
DATA = Path(__file__).parent / "data"
HEADER = "nvfp4_utils.cuh"
PLAIN_TARGETS = ("arch=compute_121,code=sm_121", "arch=compute_120,code=compute_120")
ALL_TARGETS = ("arch=compute_121a,code=sm_121a", *PLAIN_TARGETS)


def nvcc() -> str:
    found = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if found is None:
        pytest.fail("nvcc (CUDA 13) is not on PATH; these tests compile the patched kernels with it")
    return found


def torch_include() -> Path:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None, "torch (the CPU wheel) provides the header-only c10 includes"
    return Path(spec.origin).parent / "include"


def header_dir(tree: Path) -> Path:
    found = sorted((tree / "csrc").rglob(HEADER))
    assert len(found) == 1, found
    return found[0].parent


def vec8_name(tree: Path) -> str:
    text = (header_dir(tree) / HEADER).read_text()
    return "fp32_vec8_to_e2m1" if "fp32_vec8_to_e2m1" in text else "fp32_vec_to_e2m1"


def compile_kernel(tree: Path, gencode: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [nvcc(), "-std=c++17", f"-DVEC8={vec8_name(tree)}", "-gencode", gencode]
    args += ["-I", str(header_dir(tree)), "-I", str(torch_include()), *extra, str(DATA / "e2m1_kernel.cu"), "-o", str(out)]
    return subprocess.run(args, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("version", VERSIONS)
def test_unpatched_header_fails_for_plain_targets(version: str, pristine: TreeFactory, tmp_path: Path) -> None:
    for gencode in PLAIN_TARGETS:
        done = compile_kernel(pristine(version), gencode, tmp_path / "k.o", "-c")
        assert done.returncode != 0, gencode
        assert "Instruction 'cvt with .e2m1x2' not supported on .target" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("version", VERSIONS)
def test_patched_header_builds_for_every_target(version: str, patched: TreeFactory, tmp_path: Path) -> None:
    for gencode in ALL_TARGETS:
        done = compile_kernel(patched(version), gencode, tmp_path / "k.o", "-c")
        assert done.returncode == 0, f"{gencode}:\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
def test_ptx_keeps_the_instruction_only_where_it_exists(version: str, patched: TreeFactory, tmp_path: Path) -> None:
    tree = patched(version)
    native = tmp_path / "native.ptx"
    jit = tmp_path / "jit.ptx"
    assert compile_kernel(tree, "arch=compute_121a,code=compute_121a", native, "-ptx").returncode == 0
    assert compile_kernel(tree, "arch=compute_120,code=compute_120", jit, "-ptx").returncode == 0
    assert "cvt.rn.satfinite.e2m1x2.f32" in native.read_text()
    assert "e2m1x2" not in jit.read_text()


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


@pytest.fixture(scope="module", params=["0.11.0", "0.33.0"])
def host_program(request: pytest.FixtureRequest, patched: TreeFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = patched(request.param)
    exe = tmp_path_factory.mktemp("e2m1") / "e2m1_host"
    args = [
        nvcc(),
        "-std=c++17",
        "-I",
        str(header_dir(tree)),
        "-I",
        str(torch_include()),
        str(DATA / "e2m1_host.cu"),
        "-o",
        str(exe),
    ]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return exe


def run_host(exe: Path, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = subprocess.run([exe], input=values.astype(np.float32).tobytes(), capture_output=True, check=True).stdout
    pairs = np.frombuffer(out, dtype=np.uint8).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def mismatches(values: np.ndarray, got: np.ndarray, want: np.ndarray) -> list[str]:
    bad = np.nonzero(got != want)[0][:10]
    return [f"{values[i]!r} (0x{values[i : i + 1].view(np.uint32)[0]:08x}): got 0x{got[i]:x}, want 0x{want[i]:x}" for i in bad]


@pytest.mark.parametrize("cases", ["boundaries", "random"])
def test_software_conversion_matches_both_references(host_program: Path, cases: str) -> None:
    values = boundary_cases() if cases == "boundaries" else random_cases()
    ours, cuda = run_host(host_program, values)
    exact = np.array([reference(float(v)) for v in values], dtype=np.uint8)
    assert mismatches(values, ours, exact) == []
    assert mismatches(values, cuda, exact) == []


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
def test_device_conversion_matches_reference(patched: TreeFactory, tmp_path: Path) -> None:
    capability = gpu_capability()
    if capability is None:
        pytest.skip("no GPU on this machine (nvidia-smi finds none); the host tests above cover the software path")
    sm = f"{capability[0]}{capability[1]}"
    targets = [f"arch=compute_{sm},code=sm_{sm}"]  # plain target: the software path
    if capability[0] >= 10:
        targets.append(f"arch=compute_{sm}a,code=sm_{sm}a")  # arch-specific: the hardware instruction
    values = np.concatenate([boundary_cases(), random_cases(20_000)])
    values = np.concatenate([values, np.zeros(-len(values) % 8, dtype=np.float32)])
    exact = np.array([reference(float(v)) for v in values], dtype=np.uint8)
    for gencode in targets:
        exe = tmp_path / "device"
        done = compile_kernel(patched("0.33.0"), gencode, exe, "-DWITH_MAIN")
        assert done.returncode == 0, done.stderr[-3000:]
        words = np.frombuffer(
            subprocess.run([exe], input=values.tobytes(), capture_output=True, check=True).stdout, dtype=np.uint32
        )
        nibbles = ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8).reshape(-1)
        assert mismatches(values, nibbles, exact) == [], gencode
