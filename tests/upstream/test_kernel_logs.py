"""kernel-paths.yaml held to vLLM's own source: every release's sdist from PyPI (sha256 from the
simple index; only the files the kinds read, kept under ``$SPARKBUILD_CACHE/kernel-log-trees/``,
their log statements cached beside them), and the gate run on log lines made from the real
statements (``sparkbuild.upstream.kernellogs``, ``sparkbuild.upstream.logcalls``): no CUDA log line here is typed by hand,
only the values vLLM formats into its messages, each checked to be a name its source has.

A release past THROUGH (tests/support/trees.py) fails here until a range of kernel-paths.yaml
ends at it: the table is extended by reading the new release's statements, never assumed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbuild.errors import VerifyError
from sparkbuild.patch import releases
from sparkbuild.upstream import kernellogs, kernelpath, sources
from sparkbuild.upstream.logcalls import Statement
from tests.support import DATA
from tests.support.trees import RELEASES, THROUGH, WHEELS_ONLY

FOLDER = "kernel-log-trees"
# How vLLM's logger starts a line (vllm/logger.py): the gate searches the message after it.
PREFIX = "(EngineCore pid=1) INFO 05-01 12:00:00 "


@pytest.fixture(scope="session")
def kernel_releases(source_cache: Path) -> dict[str, kernellogs.Release]:
    """Every release's kernel-choice files, sliced from its sdist (downloaded four at a time where
    missing; the archive is dropped), and their statements."""
    patterns = kernellogs.globs()
    missing = [v for v in RELEASES if not _sliced(source_cache / FOLDER / f"vllm-{v}", patterns)]
    if missing:
        links = sources.index_links("vllm")
        found = [releases.Release(v, sources.sdist_link(v, links)) for v in missing]
        releases.trees(found, source_cache, patterns, full_ok=False, folder=FOLDER)
    return {
        v: kernellogs.read_release(v, releases.tree(v, source_cache, patterns, full_ok=False, folder=FOLDER), patterns)
        for v in RELEASES
    }


def _sliced(tree: Path, patterns: tuple[str, ...]) -> bool:
    stamp = tree / releases.STAMP
    return stamp.is_file() and set(patterns) <= set(json.loads(stamp.read_text())["patterns"])


def test_every_pattern_reads_a_choice_of_every_release_of_its_range_and_every_choice_is_read(
    kernel_releases: dict[str, kernellogs.Release],
) -> None:
    problems = kernellogs.check(kernelpath.table(), kernellogs.table_sources(), list(kernel_releases.values()), THROUGH)
    assert not problems, (
        f"{len(problems)} disagreement(s) of {kernelpath.WHERE} with vLLM's source (a dead pattern: narrow it with "
        "'vllm:' or fix it; an unread choice: add a pattern, or a 'sources: KIND: not_choices:' entry saying why it is "
        "none):\n" + "\n".join(problems[:60])
    )


def without(patterns: list[Any], words: str) -> list[Any]:
    return [p for p in patterns if words not in str(p)]


def unread_0_11_attention(data: dict[str, Any]) -> None:
    """What the table held before these tests: 0.11.1's "Using FLASH_ATTN backend." unread."""
    kinds = data["ranges"][2]["kinds"]
    kinds["attention"]["patterns"] = without(kinds["attention"]["patterns"], "AttentionBackendEnum")


def unread_cpu_experts(data: dict[str, Any]) -> None:
    kinds = data["ranges"][0]["kinds"]
    kinds["moe"]["patterns"] = without(kinds["moe"]["patterns"], "CPUUnquantizedExperts")


def past_the_newest_release(data: dict[str, Any]) -> None:
    data["ranges"][0]["vllm"] = ">=0.19.0,<=0.34.0"


def words_no_release_of_the_range_logs(data: dict[str, Any]) -> None:
    data["ranges"][0]["kinds"]["attention"]["patterns"].append("Using (?P<backend>[A-Za-z ]+?) backend on V1 engine")


