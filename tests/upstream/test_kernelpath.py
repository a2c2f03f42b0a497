"""The kernel-path gate on recorded logs: the local CPU image's own (tests/data/kernel-logs/,
recorded from real servers: vLLM 0.32.0 CPU serving the alphabet Llama, and a tiny Mixtral); the
table's version ranges and its file's errors. CUDA lines are made from each release's real log
statements in tests/upstream/test_kernel_logs.py (no GPU here to record them); the gate on a live
server is tested in tests/verify/test_kernel_gate.py."""

from __future__ import annotations

import pytest
from packaging.version import Version

from sparkbuild.errors import ConfigError, VerifyError
from sparkbuild.plan import matrix
from sparkbuild.upstream import kernelpath
from tests.support import DATA
from tests.support.matrix import LOCAL, MatrixWriter

LOGS = DATA / "kernel-logs"
MIXTRAL = (LOGS / "vllm-0.32.0-cpu-mixtral.log").read_text()
LLAMA = (LOGS / "vllm-0.32.0-cpu-llama.log").read_text()


def test_the_shipped_ranges_cover_the_releases_read_and_end_at_the_newest() -> None:
    for version in ("0.10.0", "0.10.1.1", "0.11.2", "0.12.0", "0.14.1", "0.18.1", "0.19.0", "0.25.1", "0.33.0", "0.33.0rc1"):
        match = kernelpath.for_version(version)
        assert match.range.kinds and not match.unverified, version
    # A local version label (a source build's +cu130) is the release it was built from.
    assert kernelpath.for_version("0.33.0+cu130").range.read_from == Version("0.33.0")
    assert [str(r.read_from) for r in kernelpath.table()] == ["0.33.0", "0.18.1", "0.11.2"]
    assert kernelpath.kinds() == {"attention", "moe", "nvfp4_gemm"}
    with pytest.raises(VerifyError, match=r"no kernel-path patterns for vLLM 0.9.2, older than every range"):
        kernelpath.for_version("0.9.2")


@pytest.mark.parametrize("version", ["0.34.0", "0.33.1", "0.34.0rc1"])
def test_a_vllm_newer_than_every_range_fails_closed_naming_the_table_to_extend(version: str) -> None:
    with pytest.raises(VerifyError) as refused:
        kernelpath.for_version(version)
    said = str(refused.value)
    assert f"no range of sparkbuild/resources/kernel-paths.yaml covers vLLM {version}" in said
    assert "ranges[0] (vllm: '<=0.33.0,>=0.19.0'), was read from vLLM 0.33.0's source" in said
    assert f"Extend ranges[0].vllm to '<={version}'" in said and "tests/upstream/test_kernel_logs.py" in said
    assert "accept_unverified_kernel_patterns: true" in said
    accepted = kernelpath.for_version(version, accept_unverified=True)
    assert accepted.range.read_from == Version("0.33.0")
    why = f"vLLM {version}'s log words are unread: patterns of kernel-paths.yaml ranges[0], read from 0.33.0"
    assert accepted.unverified == why


def test_a_release_between_ranges_fails_closed_too() -> None:
    """0.15.x has wheels only on PyPI: its source was never read, so no range holds it."""
    with pytest.raises(VerifyError) as refused:
        kernelpath.for_version("0.15.1")
    assert "the nearest, ranges[1] (vllm: '!=0.15.*,<=0.18.1,>=0.12.0'), was read from vLLM 0.18.1" in str(refused.value)
    assert "widen ranges[1].vllm (its span leaves 0.15.1 out: no sdist was read)" in str(refused.value)
    assert kernelpath.for_version("0.15.1", accept_unverified=True).range.read_from == Version("0.18.1")
    # Between two ranges: a release candidate of the first release of the newer one.
    with pytest.raises(VerifyError, match=r"covers vLLM 0.19.0rc1: the nearest, ranges\[1\] .* Widen the range beside it"):
        kernelpath.for_version("0.19.0rc1")


