"""A patch's status comes from what the tree holds, not from its marker comment (issue 29, section 3).

On real vLLM sdists (PyPI, cached): a file that carries a rule's marker but not its change is an
error that names the file (the engine's ``conflict``: ``apply`` leaves the tree untouched, the CLI
and the container's ``python3 -m sparkbuild.patch`` exit 9); the change itself reads ``applied``, with
the files that hold it, so a build's preflight compiles them. Half a change (one guard reverted,
one splice removed, a constant edited) is the same error. Preflight's own selection runs on the
real tree and the real record: a tree that already carries the change has its patched units
compiled, and a patch set whose CUDA change no unit compiles fails, naming the file.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sparkbuild import patch
from sparkbuild.build import preflight
from sparkbuild.build.binaries import Arch
from sparkbuild.errors import BuildError
from sparkbuild.patch import fragments
from sparkbuild.patch.rules import e2m1_software, flashinfer_sinks_sm12x, mxfp4_cutlass_sm12x
from tests.support import ROOT
from tests.support.trees import PATCHES, TreeFactory, status_of, tree_hash

SINKS = flashinfer_sinks_sm12x.BACKEND


def header(tree: Path) -> str:
    (found,) = [p.relative_to(tree).as_posix() for p in tree.joinpath("csrc").rglob(e2m1_software.HEADER)]
    return found


def only(tree: Path, version: str, name: str) -> patch.Result:
    return status_of(tree, version, name)


def prepend(path: Path, line: str) -> None:
    path.write_text(line + "\n" + path.read_text())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkbuild", *args], capture_output=True, text=True, check=False, cwd=ROOT)


# --- e2m1-software ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.19.0", "0.24.0", "0.33.0"])  # csrc/quantization/fp4, libtorch_stable, back again
def test_the_e2m1_marker_without_its_change_is_an_error_naming_the_file(version: str, tree_copy: TreeFactory) -> None:
    tree = tree_copy(version)
    rel = header(tree)
    prepend(tree / rel, f"// {e2m1_software.MARKER}")
    result = only(tree, version, "e2m1-software")
    assert result.status == "conflict"
    assert result.detail.startswith(f"{rel}: carries sparkbuild's e2m1-software marker but not its change ("), result.detail
    assert "software conversion of patches/e2m1-software/e2m1_software.cuh is not in it" in result.detail
    # Every way in refuses, and writes nothing: sparkbuild's CLI, and the engine a source stage runs.
    before = tree_hash(tree)
    for args in (
        ["patch", "apply", "--source", str(tree), "--patch", "e2m1-software"],
        ["patch", "check", "--source", str(tree), "--patch", "e2m1-software"],
    ):
        done = cli(*args)
        assert done.returncode == 9, done.stderr
        assert rel in done.stdout + done.stderr
    stage = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkbuild.patch",
            "apply",
            "--source",
            str(tree),
            "--version",
            version,
            "--patches",
            str(PATCHES),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert stage.returncode == 9 and f"{rel}: carries sparkbuild's e2m1-software marker" in stage.stdout + stage.stderr
    assert tree_hash(tree) == before


@pytest.mark.parametrize("version", ["0.19.0", "0.24.0", "0.33.0"])
def test_the_e2m1_change_reads_applied_with_its_file(version: str, tree_copy: TreeFactory) -> None:
    tree = tree_copy(version)
    patch.apply(patch.check(tree, patch.load(PATCHES, ("e2m1-software",)), version))
    (tree / patch.RECORD).unlink()  # judged by the tree alone, as in a checkout that carries the change
    result = only(tree, version, "e2m1-software")
    assert (result.status, result.files) == ("applied", (header(tree),))


def test_half_an_e2m1_change_is_an_error(tree_copy: TreeFactory) -> None:
    """One block back to its bare asm, or the software path edited: the file is not the rule's output."""
    tree = tree_copy("0.33.0")
    patch.apply(patch.check(tree, patch.load(PATCHES, ("e2m1-software",)), "0.33.0"))
    rel = header(tree)
    patched = (tree / rel).read_text()
    guarded = e2m1_software._GUARDED.search(patched)
    assert guarded is not None and patched.count("#if SPARKBUILD_E2M1_HW\n") == 3
    (tree / rel).write_text(patched[: guarded.start()] + guarded.group(1) + patched[guarded.end() :])
    result = only(tree, "0.33.0", "e2m1-software")
    assert result.status == "conflict" and "(2 of 3 e2m1x2 asm block(s) have the software fallback)" in result.detail

    software = "vllm::fp32x2_to_e2m1x2_software("
    at = patched.index(software)
    (tree / rel).write_text(patched[:at] + patched[at:].replace(" << 8)", " << 9)", 1))
    result = only(tree, "0.33.0", "e2m1-software")
    line = patched[:at].count("\n") + 1
    assert result.status == "conflict", result
    assert "is not what the patch writes" in result.detail and rel in result.detail
    assert int(result.detail.split("(line ")[1].split()[0]) >= line - 1


