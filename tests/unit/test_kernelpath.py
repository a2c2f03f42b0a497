"""The kernel-path gate on recorded logs: the local CPU image's own (tests/data/kernel-logs/,
recorded from real servers: vLLM 0.32.0 CPU serving the alphabet Llama, and a tiny Mixtral), and
CUDA lines written from the format strings of vLLM's source at each release (no GPU here to record
them). The gate itself on a live server is tested in tests/integration/test_kernel_gate.py."""

from __future__ import annotations

import pytest

from builder import kernelpath, matrix
from builder.errors import ConfigError, VerifyError
from tests.support import DATA
from tests.support.matrix import LOCAL, MatrixWriter

LOGS = DATA / "kernel-logs"
MIXTRAL = (LOGS / "vllm-0.32.0-cpu-mixtral.log").read_text()
LLAMA = (LOGS / "vllm-0.32.0-cpu-llama.log").read_text()
PREFIX = "(Worker pid=40) INFO 11-23 17:54:02 "


def test_the_shipped_patterns_cover_every_release_from_0_10_and_release_candidates() -> None:
    for version in ("0.10.0", "0.10.1.1", "0.11.2", "0.12.0", "0.14.1", "0.18.1", "0.19.0", "0.25.1", "0.33.0", "0.34.0rc1"):
        assert kernelpath.for_version(version).kinds, version
    assert kernelpath.kinds() == {"attention", "moe", "nvfp4_gemm"}
    with pytest.raises(VerifyError, match=r"no kernel-path patterns for vLLM 0.9.2: .*Add a range for it to builder/resources"):
        kernelpath.for_version("0.9.2")


def test_the_cpu_image_logs_its_moe_backend_and_the_gate_quotes_the_line() -> None:
    (chosen,) = kernelpath.gate({"moe": ("CPU",)}, MIXTRAL, "0.32.0")
    assert chosen.ok and [b for b, _ in chosen.found] == ["CPU"]
    assert "[unquantized.py:364] Using CPU Unquantized MoE backend out of potential backends: ['CPU']." in chosen.found[0][1]


def test_a_check_that_expects_a_gpu_moe_backend_fails_on_the_cpu_image_with_the_line() -> None:
    chosen = kernelpath.gate({"moe": ("FLASHINFER_CUTLASS", "VLLM_CUTLASS")}, MIXTRAL, "0.32.0")
    (line,) = kernelpath.failures(chosen, "0.32.0")
    assert line.startswith("  moe: expected FLASHINFER_CUTLASS or VLLM_CUTLASS, vLLM chose CPU: ")
    assert "Using CPU Unquantized MoE backend" in line


def test_a_kind_the_log_never_names_is_a_failure_not_a_pass() -> None:
    """vLLM 0.32's CPU platform logs no attention choice, and a dense model no MoE: both unknown."""
    chosen = kernelpath.gate({"attention": ("CPU_ATTN",), "moe": ("CPU",)}, LLAMA, "0.32.0")
    failed = kernelpath.failures(chosen, "0.32.0")
    assert len(failed) == 2 and all("no line of the log matches kernel-paths.yaml's" in f for f in failed)
    assert "an unknown log format, or the model never took that path" in failed[0]