def test_an_unverified_read_passes_only_with_the_key_and_every_summary_says_so() -> None:
    """The recorded 0.32.0 log read as if a newer vLLM had written it: no newer release exists to
    record (the one stand-in of this file, for a fault that cannot be produced for real)."""
    with pytest.raises(VerifyError, match=r"covers vLLM 0.34.0"):
        kernelpath.gate({"moe": ("CPU",)}, MIXTRAL, "0.34.0")
    (chosen,) = kernelpath.gate({"moe": ("CPU",)}, MIXTRAL, "0.34.0", accept_unverified=True)
    assert chosen.ok and chosen.unverified and chosen.to_json()["unverified"] == chosen.unverified
    assert kernelpath.text([chosen]) == (
        "moe CPU [UNVERIFIED: vLLM 0.34.0's log words are unread: patterns of kernel-paths.yaml ranges[0], read from 0.33.0]"
    )
    (wrong,) = kernelpath.gate({"moe": ("MARLIN",)}, MIXTRAL, "0.34.0", accept_unverified=True)
    assert kernelpath.failures([wrong], "0.34.0")[-1] == f"  ({wrong.unverified})"


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


def test_a_kind_a_release_range_does_not_log_is_refused() -> None:
    ranges = kernelpath.parse({"ranges": [{"vllm": ">=1.0,<=2.0", "kinds": {"moe": {"patterns": ["(?P<backend>x)"]}}}]}, "t")
    with pytest.raises(VerifyError, match=r"vLLM 1.5 .* logs no 'nvfp4_gemm' choice .*it knows moe"):
        kernelpath.gate({"nvfp4_gemm": ("VLLM_CUTLASS",)}, "", "1.5", ranges)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"ranges": [{"vllm": "not a spec", "kinds": {}}]}, r"'not a spec' must be a version specifier"),
        ({"ranges": [{"vllm": ">=1,<=2", "kinds": {"moe": {"patterns": ["Using (\\w+)"]}}}]}, r"has no \(\?P<backend>"),
        ({"ranges": [{"vllm": ">=1,<=2", "kinds": {"moe": {"patterns": ["(?P<backend>"]}}}]}, r"is not a regular expression"),
        ({"ranges": [{"vllm": ">=1,<=2", "kinds": {"moe": {}}}]}, r"expected 'patterns:'"),
        ({"range": []}, r"expected a mapping with a 'ranges:' list"),
        # Unbounded above: any future vLLM would get these words unread.
        ({"ranges": [{"vllm": ">=0.19", "kinds": {}}]}, r"ranges\[0\].vllm: '>=0.19' needs '>=FIRST' and '<=LAST'"),
        (
            {"ranges": [{"vllm": ">=0.19,<=0.33", "kinds": {}}, {"vllm": ">=0.30,<=0.34", "kinds": {}}]},
            r"ranges\[0\] \(.*\) and ranges\[1\] \(.*\) overlap",
        ),
        (
            {"ranges": [{"vllm": ">=1,<=2", "kinds": {"moe": {"patterns": [{"pattern": "(?P<backend>x)", "vllm": "nope"}]}}}]},
            r"kinds.moe.patterns\[0\].vllm: 'nope' must be a version specifier",
        ),
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


def test_a_check_may_accept_unverified_kernel_patterns_and_says_so_by_name(write_matrix: MatrixWriter) -> None:
    body = moe_check("{moe: CPU}\n    accept_unverified_kernel_patterns: true")
    (target,) = matrix.load(write_matrix(body, with_checks=False)).targets
    assert target.check.accept_unverified_kernel_patterns is True
    (default,) = matrix.load(write_matrix(moe_check("{moe: CPU}"), with_checks=False)).targets
    assert default.check.accept_unverified_kernel_patterns is False
    maybe = moe_check("{moe: CPU}\n    accept_unverified_kernel_patterns: maybe")
    with pytest.raises(ConfigError, match=r"accept_unverified_kernel_patterns"):
        matrix.load(write_matrix(maybe, with_checks=False))
