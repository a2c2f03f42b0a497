"""mxfp4-cutlass-sm12x on every distinct variant of the files it changes, found by content hash
across every release: what it changes, and that the SM12x build really computes.

The trap this patch exists to avoid: vLLM's MXFP4 grouped GEMM is an SM100 kernel, and built for
sm_121a it compiles to thousands of instructions and not one MMA, so a patch that only opens the
capability gate and the arch list ships a GEMM that returns garbage. The compile tests build every
variant of both kernel files for sm_121a, plain sm_121 and compute_120 with nvcc 13 against
CUTLASS's headers (the ``nvidia-cutlass`` wheel from PyPI), and read the sm_121a SASS with cuobjdump:
unpatched, the GEMM has no MMA instruction; patched, every variant is full of SM120's block-scaled
``OMMA.SF ... E2M1.E2M1.E8`` (MXF4 with E8M0 scales). (For plain sm_121 and compute_120, CUTLASS
compiles the SM120 collective to a guarded trap, as it does for any arch-conditional MMA; vLLM only
ever builds these files for 12.0a/12.1a/12.0f, and the point there is that they build.)
"""

from __future__ import annotations

import ast
import hashlib
import platform
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.patch import cmake
from sparkbuild.patch.rules import mxfp4_cutlass_sm12x as rule
from sparkbuild.upstream import sources
from tests.support import nvcc
from tests.support.sass import gemm_sass, mma_instructions
from tests.support.trees import PATCHES, TreeFactory, Variant, variants

CUTLASS_WHEEL = "nvidia_cutlass-4.2.0.0-py3-none-any.whl"
CUBLAS_VERSION = "13.10.0.20"


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


@pytest.fixture(scope="module")
def gemm_variants(sweep: dict[str, patch.Report]) -> list[Variant]:
    return variants(sweep, rule.GEMM)


@pytest.fixture(scope="module")
def quant_variants(sweep: dict[str, patch.Report]) -> list[Variant]:
    """Every distinct quant kernel the patched build compiles for SM12x: the rule changes its gate
    from 0.24.0, and on 0.20.0 - 0.23.0 adds it, unchanged, to the SM12x sources."""
    found: dict[str, list[tuple[str, str]]] = {}
    for version, report in sweep.items():
        for rel in [r for r in report.overlay.changed if Path(r).name == rule.GEMM]:
            quant = f"{rel.rsplit('/', 1)[0]}/{rule.QUANT}"
            text = report.overlay.read(quant)
            found.setdefault(hashlib.sha256(text.encode()).hexdigest()[:12], []).append((version, quant))
    return [Variant(uses[-1][1], digest, uses[-1][0], tuple(v for v, _ in uses)) for digest, uses in found.items()]


# --- what the patched files hold ---------------------------------------------------------------


def test_every_quant_kernel_the_build_compiles_is_a_variant(quant_variants: list[Variant]) -> None:
    """Five contents: two the rule leaves as they are (0.20.0 - 0.23.0) and three whose gate it opens."""
    assert len(quant_variants) == 5
    assert sorted(v for variant in quant_variants for v in variant.versions)[0] == "0.20.0"


def test_the_kernel_is_found_in_both_layouts(sweep: dict[str, patch.Report], gemm_variants: list[Variant]) -> None:
    """csrc/libtorch_stable/quantization/fp4/ on 0.20-0.31, csrc/quantization/fp4/ from 0.32; none before 0.20."""
    layouts = {v.path.rsplit("/", 1)[0] for v in gemm_variants}
    assert layouts == {"csrc/libtorch_stable/quantization/fp4", "csrc/quantization/fp4"}
    for version, report in sweep.items():
        (result,) = [r for r in report.results if r.patch == "mxfp4-cutlass-sm12x"]
        has_kernel = bool(list(report.source.joinpath("csrc").rglob(rule.GEMM)))
        if has_kernel:
            assert result.status == "applies", (version, result)
        else:
            no_kernel = f"no {rule.GEMM} under csrc/: this version has no CUTLASS MXFP4 MoE"
            assert (result.status, result.detail) == ("not-applicable", no_kernel)


