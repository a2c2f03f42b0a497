"""check-binary on real objects and libraries compiled here with nvcc 13, listed by PyPI's cuobjdump."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from builder import binaries

pytestmark = pytest.mark.nvcc
BIN = Path(sys.executable).parent
KERNEL = "__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }\n"


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cubins")
    (folder / "k.cu").write_text(KERNEL)
    (folder / "host.c").write_text("int host(void) { return 1; }\n")
    builds = {
        "sm_121a.o": ["-c", "-gencode", "arch=compute_121a,code=sm_121a"],
        "sm_120a.o": ["-c", "-gencode", "arch=compute_120a,code=sm_120a"],
        "sm_120f.o": ["-c", "-gencode", "arch=compute_120f,code=sm_120f"],
        "compute_120.o": ["-c", "-gencode", "arch=compute_120,code=compute_120"],
        "libboth.so": [
            "-shared",
            "-Xcompiler",
            "-fPIC",
            "-gencode",
            "arch=compute_121a,code=sm_121a",
            "-gencode",
            "arch=compute_120a,code=sm_120a",
        ],
        "libhopper.so": ["-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90a,code=sm_90a"],
        "libold.so": ["-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"],
    }
    for name, flags in builds.items():
        subprocess.run(["nvcc", *flags, str(folder / "k.cu"), "-o", str(folder / name)], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", str(folder / "host.c"), "-o", str(folder / "libhost.so")], check=True)
    return {p.name: p for p in folder.iterdir() if p.suffix in (".o", ".so")}


def test_code_that_runs_on_sm121_passes(objects: dict[str, Path]) -> None:
    device = binaries.Arch.parse("12.1a")
    for name in ("sm_121a.o", "sm_120f.o", "compute_120.o", "libboth.so", "libold.so"):
        report = binaries.check_file(objects[name], device)
        assert report.ok, (name, report)
    # Plain PTX of an older major is JIT-compiled for sm_121 by the driver; its sm_90 cubin is not used.
    old = binaries.check_file(objects["libold.so"], device)
    assert [c.label() for c in old.codes if c.runs_on(device)] == ["compute_90"]
    assert binaries.check_file(objects["libhost.so"], device).ok is None  # no device code: not a failure


def test_an_arch_specific_sm120a_cubin_does_not_run_on_sm121(objects: dict[str, Path]) -> None:
    device = binaries.Arch.parse("12.1a")
    assert binaries.check_file(objects["sm_120a.o"], device).ok is False
    assert binaries.check_file(objects["libhopper.so"], device).ok is False  # Hopper cubin only: another major
    both = binaries.check_file(objects["libboth.so"], device)
    assert {c.label() for c in both.foreign} == {"sm_120a"}  # reported beside the code that does run


def test_the_cli_passes_and_fails_naming_each_bad_file(objects: dict[str, Path]) -> None:
    good = subprocess.run(
        [BIN / "sparkbuild", "check-binary", objects["sm_121a.o"], objects["libhost.so"], "--arch", "12.1a"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert good.returncode == 0, good.stderr
    assert "ok" in good.stdout and "sm_121a" in good.stdout and "no device code" in good.stdout
    bad = subprocess.run(
        [BIN / "sparkbuild", "check-binary", "--json", objects["sm_121a.o"], objects["sm_120a.o"], objects["libhopper.so"]],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 11
    error = bad.stderr.splitlines()[-1]
    assert str(objects["sm_120a.o"]) in error and str(objects["libhopper.so"]) in error
    assert str(objects["sm_121a.o"]) not in error
    rows = {Path(r["path"]).name: r for r in json.loads(bad.stdout)}
    assert rows["sm_120a.o"]["codes"] == ["sm_120a"] and rows["sm_120a.o"]["ok"] is False
    assert rows["sm_121a.o"]["ok"] is True
