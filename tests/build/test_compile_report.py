"""A failure in the long compile is cheap: the compile keeps going past a failing unit, and the report
names every unit that failed with its first error. A real CMake project built with Ninja, nvcc and
g++ exactly as vLLM's setup.py builds (``cmake --build . -j=N``), with the vLLM stage's ninja
(``ninja-keep-going.sh`` as CMAKE_MAKE_PROGRAM) and report script (``compile_report.py``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparkbuild.build import build
from tests.support import ROOT

pytestmark = pytest.mark.nvcc

SPARK = ROOT / "dockerfiles" / "spark"
SOURCES = {
    # First in the build order: without -k 0 ninja stops here and builds nothing after it.
    "a_bad.cu": "__global__ void k(float* x) { x[0] = undefined_name; }\n",
    "b_good.cu": "__global__ void k2(float* x) { x[0] = 1.0f; }\n",
    "c_bad.cpp": "int f() { return missing_function(); }\n",
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("project")
    for name, text in SOURCES.items():
        (root / name).write_text(text)
    (root / "CMakeLists.txt").write_text(
        textwrap.dedent("""\
            cmake_minimum_required(VERSION 3.25)
            project(units LANGUAGES CXX CUDA)
            set(CMAKE_CUDA_ARCHITECTURES 121a)
            add_library(units OBJECT a_bad.cu b_good.cu c_bad.cpp)
            """)
    )
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    build_dir = root / "build"
    subprocess.run(
        ["cmake", "-S", root, "-B", build_dir, "-G", "Ninja", f"-DCMAKE_CUDA_COMPILER={nvcc}",
         f"-DCMAKE_MAKE_PROGRAM={SPARK / 'ninja-keep-going.sh'}"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    # As vLLM's setup.py runs it, one job so the order is ninja's.
    done = subprocess.run(["cmake", "--build", ".", "-j=1"], cwd=build_dir, capture_output=True, text=True, check=False)
    (root / "compile.log").write_text(done.stdout + done.stderr)
    return root, done


def test_the_compile_keeps_going_past_a_failing_unit(compiled: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, done = compiled
    assert done.returncode != 0
    assert list((root / "build").rglob("b_good.cu.o")), "the unit after the first failure was not compiled"


def test_the_report_names_every_failed_unit_with_its_first_error(compiled: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = compiled
    report = subprocess.run(
        [sys.executable, SPARK / "compile_report.py", root / "compile.log"], capture_output=True, text=True, check=True
    ).stdout
    lines = report.splitlines()
    assert lines[0] == "sparkbuild-compile: 2 unit(s) failed to compile"
    failed = {line.split()[2].rstrip(":"): line for line in lines[1:3]}
    assert set(failed) == {str(root / "a_bad.cu"), str(root / "c_bad.cpp")}
    assert 'identifier "undefined_name" is undefined' in failed[str(root / "a_bad.cu")]  # nvcc's words
    gxx = failed[str(root / "c_bad.cpp")]
    assert "missing_function" in gxx and "was not declared" in gxx  # g++'s (its quotes follow the locale)


def test_sparkbuild_reads_the_report_from_the_stage_log(compiled: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """The report as BuildKit's plain progress shows it in the stage's build log."""
    root, _ = compiled
    report = subprocess.run(
        [sys.executable, SPARK / "compile_report.py", root / "compile.log"], capture_output=True, text=True, check=True
    ).stdout
    log = root / "build-vllm.log"
    log.write_text("".join(f"#27 3601.{i} {line}\n" for i, line in enumerate(report.splitlines())))
    failures = build.compile_failures(log)
    assert [Path(f["unit"]).name for f in failures] == ["a_bad.cu", "c_bad.cpp"]
    assert all(f["error"] for f in failures)