def test_every_gemm_variant_dispatches_sm12x_to_an_sm120_kernel(
    gemm_variants: list[Variant], patched: TreeFactory, pristine: TreeFactory
) -> None:
    for v in gemm_variants:
        gemm = (patched(v.version) / v.path).read_text()
        sm120 = function(gemm, rule.SM120_FN)
        assert "using ArchTag = cutlass::arch::Sm120;" in sm120
        assert "cutlass::mx_float4_t<cutlass::float_e2m1_t>" in sm120
        assert "cutlass::detail::Sm1xxBlockScaledConfig<32>" in sm120  # the scale layout Python writes
        dispatch = function(gemm, "run_mxfp4_blockwise_scaled_group_mm")
        assert dispatch.index("version_num >= 120 && version_num < 130") < dispatch.index("version_num >= 100"), v
        assert "#if defined ENABLE_NVFP4_SM100 && ENABLE_NVFP4_SM100\n  if (version_num >= 100" in dispatch, v
        op = gemm[gemm.index("void cutlass_mxfp4_group_mm(") :]
        assert op.count("(defined ENABLE_NVFP4_SM120 && ENABLE_NVFP4_SM120)") == 1, v
        # The SM100 kernel itself is untouched.
        old = (pristine(v.version) / v.path).read_text()
        sm100 = "run_mxfp4_blockwise_scaled_group_mm_sm100"
        assert function(gemm, sm100) == function(old, sm100), v