# --- flashinfer-sinks-sm12x and mxfp4-cutlass-sm12x ---------------------------------------------------


@pytest.mark.parametrize("version", ["0.19.0", "0.27.1"])  # the two layouts: XQA picked by FlashInfer, by the builder
def test_the_sinks_marker_without_its_change_is_an_error_naming_the_file(version: str, tree_copy: TreeFactory) -> None:
    tree = tree_copy(version)
    prepend(tree / SINKS, f"# {flashinfer_sinks_sm12x.MARKER}")
    result = only(tree, version, "flashinfer-sinks-sm12x")
    assert result.status == "conflict"
    assert result.detail.startswith(
        f"{SINKS}: carries sparkbuild's flashinfer-sinks-sm12x marker but not its change (missing: import, helper,"
    )
    done = cli("patch", "apply", "--source", str(tree), "--patch", "flashinfer-sinks-sm12x")
    assert done.returncode == 9 and SINKS in done.stderr


@pytest.mark.parametrize("version", ["0.19.0", "0.27.1"])
def test_the_sinks_change_reads_applied_and_a_missing_part_is_named(
    version: str, tree_copy: TreeFactory, pristine: TreeFactory
) -> None:
    tree = tree_copy(version)
    patch.apply(patch.check(tree, patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), version))
    (tree / patch.RECORD).unlink()
    result = only(tree, version, "flashinfer-sinks-sm12x")
    assert (result.status, result.files) == ("applied", (SINKS,))
    # Every splice but the sink prefill run, made by the rule itself on the release's own file.
    original = (pristine(version) / SINKS).read_text()
    code = fragments.read(PATCHES / "flashinfer-sinks-sm12x" / flashinfer_sinks_sm12x.FRAGMENTS)
    splices = flashinfer_sinks_sm12x.plan(original, code)
    assert "prefill run" in [s.name for s in splices]
    (tree / SINKS).write_text(flashinfer_sinks_sm12x.splice(original, [s for s in splices if s.name != "prefill run"]))
    result = only(tree, version, "flashinfer-sinks-sm12x")
    assert result.status == "conflict"
    assert result.detail.startswith(
        f"{SINKS}: carries sparkbuild's flashinfer-sinks-sm12x marker but not its change (missing: prefill run)"
    )


def test_the_mxfp4_python_gate_marker_alone_is_an_error(tree_copy: TreeFactory) -> None:
    """0.20.0 - 0.23.0 gate the kernel in Python: the marker there without the widened gate."""
    tree = tree_copy("0.22.0")
    gate = tree / mxfp4_cutlass_sm12x.PY_GATE
    prepend(gate, f"# {mxfp4_cutlass_sm12x.MARKER}")
    result = only(tree, "0.22.0", "mxfp4-cutlass-sm12x")
    assert result.status == "conflict"
    assert result.detail.startswith(f"{mxfp4_cutlass_sm12x.PY_GATE}: carries sparkbuild's mxfp4-cutlass-sm12x marker")


