"""mxfp4-cutlass-sm12x on real sources: what it changes, and that the SM12x build really computes.

The trap this patch exists to avoid: vLLM's MXFP4 grouped GEMM is an SM100 kernel, and built for
sm_121a it compiles to thousands of instructions and not one MMA, so a patch that only opens the capability gate and the
arch list ships a GEMM that returns garbage. The compile tests build both, with nvcc 13 against
CUTLASS's headers (the ``nvidia-cutlass`` wheel from PyPI) and read the SASS with cuobjdump:
unpatched, the sm_121a GEMM has no MMA instruction; patched, it is full of SM120's block-scaled
``OMMA.SF ... E2M1.E2M1.E8`` (MXF4 with E8M0 scales).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from builder import binaries, patch, sources
from builder.patch import cmake
from builder.patch.rules import mxfp4_cutlass_sm12x as rule
from builder.options import Options
from tests.patches.conftest import PATCHES, TreeFactory
from tests.patches.test_e2m1 import nvcc, torch_include

GEMM = f"csrc/quantization/fp4/{rule.GEMM}"
QUANT = f"csrc/quantization/fp4/{rule.QUANT}"
CUTLASS_WHEEL = "nvidia_cutlass-4.2.0.0-py3-none-any.whl"
CUBLAS_VERSION = "13.10.0.20"
SM121A = "arch=compute_121a,code=sm_121a"


def only_mxfp4(tree: Path, version: str) -> patch.Report:
    return patch.check(tree, patch.load(PATCHES, ("mxfp4-cutlass-sm12x",)), version)


def function(text: str, name: str) -> str:
    """The text of the C++ function ``name``, from its name to the brace that closes its body."""
    start = text.index(f"void {name}(")
    depth, i = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
        i += 1


# --- what the patched files hold ---------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.11.0", "0.19.0"])
def test_versions_without_the_cutlass_mxfp4_moe_are_not_applicable(version: str, pristine: TreeFactory) -> None:
    (result,) = only_mxfp4(pristine(version), version).results
    assert (result.status, result.detail) == ("not-applicable", f"no {rule.GEMM} under csrc/: this version has no CUTLASS MXFP4 MoE")


def test_patched_0_33_0_dispatches_sm12x_to_an_sm120_kernel(patched: TreeFactory, pristine: TreeFactory) -> None:
    tree, before = patched("0.33.0"), pristine("0.33.0")
    gemm = (tree / GEMM).read_text()
    sm120 = function(gemm, rule.SM120_FN)
    assert "using ArchTag = cutlass::arch::Sm120;" in sm120
    assert "cutlass::mx_float4_t<cutlass::float_e2m1_t>" in sm120
    assert "cutlass::detail::Sm1xxBlockScaledConfig<32>" in sm120  # the scale layout Python writes
    dispatch = function(gemm, "run_mxfp4_blockwise_scaled_group_mm")
    assert dispatch.index("version_num >= 120 && version_num < 130") < dispatch.index("version_num >= 100")
    assert "#if defined ENABLE_NVFP4_SM100 && ENABLE_NVFP4_SM100\n  if (version_num >= 100" in dispatch
    op = gemm[gemm.index("void cutlass_mxfp4_group_mm(") :]
    assert op.count("(defined ENABLE_NVFP4_SM120 && ENABLE_NVFP4_SM120)") == 1
    # The SM100 kernel itself is untouched.
    old = (before / GEMM).read_text()
    sm100 = "run_mxfp4_blockwise_scaled_group_mm_sm100"
    assert function(gemm, sm100) == function(old, sm100)

    quant = (tree / QUANT).read_text()
    assert "return cuda_device_capability >= 100 && cuda_device_capability < 130;" in quant
    assert "< 120" not in quant


def source_list(text: str, var: str) -> list[str]:
    (c,) = [c for c in cmake.commands(text) if c.name == "set" and c.args.split()[:1] == [var]]
    return re.findall(r'"([^"]+)"', c.args)


def test_patched_0_33_0_builds_both_mxfp4_sources_for_sm12x(patched: TreeFactory, pristine: TreeFactory) -> None:
    cmake = (patched("0.33.0") / "CMakeLists.txt").read_text()
    old = (pristine("0.33.0") / "CMakeLists.txt").read_text()
    assert source_list(cmake, "FP4_SM120_SRCS") == [*source_list(old, "FP4_SM120_SRCS"), QUANT, GEMM]
    assert source_list(cmake, "FP4_SM100_SRCS") == source_list(old, "FP4_SM100_SRCS")


def test_a_moved_gate_is_a_conflict_that_names_the_file(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.33.0")
    quant = tree / QUANT
    quant.write_text(quant.read_text().replace("cuda_device_capability < 120", "cuda_device_capability <= 119"))
    (result,) = only_mxfp4(tree, "0.33.0").results
    assert result.status == "conflict"
    assert result.detail.startswith(f"{QUANT}: expected the gate"), result.detail


# --- compiled for sm_121a, read back from the SASS ------------------------------------------------


@pytest.fixture(scope="module")
def includes() -> list[str]:
    """CUTLASS's headers and cuBLAS's (vLLM's torch_utils.h includes cublas_v2.h) beside torch's."""
    cache = Options.from_env().cache
    cutlass = sources.wheel_tree("nvidia-cutlass", CUTLASS_WHEEL, cache, only="cutlass_library/source/")
    found = shutil.which("nvcc")
    toolkit = Path(found).resolve().parent.parent / "include" if found else None
    if toolkit is not None and (toolkit / "cublas_v2.h").is_file():
        cublas = toolkit
    else:
        wheel = cublas_wheel()
        cublas = sources.wheel_tree("nvidia-cublas", wheel, cache, only="nvidia/cu13/include/") / "nvidia/cu13/include"
    source = cutlass / "cutlass_library" / "source"
    return [str(source / "include"), str(source / "tools/util/include"), str(torch_include()), str(cublas)]


def cublas_wheel() -> str:
    names = sources.index_links("nvidia-cublas", suffix=".whl")
    machine = platform.machine()
    found = sorted(n for n in names if n.startswith(f"nvidia_cublas-{CUBLAS_VERSION}-") and machine in n)
    if not found:
        pytest.fail(f"PyPI has no nvidia-cublas {CUBLAS_VERSION} wheel for {machine}")
    return found[0]


def compile_sm121a(tree: Path, rel: str, includes: list[str], out: Path, *defines: str) -> subprocess.CompletedProcess[str]:
    args = [nvcc(), "-std=c++17", "-c", "-gencode", SM121A, "-DUSE_CUDA", *defines]
    args += ["--expt-relaxed-constexpr", "--expt-extended-lambda"]
    for folder in (tree / "csrc", tree / "csrc/cutlass_extensions", *map(Path, includes)):
        args += ["-I", str(folder)]
    return subprocess.run([*args, str(tree / rel), "-o", str(out)], capture_output=True, text=True, check=False)


def gemm_sass(obj: Path) -> str:
    """The SASS of the CUTLASS GemmUniversal kernels in ``obj``."""
    tool = binaries.cuobjdump()
    # -sass runs nvdisasm; PyPI's nvidia-cuda-nvdisasm puts it beside PyPI's cuobjdump.
    env = {**os.environ, "NVDISASM_PATH": str(tool.parent / "nvdisasm")} if (tool.parent / "nvdisasm").is_file() else None
    done = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True, env=env)
    kernels = re.split(r"\n\s*Function : ", done.stdout)
    return "\n".join(k for k in kernels if k.startswith("_ZN7cutlass13device_kernel") and "GemmUniversal" in k[:200])


@pytest.mark.nvcc
def test_sm121a_gemm_has_no_mma_unpatched_and_mxf4_mma_patched(
    patched: TreeFactory, pristine: TreeFactory, includes: list[str], tmp_path: Path
) -> None:
    jobs = {
        # What a gate-and-arch-list-only patch would build: the SM100 kernel for sm_121a.
        "sm100": (pristine("0.33.0"), GEMM, "-DENABLE_NVFP4_SM100=1"),
        "sm120": (patched("0.33.0"), GEMM, "-DENABLE_NVFP4_SM120=1"),
        "quant": (patched("0.33.0"), QUANT, "-DENABLE_NVFP4_SM120=1"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = {k: pool.submit(compile_sm121a, t, rel, includes, tmp_path / f"{k}.o", d) for k, (t, rel, d) in jobs.items()}
        results = {k: f.result() for k, f in done.items()}
    for name, result in results.items():
        assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
    sm100 = gemm_sass(tmp_path / "sm100.o")
    # Compiled, thousands of instructions, and not one MMA: the garbage trap.
    assert len(re.findall(r"(?m)^\s+/\*[0-9a-f]{4,}\*/", sm100)) > 1000
    assert mma_instructions(sm100) == set()
    assert mma_instructions(gemm_sass(tmp_path / "sm120.o")) == {"OMMA.SF.16864.F32.E2M1.E2M1.E8"}


def mma_instructions(sass: str) -> set[str]:
    """MMA opcodes with their modifiers (a dot follows; the kernels' mangled names have none)."""
    return set(re.findall(r"\b[A-Z]*MMA\.[A-Z0-9.]+", sass))