@pytest.mark.parametrize(
    ("break_it", "version", "said"),
    [
        (
            unread_0_11_attention,
            "0.11.1",
            "vLLM 0.11.1 vllm/platforms/cuda.py:377 info: 'Using {} backend.': a attention choice no pattern of ranges[2] reads",
        ),
        (
            unread_cpu_experts,
            "0.32.0",
            "vLLM 0.32.0 vllm/model_executor/layers/fused_moe/oracle/unquantized.py:529 info_once: 'Using {} MoE backend': a moe",
        ),
        (past_the_newest_release, "0.33.0", "kernel-paths.yaml ranges[0]: ends at 0.34.0, a release this check did not read"),
        (
            words_no_release_of_the_range_logs,
            "0.19.0",
            "ranges[0].kinds.attention.patterns[2] 'Using (?P<backend>[A-Za-z ]+?) backend on V1 engine' "
            "matches no attention choice vLLM 0.19.0 logs",
        ),
    ],
)  # fmt: skip
def test_a_table_that_disagrees_with_the_source_is_caught(
    kernel_releases: dict[str, kernellogs.Release], break_it: Callable[[dict[str, Any]], None], version: str, said: str
) -> None:
    """The shipped table (which agrees with every release: the test above) broken as a table can be,
    held to the one release that shows it."""
    data = yaml.safe_load(kernelpath.raw_text())
    break_it(data)
    problems = kernellogs.check(kernelpath.parse(data, "t"), kernellogs.table_sources(), [kernel_releases[version]], THROUGH)
    assert any(p.startswith(said) for p in problems), problems[:5]


def test_a_release_with_wheels_only_has_no_range_its_source_unread() -> None:
    for version in WHEELS_ONLY:
        with pytest.raises(VerifyError, match=rf"no range of .*covers vLLM {version}"):
            kernelpath.for_version(version)


# --- the gate on lines made from the real statements ----------------------------------------------


def statement(rel: kernellogs.Release, file: str, words: str) -> Statement:
    """The one statement of ``file`` (a path suffix) whose message contains ``words``."""
    found = {s.text(default="{}"): s for s in rel.statements if s.file.endswith(file) and words in s.text(default="{}")}
    assert len(found) == 1, f"vLLM {rel.version} {file}: {len(found)} statements with {words!r}: {list(found)}"
    return next(iter(found.values()))


def logged(rel: kernellogs.Release, file: str, words: str, *values: str) -> str:
    """The log line vLLM writes for that statement with ``values`` formatted in; each value that is
    one name must be a name of the statement's file (an enum value, a class it imports)."""
    s = statement(rel, file, words)
    names = rel.names.get(s.file, frozenset())
    for value in values:
        assert value in names or not value.isidentifier(), f"{value!r} is no name of vLLM {rel.version} {s.file}"
    return f"{PREFIX}[{Path(s.file).name}:{s.line}] {s.text(*values)}"


CUDA = "vllm/platforms/cuda.py"
NVFP4_MOE = "fused_moe/oracle/nvfp4.py"


@pytest.mark.parametrize(
    ("version", "file", "words", "values", "kind", "backend"),
    [
        # The attention selector of every era: enum names from 0.12, words before.
        ("0.33.0", CUDA, "attention backend out of", ("FLASHINFER", "['FLASHINFER', 'TRITON_ATTN']"), "attention", "FLASHINFER"),
        ("0.19.0", CUDA, "attention backend out of", ("TRITON_ATTN", "['TRITON_ATTN']"), "attention", "TRITON_ATTN"),
        ("0.14.1", CUDA, "attention backend out of", ("FLASH_ATTN", "['FLASH_ATTN']"), "attention", "FLASH_ATTN"),
        # --attention-backend given: the enum itself is formatted in (no __str__ of its own).
        ("0.33.0", CUDA, "Using {} backend.", ("AttentionBackendEnum.FLASHINFER",), "attention", "FLASHINFER"),
        # 0.11.1 and 0.11.2 name the backend so too, where the old table read only 0.11.0's words.
        ("0.11.2", CUDA, "Using {} backend.", ("FLASH_ATTN",), "attention", "FLASH_ATTN"),
        ("0.11.0", CUDA, "Using Flash Attention backend on V1 engine.", (), "attention", "FLASH_ATTN"),
        ("0.10.2", CUDA, "Using FlashInfer backend with HND KV cache layout", (), "attention", "FLASHINFER"),
        # The fused-MoE oracles, and the quantization methods before them.
        ("0.33.0", NVFP4_MOE, "NvFp4 MoE backend out of", ("VLLM_CUTLASS", "['VLLM_CUTLASS']"), "moe", "VLLM_CUTLASS"),
        ("0.19.0", NVFP4_MOE, "NvFp4 MoE backend out of", ("FLASHINFER_CUTLASS", "[]"), "moe", "FLASHINFER_CUTLASS"),
        (
            "0.33.0",
            "oracle/mxfp4.py",
            "Mxfp4 MoE backend.",
            ("FLASHINFER_CUTLASS_MXFP4_MXFP8",),
            "moe",
            "FLASHINFER_CUTLASS_MXFP4_MXFP8",
        ),
        ("0.33.0", "oracle/fp8.py", "Fp8 MoE backend out of", ("TRITON", "['TRITON']"), "moe", "TRITON"),
        ("0.19.0", "oracle/unquantized.py", "backend for Unquantized MoE", ("FlashInfer CUTLASS",), "moe", "FLASHINFER_CUTLASS"),
        # 0.14's NvFp4 oracle, with vLLM's own typo in the enum's value.
        ("0.14.1", NVFP4_MOE, "Using {} backend for NvFp4 MoE", ("vLLM CUTASS",), "moe", "VLLM_CUTLASS"),
        ("0.13.0", "quantization/modelopt.py", "Using Marlin for ModelOptNvFp4FusedMoE.", (), "moe", "MARLIN"),
        ("0.12.0", "quantization/modelopt.py", "kernels for ModelOptNvFp4FusedMoE.", ("CUTLASS",), "moe", "FLASHINFER_CUTLASS"),
        ("0.11.0", "quantization/mxfp4.py", "Using Marlin backend", (), "moe", "MARLIN"),
        # NVFP4 linear layers: a class from 0.20, NvFp4LinearBackend's value before.
        (
            "0.33.0",
            "kernels/linear/__init__.py",
            "for NVFP4 GEMM",
            ("FlashInferCutlassNvFp4LinearKernel",),
            "nvfp4_gemm",
            "FLASHINFER_CUTLASS",
        ),
        ("0.19.0", "utils/nvfp4_utils.py", "for NVFP4 GEMM", ("cutlass",), "nvfp4_gemm", "VLLM_CUTLASS"),
        ("0.14.1", "quantization/modelopt.py", "for NVFP4 GEMM", ("marlin",), "nvfp4_gemm", "MARLIN"),
    ],
)  # fmt: skip
def test_each_range_reads_the_words_its_releases_log(
    kernel_releases: dict[str, kernellogs.Release],
    version: str,
    file: str,
    words: str,
    values: tuple[str, ...],
    kind: str,
    backend: str,
) -> None:
    line = logged(kernel_releases[version], file, words, *values)
    (chosen,) = kernelpath.gate({kind: (backend,)}, line + "\n", version)
    assert chosen.found == ((backend, line),) and chosen.ok