@pytest.mark.parametrize(
    ("version", "line", "kind", "backend"),
    [
        # platforms/cuda.py from 0.12: the enum name.
        (
            "0.33.0",
            "Using TRITON_ATTN attention backend out of potential backends: ['FLASHINFER', 'TRITON_ATTN'].",
            "attention",
            "TRITON_ATTN",
        ),
        (
            "0.19.0",
            "Using FLASHINFER attention backend out of potential backends: ['FLASHINFER', 'TRITON_ATTN'].",
            "attention",
            "FLASHINFER",
        ),
        (
            "0.14.0",
            "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER']",
            "attention",
            "FLASH_ATTN",
        ),
        # before 0.12: words, mapped to the enum names.
        ("0.11.0", "Using Flash Attention backend on V1 engine.", "attention", "FLASH_ATTN"),
        (
            "0.10.2",
            "Using FlashInfer backend with HND KV cache layout on V1 engine by default for Blackwell (SM 10.0) GPUs.",
            "attention",
            "FLASHINFER",
        ),
        # the fused-MoE oracles: NvFp4 (0.16 on), Mxfp4 (0.19 on), Fp8 (0.16 on).
        (
            "0.33.0",
            "Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['FLASHINFER_CUTLASS', 'VLLM_CUTLASS', 'MARLIN'].",
            "moe",
            "MARLIN",
        ),
        ("0.19.0", "Using 'FLASHINFER_CUTLASS_MXFP4_MXFP8' Mxfp4 MoE backend.", "moe", "FLASHINFER_CUTLASS_MXFP4_MXFP8"),
        ("0.33.0", "Using TRITON Fp8 MoE backend out of potential backends: ['FLASHINFER_CUTLASS', 'TRITON'].", "moe", "TRITON"),
        (
            "0.17.0",
            "Using 'VLLM_CUTLASS' NvFp4 MoE backend out of potential backends: ['VLLM_CUTLASS', 'MARLIN'].",
            "moe",
            "VLLM_CUTLASS",
        ),
        # older MoE lines in words.
        ("0.17.0", "Using Marlin backend", "moe", "MARLIN"),
        ("0.13.0", "Using Marlin for CompressedTensorsW4A4Nvfp4MoEMethod.", "moe", "MARLIN"),
        ("0.11.0", "Using FlashInfer kernels for CompressedTensorsW4A4MoeMethod.", "moe", "FLASHINFER_CUTLASS"),
        # NVFP4 linear layers.
        ("0.33.0", "Using FlashInferCutlassNvFp4LinearKernel for NVFP4 GEMM", "nvfp4_gemm", "FLASHINFER_CUTLASS"),
        ("0.19.0", "Using cutlass for NVFP4 GEMM", "nvfp4_gemm", "VLLM_CUTLASS"),
        ("0.14.0", "Using marlin for NVFP4 GEMM", "nvfp4_gemm", "MARLIN"),
    ],
)
def test_each_release_range_reads_its_own_words(version: str, line: str, kind: str, backend: str) -> None:
    log = f"{PREFIX}[somewhere.py:1] {line}\n"
    (chosen,) = kernelpath.gate({kind: (backend,)}, log, version)
    assert [b for b, _ in chosen.found] == [backend] and chosen.ok


def test_marlin_where_cutlass_is_expected_fails_naming_both() -> None:
    log = f"{PREFIX}[nvfp4.py:270] Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['VLLM_CUTLASS', 'MARLIN'].\n"
    chosen = kernelpath.gate({"moe": ("FLASHINFER_CUTLASS", "VLLM_CUTLASS")}, log, "0.33.0")
    assert kernelpath.failures(chosen, "0.33.0") == [
        f"  moe: expected FLASHINFER_CUTLASS or VLLM_CUTLASS, vLLM chose MARLIN: {log.strip()}"
    ]
    assert kernelpath.text(chosen) == "moe MARLIN (UNEXPECTED)"


def test_a_kind_a_release_range_does_not_log_is_refused() -> None:
    with pytest.raises(VerifyError, match=r"vLLM 0.11.0 .* logs no 'nvfp4_gemm' choice"):
        kernelpath.gate({"nvfp4_gemm": ("VLLM_CUTLASS",)}, "", "0.11.0")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"ranges": [{"vllm": "not a spec", "kinds": {}}]}, r"'vllm:' must be a version specifier"),
        ({"ranges": [{"vllm": ">=1", "kinds": {"moe": {"patterns": ["Using (\\w+)"]}}}]}, r"has no \(\?P<backend>"),
        ({"ranges": [{"vllm": ">=1", "kinds": {"moe": {"patterns": ["Using (?P<backend>"]}}}]}, r"is not a regular expression"),
        ({"ranges": [{"vllm": ">=1", "kinds": {"moe": {}}}]}, r"expected 'patterns:'"),
        ({"range": []}, r"expected a mapping with a 'ranges:' list"),
    ],
)
def test_a_broken_pattern_file_names_what_is_wrong(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kernelpath.parse(data, "kernel-paths.yaml")


MOE_CHECK = """\
checks:
  alphabet:
    model: alphabet
    prompts: [{{name: c, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}}]
    kernels: {kernels}
bases:
  deb:
    debootstrap: {{suite: bookworm, mirror: "http://deb.debian.org/debian"}}
"""


def moe_check(kernels: str) -> str:
    return MOE_CHECK.format(kernels=kernels) + LOCAL


def test_a_check_names_the_kernels_it_expects(write_matrix: MatrixWriter) -> None:
    path = write_matrix(moe_check("{moe: [FLASHINFER_CUTLASS, VLLM_CUTLASS], attention: FLASHINFER}"), with_checks=False)
    (target,) = matrix.load(path).targets
    assert target.check.expected_kernels == {"moe": ("FLASHINFER_CUTLASS", "VLLM_CUTLASS"), "attention": ("FLASHINFER",)}


def test_a_kind_the_gate_does_not_know_is_a_matrix_error(write_matrix: MatrixWriter) -> None:
    with pytest.raises(ConfigError, match=r"kernels.*gemm"):
        matrix.load(write_matrix(moe_check("{gemm: cutlass}"), with_checks=False))