def test_the_cmake_marker_without_its_change_is_an_error(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.16.0")
    prepend(tree / "CMakeLists.txt", "# sparkbuild cmake-arch-sm121: added by hand")
    result = only(tree, "0.16.0", "cmake-arch-sm121")
    assert result.status == "conflict"
    assert result.detail.startswith("CMakeLists.txt: carries sparkbuild's cmake-arch-sm121 marker but not its change (")
    assert "CUDA_SUPPORTED_ARCHS +12.1" in result.detail


# --- preflight: what it compiles follows the content ---------------------------------------------------


def preflight_script() -> ModuleType:
    """dockerfiles/spark/preflight.py, the script the vLLM stage runs (standard library only)."""
    spec = importlib.util.spec_from_file_location("sparkbuild_preflight_script", ROOT / "dockerfiles/spark/preflight.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The FP4 units of vLLM 0.33.0 a 12.1a build compiles (CMakeLists.txt's FP4_SM120_SRCS), and one it
# does not (FP4_SM100_SRCS only), with the include folders CMake gives them.
UNITS = (
    "csrc/quantization/fp4/nvfp4_quant_kernels.cu",
    "csrc/quantization/fp4/nvfp4_experts_quant.cu",
    "csrc/nvfp4_kv_cache_kernels.cu",
    "csrc/quantization/fp4/nvfp4_scaled_mm_sm120_kernels.cu",
)


def compile_commands(tree: Path, files: tuple[str, ...]) -> list[dict[str, str]]:
    return [
        {
            "directory": str(tree / "build"),
            "file": str(tree / f),
            "command": f"nvcc -I{tree}/csrc -gencode arch=compute_120f,code=sm_120f -c {tree / f} -o {f}.o",
        }
        for f in files
    ]


def test_preflight_compiles_the_units_of_a_tree_that_already_carries_the_change(tree_copy: TreeFactory) -> None:
    """A checkout that carries the e2m1 change before the patch stage runs (a fork, a re-run): the
    patch stage says `applied`, and preflight compiles the units that include the header. Before,
    the record's `applied` had no files, so preflight compiled nothing and passed."""
    script = preflight_script()
    carrier = tree_copy("0.33.0")
    patch.apply(patch.check(carrier, patch.load(PATCHES, ("e2m1-software",)), "0.33.0"))
    (carrier / patch.RECORD).unlink()
    report = patch.check(carrier, patch.load(PATCHES, ("e2m1-software",)), "0.33.0")
    patch.apply(report)  # what the source stage runs
    record = json.loads((carrier / patch.RECORD).read_text())
    assert [(r["status"], r["files"]) for r in record["results"]] == [("applied", [header(carrier)])]
    changed = script.changed_files(carrier)
    assert changed == {(carrier / header(carrier)).resolve()}
    units = script.patched_units(compile_commands(carrier, UNITS), carrier.resolve(), changed)
    reached = {Path(e["file"]).relative_to(carrier).as_posix(): r for e, r in units}
    # Every FP4 unit includes the header (some through a header of their own), the SM120 GEMM does not.
    assert reached == {f: [header(carrier)] for f in UNITS[:3]}


def test_preflight_fails_a_patch_set_whose_cuda_change_no_unit_compiles(tree_copy: TreeFactory) -> None:
    """The patched header on the real tree, and a configure whose units do not include it: the
    report names the file and fails; with the units that include it compiled, it passes."""
    script = preflight_script()
    tree = tree_copy("0.33.0")
    patch.apply(patch.check(tree, patch.load(PATCHES, ("e2m1-software",)), "0.33.0"))
    changed = script.changed_files(tree)
    rel = header(tree)

    def report(files: tuple[str, ...]) -> preflight.Report:
        commands = compile_commands(tree, files)
        units = script.patched_units(commands, tree.resolve(), changed)
        compiled = tuple(
            preflight.Compiled(file=Path(e["file"]).relative_to(tree).as_posix(), ok=True, seconds=1.0, reaches=tuple(r))
            for e, r in units
        )
        return preflight.Report(
            target="t",
            device=Arch.parse("12.1"),
            units=preflight.audit(commands, Arch.parse("12.1"), str(tree)),
            compiled=compiled,
            stubbed=(),
            changed_files=tuple(sorted(str(p.relative_to(tree.resolve())) for p in changed)),
            configure_seconds=1.0,
            compile_seconds=1.0,
        )

    none = report((UNITS[3],))
    assert none.compiled == () and none.uncompiled_changes == (rel,) and not none.ok
    with pytest.raises(BuildError, match=rf"the patch set changes {rel}, and no unit this configure compiles is or includes it"):
        none.require()
    assert f"PATCHED BUT COMPILED BY NO UNIT: {rel}" in none.text()
    assert none.summary()["uncompiled_changes"] == [rel]
    some = report(UNITS)
    assert some.ok and len(some.compiled) == 3