def test_marlin_where_cutlass_is_expected_fails_naming_both(kernel_releases: dict[str, kernellogs.Release]) -> None:
    line = logged(kernel_releases["0.33.0"], NVFP4_MOE, "NvFp4 MoE backend out of", "MARLIN", "['VLLM_CUTLASS', 'MARLIN']")
    chosen = kernelpath.gate({"moe": ("FLASHINFER_CUTLASS", "VLLM_CUTLASS")}, line + "\n", "0.33.0")
    assert kernelpath.failures(chosen, "0.33.0") == [
        f"  moe: expected FLASHINFER_CUTLASS or VLLM_CUTLASS, vLLM chose MARLIN: {line}"
    ]
    assert kernelpath.text(chosen) == "moe MARLIN (UNEXPECTED)"


# --- fallbacks logged after the choice -----------------------------------------------------------


def test_flashinfer_mla_falling_back_to_cute_dsl_is_what_runs(kernel_releases: dict[str, kernellogs.Release]) -> None:
    """0.27 on: FlashInfer MLA is chosen, then its decode falls back to cute-dsl for a head count
    trtllm-gen cannot tile (vllm/v1/attention/backends/mla/flashinfer_mla.py)."""
    rel = kernel_releases["0.33.0"]
    chose = logged(rel, CUDA, "attention backend out of", "FLASHINFER_MLA", "['FLASHINFER_MLA', 'TRITON_MLA']")
    fell = logged(rel, "mla/flashinfer_mla.py", "falling back to the cute-dsl backend", "32")
    log = f"{chose}\n{fell}\n"
    (chosen,) = kernelpath.gate({"attention": ("FLASHINFER_MLA",)}, log, "0.33.0")
    assert chosen.found == (("FLASHINFER_MLA_CUTE_DSL", fell),) and chosen.fell_back == (("FLASHINFER_MLA", chose),)
    assert (
        not chosen.ok
        and kernelpath.text([chosen]) == "attention FLASHINFER_MLA_CUTE_DSL (fell back from FLASHINFER_MLA) (UNEXPECTED)"
    )
    (fine,) = kernelpath.gate({"attention": ("FLASHINFER_MLA_CUTE_DSL",)}, log, "0.33.0")
    assert fine.ok


