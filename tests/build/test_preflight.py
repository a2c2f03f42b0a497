"""Preflight's audit rules without a build: the code targets of nvcc command lines, judged for the
Spark's GPU (sm_121) by check-binary's rule. The real configure runs in tests/lanes/test_rehearsal.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sparkbuild.build import preflight
from sparkbuild.build.binaries import Arch
from sparkbuild.errors import BuildError
from tests.support import ROOT

SPARK = Arch.parse("12.1")


def entry(file: str, flags: str, library: str = "_C") -> dict[str, str]:
    return {
        "directory": "/b",
        "file": f"/src/vllm/{file}",
        "command": f"/usr/local/cuda/bin/nvcc {flags} -c /src/vllm/{file} -o CMakeFiles/{library}.dir/{file}.o",
        "output": f"CMakeFiles/{library}.dir/{file}.o",
    }


def audited(units: tuple[preflight.Unit, ...]) -> preflight.Report:
    """The report of an audit alone: nothing compiled, no time spent."""
    return preflight.Report(
        target="t",
        device=SPARK,
        units=units,
        compiled=(),
        stubbed=(),
        changed_files=(),
        configure_seconds=0.0,
        compile_seconds=0.0,
    )


def test_both_gencode_spellings_are_read() -> None:
    codes = preflight.gencodes(
        "nvcc -gencode arch=compute_120f,code=sm_120f --generate-code=arch=compute_80,code=[compute_80,sm_80]"
    )
    assert [c.label() for c in codes] == ["sm_120f", "compute_80", "sm_80"]


@pytest.mark.parametrize(
    ("flags", "verdict"),
    [
        ("-gencode arch=compute_121a,code=sm_121a", "sass"),
        ("-gencode arch=compute_120f,code=sm_120f", "sass"),  # the family runs on every 12.x
        ("-gencode arch=compute_120,code=sm_120", "sass"),  # a plain 12.0 cubin runs on 12.1
        ("-gencode arch=compute_80,code=[compute_80,sm_80]", "ptx-only"),  # the driver JITs compute_80
        ("-gencode arch=compute_120a,code=sm_120a", "none"),  # arch-specific: sm_120 only
        ("-gencode arch=compute_100a,code=sm_100a", "none"),
        ("-gencode arch=compute_120a,code=compute_120a", "none"),  # arch-specific PTX: its own arch only
        ("", "other-gpu"),  # alone in its library, which gets no code target at all: see below
    ],
)
def test_each_unit_is_judged_for_the_spark(flags: str, verdict: str) -> None:
    (unit,) = preflight.audit([entry("csrc/k.cu", flags)], SPARK, "/src/vllm")
    assert unit.verdict == verdict
    assert unit.file == "csrc/k.cu" and unit.library == "_C"


def test_the_report_fails_naming_every_unit_with_no_code_for_the_gpu() -> None:
    commands = [
        entry("csrc/ok.cu", "-gencode arch=compute_120f,code=sm_120f"),
        entry("csrc/jit.cu", "-gencode arch=compute_80,code=[compute_80,sm_80]", "_moe_C"),
        entry("csrc/a.cu", "-gencode arch=compute_120a,code=sm_120a"),
        entry("csrc/b.cu", "-gencode arch=compute_120a,code=sm_120a"),
        entry("csrc/host.cpp", ""),  # not a CUDA unit: not audited
    ]
    report = preflight.Report(
        target="t",
        device=SPARK,
        units=preflight.audit(commands, SPARK, "/src/vllm"),
        compiled=(),
        stubbed=(),
        changed_files=(),
        configure_seconds=20.0,
        compile_seconds=0.0,
    )
    assert report.counts() == {"sass": 1, "ptx-only": 1, "none": 2, "other-gpu": 0, "not-built": 0}
    assert not report.ok
    with pytest.raises(BuildError, match=r"2 unit\(s\) cannot serve sm_121: csrc/a.cu \(sm_120a\); csrc/b.cu"):
        report.require()
    text = report.text()
    assert "ptx-only (JIT on first load): csrc/jit.cu [compute_80, sm_80]" in text
    assert "NO CODE FOR THIS GPU: csrc/a.cu [sm_120a]" in text
    assert report.cell() == "4 units: 1 sass, 1 ptx-only, 2 none; 0/0 patched ok; 20s"


def test_a_patched_unit_that_does_not_compile_fails_the_report() -> None:
    compiled = preflight.Compiled(
        file="csrc/k.cu", ok=False, seconds=3.0, error="ptxas error : not supported on .target 'sm_120'"
    )
    report = preflight.Report(
        target="t",
        device=SPARK,
        units=preflight.audit([entry("csrc/k.cu", "-gencode arch=compute_120,code=sm_120")], SPARK, "/src/vllm"),
        compiled=(compiled,),
        stubbed=(),
        changed_files=("csrc/k.cuh",),
        configure_seconds=1.0,
        compile_seconds=3.0,
    )
    with pytest.raises(BuildError, match=r"csrc/k.cu \(does not compile\)"):
        report.require()
    assert "not supported on .target 'sm_120'" in report.text()


def test_the_toolchain_check_reads_the_minimum_from_vllms_own_cmakelists(tmp_path: Path) -> None:
    """vLLM 0.33's CMakeLists.txt asks for GCC >= 13 (its CUDA branch); a compiler below says so before any pip install."""
    (tmp_path / "CMakeLists.txt").write_text(
        'if(CMAKE_CXX_COMPILER_VERSION VERSION_LESS "11.3")\nendif()\n'
        'if(VLLM_GPU_LANG STREQUAL "CUDA" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS "99")\nendif()\n'
    )
    script = ROOT / "dockerfiles" / "spark" / "preflight.py"
    done = subprocess.run(
        [sys.executable, script, "--check-toolchain", "--source", tmp_path], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert "vLLM's CMakeLists.txt needs GCC >= 99" in done.stderr and "Debian trixie: 14" in done.stderr


def test_a_library_built_only_for_other_gpus_is_listed_apart_and_a_lost_unit_still_fails() -> None:
    """flash-attention's FA3 is built for 9.0a only: with TORCH_CUDA_ARCH_LIST=12.1a its arch list is
    empty and none of its units gets a code target (vLLM 0.33.0's configure with FA's source: 192
    units). Not a defect; compiled for nothing. A unit without code among units with code is one
    that lost its arch: it still fails."""
    fa3 = [entry(f"hopper/instantiations/k{i}_sm90.cu", "-O3", "_vllm_fa3_C") for i in range(3)]
    commands = [
        entry("csrc/ok.cu", "-gencode arch=compute_120f,code=sm_120f"),
        entry("csrc/lost.cu", "-O3"),
        *fa3,
    ]
    units = preflight.audit(commands, SPARK, "/src/vllm")
    verdicts = {u.file: u.verdict for u in units}
    assert verdicts["csrc/lost.cu"] == "none"
    assert [verdicts[f"hopper/instantiations/k{i}_sm90.cu"] for i in range(3)] == ["other-gpu"] * 3
    report = audited(units)
    assert [u.file for u in report.failing_units] == ["csrc/lost.cu"]
    assert "_vllm_fa3_C: 3 unit(s) built for other GPUs only" in report.text()
    assert report.counts()["other-gpu"] == 3


def test_a_unit_no_target_of_setup_py_needs_is_not_built_and_not_judged() -> None:
    """FA3's units where setup.py leaves its extension out (fa3-hopper-only): configured, never compiled,
    so neither "compiled for nothing" nor a failure, even a unit that would have no code."""
    fa3 = [entry(f"hopper/instantiations/k{i}_sm90.cu", "-O3", "_vllm_fa3_C") for i in range(2)]
    commands = [entry("csrc/ok.cu", "-gencode arch=compute_120f,code=sm_120f"), entry("csrc/stray.cu", "-O3"), *fa3]
    skipped = frozenset({"/src/vllm/csrc/stray.cu", *(e["file"] for e in fa3)})
    units = preflight.audit(commands, SPARK, "/src/vllm", skipped)
    report = audited(units)
    assert report.counts() == {"sass": 1, "ptx-only": 0, "none": 0, "other-gpu": 0, "not-built": 3}
    assert report.ok and report.cell().startswith("4 units: 1 sass, 0 ptx-only, 0 none, 3 not built;")
    text = report.text()
    assert "_vllm_fa3_C: 2 unit(s) configured, not built (no extension vLLM's setup.py builds needs them)" in text


def preflight_script() -> ModuleType:
    """The build stage's preflight.py (stdlib only), loaded as a module."""
    spec = importlib.util.spec_from_file_location("stage_preflight", ROOT / "dockerfiles" / "spark" / "preflight.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_compile_is_measured_apart_through_its_whole_process_tree(tmp_path: Path) -> None:
    """nvcc's memory is its children's (cicc, ptxas): a shell that runs a Python which touches 300 MB
    is measured at 300 MB, and a second compile beside it at its own small figure. Measured from a
    small process, as preflight.py is in the build: the kernel carries the parent's high-water mark
    into a child's exec, so from pytest itself (hundreds of MB) every figure would start at pytest's."""
    heavy = ["sh", "-c", f"{sys.executable} -c 'b = bytearray(300 * 2**20); b[::4096] = bytes(len(b[::4096]))'; echo compiled"]
    light = ["sh", "-c", "echo light; exit 3"]
    measure = (
        "import importlib.util, json, sys; from concurrent.futures import ThreadPoolExecutor; "
        "spec = importlib.util.spec_from_file_location('p', sys.argv[1]); m = importlib.util.module_from_spec(spec); "
        "spec.loader.exec_module(m); jobs = json.loads(sys.argv[2]); "
        "print(json.dumps(list(ThreadPoolExecutor(2).map(lambda a: m.run_measured(a, sys.argv[3]), jobs))))"
    )
    script = str(ROOT / "dockerfiles" / "spark" / "preflight.py")
    done = subprocess.run(
        [sys.executable, "-c", measure, script, json.dumps([heavy, light]), str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    big, small = json.loads(done.stdout)
    assert big[0] == 0 and big[1] == "compiled\n" and 300 <= big[2] < 400
    assert small[0] == 3 and small[1] == "light\n" and small[2] < 100


def test_the_measure_pattern_adds_configured_units_and_refuses_one_that_finds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    script = preflight_script()
    commands = [{"file": f"/src/vllm/csrc/{name}"} for name in ("a_sm120.cu", "b.cu", "c_sm120.cu", "d.cpp")]
    monkeypatch.delenv("SPARKBUILD_PREFLIGHT_MEASURE", raising=False)
    assert script.measured_units(commands, set()) == []
    monkeypatch.setenv("SPARKBUILD_PREFLIGHT_MEASURE", r"_sm120\.cu$")
    # A unit already compiled (patched) or never built is not compiled twice.
    found = script.measured_units(commands, {"/src/vllm/csrc/a_sm120.cu"})
    assert [e["file"] for e in found] == ["/src/vllm/csrc/c_sm120.cu"]
    monkeypatch.setenv("SPARKBUILD_PREFLIGHT_MEASURE", r"flash_fwd")
    with pytest.raises(SystemExit, match="finds no configured CUDA unit"):
        script.measured_units(commands, set())