def test_the_gate_admits_sm12x_in_cpp_or_python(sweep: dict[str, patch.Report], patched: TreeFactory) -> None:
    """From 0.24.0 the C++ gate in mxfp4_experts_quant.cu; on 0.20.0-0.23.0, where that file has no
    gate, CutlassExpertsMxfp4._supports_current_device() in Python."""
    seen = set()
    for version, report in sweep.items():
        if not any(Path(rel).name == rule.GEMM for rel in report.overlay.changed):
            continue
        tree = patched(version)
        (quant,) = list((tree / "csrc").rglob(rule.QUANT))
        text = quant.read_text()
        if "mxfp4_experts_quant_sm_supported" in text:
            seen.add("c++")
            assert "return cuda_device_capability >= 100 && cuda_device_capability < 130;" in text, version
            assert "< 120" not in text, version
        else:
            seen.add("python")
            source = (tree / rule.PY_GATE).read_text()
            module = ast.parse(source)
            (cls,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "CutlassExpertsMxfp4"]
            (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_supports_current_device"]
            body = ast.unparse(fn)
            assert "p.is_device_capability_family(100) or p.is_device_capability_family(120)" in body, version
            compile(source, rule.PY_GATE, "exec")
    assert seen == {"c++", "python"}


def source_list(text: str, anchor: str) -> list[str]:
    (c,) = [c for c in cmake.commands(text) if c.name == "set" and any(i.endswith(anchor) for i in c.quoted())]
    return re.findall(r'"([^"]+)"', c.args)


def test_every_release_builds_both_mxfp4_sources_for_sm12x(sweep: dict[str, patch.Report], pristine: TreeFactory) -> None:
    for version, report in sweep.items():
        changed = report.overlay.changed
        gemm = [rel for rel in changed if Path(rel).name == rule.GEMM]
        if not gemm:
            continue
        folder = gemm[0].rsplit("/", 1)[0]
        new, old = changed["CMakeLists.txt"], (pristine(version) / "CMakeLists.txt").read_text()
        sm120 = source_list(new, rule.SM120_ANCHOR)
        assert sm120 == [*source_list(old, rule.SM120_ANCHOR), f"{folder}/{rule.QUANT}", f"{folder}/{rule.GEMM}"], version
        # The SM100 list (the one with the SM100 NVFP4 GEMM) is left as it was.
        assert source_list(new, "nvfp4_scaled_mm_kernels.cu") == source_list(old, "nvfp4_scaled_mm_kernels.cu"), version


def test_a_moved_gate_is_a_conflict_that_names_the_file(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.33.0")
    quant = tree / "csrc/quantization/fp4" / rule.QUANT
    quant.write_text(quant.read_text().replace("cuda_device_capability < 120", "cuda_device_capability <= 119"))
    (result,) = only_mxfp4(tree, "0.33.0").results
    assert result.status == "conflict"
    assert result.detail.startswith(f"csrc/quantization/fp4/{rule.QUANT}: expected the gate"), result.detail


# --- compiled for sm_121a, plain sm_121 and compute_120; the sm_121a SASS read back ------------------


@pytest.fixture(scope="module")
def includes() -> dict[str, nvcc.Root]:
    """CUTLASS's headers and cuBLAS's (vLLM's torch_utils.h includes cublas_v2.h) beside torch's."""
    import torch

    cache = Options.from_env().cache
    cutlass = sources.wheel_tree("nvidia-cutlass", CUTLASS_WHEEL, cache, only="cutlass_library/source/")
    found = shutil.which("nvcc")
    toolkit = Path(found).resolve().parent.parent / "include" if found else None
    if toolkit is not None and (toolkit / "cublas_v2.h").is_file():
        cublas = nvcc.Root(toolkit, identity=f"toolkit {toolkit}")
    else:
        wheel = cublas_wheel()
        tree = sources.wheel_tree("nvidia-cublas", wheel, cache, only="nvidia/cu13/include/")
        cublas = nvcc.Root(tree / "nvidia/cu13/include", identity=wheel)
    source = cutlass / "cutlass_library" / "source"
    spec_origin = Path(torch.__file__).parent / "include"
    return {
        "cutlass": nvcc.Root(source / "include", identity=CUTLASS_WHEEL),
        "cutlass_util": nvcc.Root(source / "tools/util/include", identity=CUTLASS_WHEEL),
        "torch": nvcc.Root(spec_origin, identity=f"torch {torch.__version__}"),
        "cublas": cublas,
    }


def cublas_wheel() -> str:
    names = sources.index_links("nvidia-cublas", suffix=".whl")
    machine = platform.machine()
    found = sorted(n for n in names if n.startswith(f"nvidia_cublas-{CUBLAS_VERSION}-") and machine in n)
    if not found:
        pytest.fail(f"PyPI has no nvidia-cublas {CUBLAS_VERSION} wheel for {machine}")
    return found[0]


def compile_kernel(tree: Path, rel: str, gencode: str, define: str, includes: dict[str, nvcc.Root], cache: Path) -> nvcc.Compiled:
    args = ["-std=c++17", "-c", "-gencode", gencode, "-DUSE_CUDA", define, "--expt-relaxed-constexpr", "--expt-extended-lambda"]
    args += ["-I", "{csrc}", "-I", "{csrc}/cutlass_extensions"]
    for name in includes:
        args += ["-I", f"{{{name}}}"]
    roots = {**includes, "csrc": nvcc.Root(tree / "csrc")}
    return nvcc.compile_cached([*args, f"{{csrc}}/{rel.removeprefix('csrc/')}"], roots, "kernel.o", cache)


@pytest.mark.nvcc
def test_every_variant_builds_for_every_target_and_the_sm121a_gemm_computes_mxf4(
    gemm_variants: list[Variant],
    quant_variants: list[Variant],
    patched: TreeFactory,
    pristine: TreeFactory,
    includes: dict[str, nvcc.Root],
    source_cache: Path,
) -> None:
    newest = gemm_variants[-1]
    jobs = {
        # What a gate-and-arch-list-only patch would build: the SM100 kernel for sm_121a.
        "unpatched sm100 gemm": (pristine(newest.version), newest.path, nvcc.SM121A, "-DENABLE_NVFP4_SM100=1"),
    }
    for v in [*gemm_variants, *quant_variants]:
        for gencode in nvcc.TARGETS:
            jobs[f"{v.path.rsplit('/', 1)[1]} {v.digest} ({v.version}) {gencode}"] = (
                patched(v.version),
                v.path,
                gencode,
                "-DENABLE_NVFP4_SM120=1",
            )
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(compile_kernel, *job, includes, source_cache) for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    failed = {name: r.stderr[-1500:] for name, r in results.items() if r.returncode != 0}
    assert failed == {}
    sm100 = gemm_sass(results["unpatched sm100 gemm"].output)
    # Compiled, thousands of instructions, and not one MMA: the garbage trap.
    assert len(re.findall(r"(?m)^\s+/\*[0-9a-f]{4,}\*/", sm100)) > 1000
    assert mma_instructions(sm100) == set()
    for v in gemm_variants:
        sass = gemm_sass(results[f"{rule.GEMM} {v.digest} ({v.version}) {nvcc.SM121A}"].output)
        assert mma_instructions(sass) == {"OMMA.SF.16864.F32.E2M1.E2M1.E8"}, v