def test_deepgemm_falling_back_to_triton_is_what_runs(kernel_releases: dict[str, kernellogs.Release]) -> None:
    """The FP8 oracle picks DeepGEMM; DeepGEMM then says (at DEBUG) that a shape falls back to Triton."""
    rel = kernel_releases["0.33.0"]
    chose = logged(rel, "oracle/fp8.py", "Fp8 MoE backend out of", "DEEPGEMM", "['DEEPGEMM', 'TRITON']")
    fell = logged(rel, "experts/deep_gemm_moe.py", "DeepGemm disabled for N <= 512", "8", "256", "2048")
    (chosen,) = kernelpath.gate({"moe": ("DEEPGEMM",)}, f"{chose}\n{fell}\n", "0.33.0")
    assert chosen.found == (("TRITON", fell),) and chosen.fell_back == (("DEEPGEMM", chose),) and not chosen.ok


def test_mxfp4_falling_back_to_bf16_activations_keeps_its_backend(kernel_releases: dict[str, kernellogs.Release]) -> None:
    """0.32 on: no MXFP4 backend takes the checkpoint's activations; the one chosen runs them in BF16."""
    rel = kernel_releases["0.32.0"]
    chose = logged(rel, "oracle/mxfp4.py", "Mxfp4 MoE backend.", "MARLIN")
    fell = logged(
        rel,
        "oracle/mxfp4.py",
        "with BF16 activations",
        "QuantKey(fp8e4m3,scale(f32,static,GroupShape(row=-1, col=-1)),symmetric)",
        "MARLIN",
    )
    (chosen,) = kernelpath.gate({"moe": ("MARLIN",)}, f"{chose}\n{fell}\n", "0.32.0")
    assert chosen.found == (("MARLIN", chose),) and chosen.fell_back == () and chosen.ok


def test_nvfp4_moe_falling_back_from_a_requested_flashinfer_is_what_runs(kernel_releases: dict[str, kernellogs.Release]) -> None:
    """0.14: VLLM_USE_FLASHINFER_MOE_FP4=1 without FlashInfer logs the fallback instead of a choice."""
    fell = logged(kernel_releases["0.14.1"], NVFP4_MOE, "Falling back to {} for NvFp4 MoE", "vLLM CUTASS")
    (chosen,) = kernelpath.gate({"moe": ("FLASHINFER_CUTLASS",)}, fell + "\n", "0.14.1")
    assert chosen.found == (("VLLM_CUTLASS", fell),) and not chosen.ok


def test_nvfp4_moe_falling_back_to_marlin_is_what_runs(kernel_releases: dict[str, kernellogs.Release]) -> None:
    """0.10.1 to 0.14.1: a GPU without CUTLASS FP4 falls back to Marlin (utils/nvfp4_moe_support.py)."""
    fell = logged(kernel_releases["0.12.0"], "utils/nvfp4_moe_support.py", "Falling back to Marlin FP4 MoE kernel.")
    (chosen,) = kernelpath.gate({"moe": ("FLASHINFER_CUTLASS", "VLLM_CUTLASS")}, fell + "\n", "0.12.0")
    assert chosen.found == (("MARLIN", fell),) and not chosen.ok


# --- the local image's CPU MoE ------------------------------------------------------------------

CPU_EXPERTS = ("X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts", "PowerCPUUnquantizedExperts", "CPUUnquantizedExperts")


def test_every_line_vllm_0_32_logs_for_the_unquantized_cpu_moe_reads_cpu(kernel_releases: dict[str, kernellogs.Release]) -> None:
    """What 0.32.0's source can log for an unquantized MoE on CPU (the local image's moe-alphabet):
    the oracle's line, then the experts class it took, by machine and dtype (X86 with AMX in
    bfloat16, Arm and Power in bfloat16, the portable one otherwise: float32, or x86 without AMX).
    Each reads as CPU, so ``moe: CPU`` holds on every machine; the recorded real log has both kinds."""
    rel = kernel_releases["0.32.0"]
    oracle = logged(rel, "oracle/unquantized.py", "Unquantized MoE backend out of", "CPU", "['CPU']")
    assert statement(rel, "oracle/unquantized.py", "Using {} MoE backend").holes[0].expression == "experts_cls.__name__"
    for experts in CPU_EXPERTS:
        line = logged(rel, "oracle/unquantized.py", "Using {} MoE backend", experts)
        (chosen,) = kernelpath.gate({"moe": ("CPU",)}, f"{oracle}\n{line}\n", "0.32.0")
        assert chosen.found == (("CPU", oracle),) and chosen.ok, experts
        (alone,) = kernelpath.gate({"moe": ("CPU",)}, line + "\n", "0.32.0")
        assert alone.found == (("CPU", line),), experts
    recorded = (DATA / "kernel-logs" / "vllm-0.32.0-cpu-mixtral.log").read_text()
    assert oracle.split("] ", 1)[1] in recorded and "] Using CPUUnquantizedExperts MoE backend\n" in recorded
