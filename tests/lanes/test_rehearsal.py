"""The Spark build rehearsed here, for real: `sparkbuild rehearse --offline` of the shipped
vllm-0.33.0-cu130-sm121 target, from local git remotes made from the real 0.33.0 and FlashInfer
0.7.2.post1 sdists, on CUDA bases made from NVIDIA's PyPI wheels; built both ways a Spark target can be.

From source (``vllm_from: source``): every stage template is built with BuildKit; vLLM's own CMake
configure runs for the target's arch list and is audited for the Spark's GPU (the shipped target
needs no patch, so none is compiled); the runtime image runs its checks. Then the same rehearsal is
made to fail the way users fear: an arch list whose cubins do not load on sm_121, a patched unit that
does not compile for the code it gets (beside e2m1-software's patched FP4 units, compiled with nvcc
and checked with cuobjdump), and a patch set whose CUDA change no unit of the configure compiles.

From upstream's wheel (the shipped target as it is: ``vllm_from: auto`` and its one patch,
nvfp4-moe-b12x-auto, a Python file): the rehearsal pins upstream's x86_64 0.33.0 wheel from PyPI (the
same kernels as the Spark's aarch64 one), the patch engine changes its Python file, and the runtime
image holds vLLM's real compiled extensions: each imports there, check-binary passes on them for 12.1,
and the torch installed is the one the wheel requires. vLLM's own MoE selector, run in that image with
a GB10's capability faked, takes B12X for an NVFP4 W4A16 layer with the patch and Marlin with the
release's own file. A lock pinning the wheel with a wrong sha256 stops its stage at pip's hash check,
with one message.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.utils import parse_wheel_filename

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import EngineError, SourceError, VerifyError
from sparkbuild.lanes.rehearse import rehearsal_target
from sparkbuild.models import model
from sparkbuild.oci import push
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import lock, matrix, plan
from sparkbuild.publish import wheels
from sparkbuild.upstream import externals, sources
from sparkbuild.util import host
from sparkbuild.verify import startup
from tests.support import ROOT, cli, images, leftovers, population, sass
from tests.support.cli import in_process as sparkbuild
from tests.support.procs import pids_where

pytestmark = [pytest.mark.docker, pytest.mark.slow]
TARGET = "vllm-0.33.0-cu130-sm121"
# The shipped target as it is (its Python-only patch set), which auto builds from upstream's wheel.
WHEEL_TARGET = "vllm-0.33.0-cu130-wheel"
# The shipped gpt-oss image: the 0.33.0 one with mxfp4-moe-flashinfer-sm12x (its MXFP4 oracle).
GPTOSS_TARGET = "vllm-0.33.0-cu130-sm121-gptoss"
MXFP4_FILE = "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py"
# The one file the shipped patch set changes (nvfp4-moe-b12x-auto).
PYTHON_FILE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
B12X_LINE = "NvFp4MoeBackend.B12X,  # sparkbuild nvfp4-moe-b12x-auto"


# The build machine as the plan sees it, fixed so the test knows the jobs it must give the compile.
RESOURCES = {"SPARKBUILD_BUILD_MEMORY_GB": "24", "SPARKBUILD_BUILD_CORES": "2"}


def rehearse(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli.run("rehearse", "--offline", "--json", *args, env={"SPARKBUILD_OUT": str(out), **RESOURCES})


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped matrix with its 0.33.0 target twice: compiled from source (``vllm_from: source``,
    with fa3-hopper-only, as a target that compiles lists it), and as it ships (``auto`` chooses
    upstream's wheel: its patch set changes Python files only)."""
    folder = tmp_path_factory.mktemp("both-ways")
    shutil.copytree(ROOT / "patches", folder / "patches")
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    index = next(i for i, t in enumerate(data["targets"]) if t.get("id") == TARGET)
    shipped_target = data["targets"][index]
    compiled = [*shipped_target["patches"], "fa3-hopper-only"]
    data["targets"][index] = {**shipped_target, "vllm_from": "source", "patches": compiled}
    data["targets"].insert(index + 1, {**shipped_target, "id": WHEEL_TARGET})
    (folder / "matrix.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "matrix.yaml"


@pytest.fixture(scope="module")
def shipped(engine: Engine, both_ways: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`sparkbuild rehearse --offline` of that matrix: every Spark target tried, in one command. Its
    preflight and intermediate stages are the next session's too (tests/support/leftovers.py)."""
    out = tmp_path_factory.mktemp("rehearse")
    with leftovers.kept_for_next_session(engine, "rehearsal-shipped"):
        done = rehearse(out, "--matrix", str(both_ways))
    # 0.19.0 cannot be rehearsed here (no stand-in for its CUDA 12.9 bases); that fails nothing.
    assert done.returncode == 0, done.stderr[-4000:]
    return {"results": {r["target"]: r for r in json.loads(done.stdout)}, "out": out, "stderr": done.stderr}


@pytest.fixture(scope="module")
def rehearsed(shipped: dict[str, Any]) -> dict[str, Any]:
    return {**shipped["results"][TARGET], "out": shipped["out"]}


def test_a_target_this_machine_cannot_rehearse_is_reported_with_its_reason(shipped: dict[str, Any]) -> None:
    older = shipped["results"]["vllm-0.19.0-cu129-sm121"]
    assert older["status"] == "not rehearsable" and older["error"] is None and older["stages"] == []
    assert "no stand-in for 'cuda-12.9-devel'" in older["not_rehearsable"]


def test_the_report_lists_everything_the_rehearsal_swapped(rehearsed: dict[str, Any]) -> None:
    swapped = "\n".join(rehearsed["swapped"])
    # The platform is a swap only where this machine builds another natively (no emulation); on an
    # aarch64 host the rehearsal is on the runner's own, and lists none.
    if host.host_platform() == "linux/arm64":
        assert "platform:" not in swapped
    else:
        assert f"platform: linux/arm64 -> {host.host_platform()} (this machine's, no emulation)" in swapped
    assert rehearsed["platform"] == {"name": host.host_platform(), "emulated": False}
    devel = "base cuda-13.0-devel: nvidia/cuda:13.0.2-devel-ubuntu24.04 (Python 3.12, glibc 2.39) -> trixie-cuda-13.0-devel"
    assert devel in swapped
    assert "base cuda-13.0-runtime: " in swapped
    assert "template vllm: the kernel compile -> preflight" in swapped
    # The runtime's FlashInfer kernels step is the runner's own: nothing downloaded either way.
    assert "download-kernels" not in swapped
    # CUTLASS: another version than the pinned one; every project vLLM's CMake clones, by name.
    assert "source cutlass: v4.7.1 -> CUTLASS 4.5.0 headers from FlashInfer's sdist" in swapped
    tree = sources.vllm_sdist("0.33.0", Options.from_env().cache)
    for e in externals.scan(tree):
        assert f"source {e.name}: {e.repo}" in swapped


def test_every_stage_of_the_shipped_target_is_built(rehearsed: dict[str, Any]) -> None:
    assert rehearsed["status"] == "rehearsed" and rehearsed["error"] is None
    assert rehearsed["kernels"] == "swapped" and rehearsed["vllm_from"]["mode"] == "source"
    assert [s["stage"] for s in rehearsed["stages"]] == ["flashinfer", "vllm", "runtime"]
    assert rehearsed["image"].startswith(f"sparkbuild/rehearsal:{TARGET}-")
    # What came from where: the real sdists, and marked stand-ins for what only GitHub has.
    assert "vllm-0.33.0.git" in rehearsed["sources"] and "PyPI sdist vllm-0.33.0" in rehearsed["sources"]
    assert "PyPI sdist flashinfer_python-0.7.2.post1" in rehearsed["sources"]
    assert "STAND-IN cutlass-" in rehearsed["sources"]
    # This sandbox's PyPI copy lacks vLLM 0.33.0's certifi pin: said, never silent.
    assert rehearsed["relaxed"] == ["certifi"]


def test_the_audit_lists_every_unit_with_its_code_and_passes(rehearsed: dict[str, Any]) -> None:
    audit = rehearsed["preflight"]
    assert audit["ok"] and audit["device"] == "12.1"
    units = {u["file"]: u for u in audit["units"]}
    assert len(units) > 100 and audit["counts"]["none"] == 0
    # Family cubins for the FP4 kernels, plain sm_120 for the rest; Marlin only as PTX, JIT-compiled.
    assert units["csrc/quantization/fp4/nvfp4_quant_kernels.cu"]["codes"] == ["sm_120f"]
    assert units["csrc/quantization/marlin/marlin.cu"]["verdict"] == "ptx-only"
    # flash-attention's stand-in: an FA2-like unit as PTX, an FA3-like one built for 9.0a only, which
    # vLLM's own setup.py, patched by fa3-hopper-only, no longer builds for 12.1a (issue 44, item 2;
    # without the patch it is compiled for nothing: test_without_fa3_hopper_only_...).
    fa = "/src/externals/vllm-flash-attn/"
    assert units[f"{fa}csrc/flash_attn/src/flash_fwd_stub.cu"]["verdict"] == "ptx-only"
    assert units[f"{fa}hopper/instantiations/flash_fwd_stub_sm90.cu"] == {
        "file": f"{fa}hopper/instantiations/flash_fwd_stub_sm90.cu",
        "library": "_vllm_fa3_C",
        "codes": [],
        "verdict": "not-built",
    }
    assert audit["counts"]["other-gpu"] == 0
    assert all(u["verdict"] in ("sass", "ptx-only", "not-built") for u in units.values())
    # The stand-ins are named, each with the variable that handed it over, and nothing was cloned.
    tree = sources.vllm_sdist("0.33.0", Options.from_env().cache)
    handed = {e.env if e.handoff == "env" else f"FETCHCONTENT_SOURCE_DIR_{e.name.upper()}" for e in externals.scan(tree)}
    assert set(audit["stubbed"]) == handed | {"VLLM_CUTLASS_SRC_DIR"}
    # Every source CMake would clone came from the source stage: FetchContent was disconnected.
    found = json.loads((rehearsed["out"] / TARGET / "preflight" / "preflight.json").read_text())
    assert {k for k, v in found["src_dirs"].items() if v.startswith("/src/externals/")} == handed
    configure = (rehearsed["out"] / TARGET / "preflight" / "configure.log").read_text()
    assert "DeepGEMM using local DEEPGEMM_SRC_DIR: /src/externals/deepgemm" in configure


def test_the_shipped_target_patches_python_only_and_compiles_no_patched_unit(rehearsed: dict[str, Any]) -> None:
    """0.33.0 with CUDA 13.0 and 12.1a needs one patch, nvfp4-moe-b12x-auto, which changes one Python
    file (docs/patches-needed.md), and compiled from source fa3-hopper-only, which changes setup.py:
    no CUDA source changed, nothing extra compiled, and the audit above still holds every unit to
    code for sm_121."""
    audit = rehearsed["preflight"]
    assert audit["changed_files"] == ["setup.py", "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"]
    assert audit["compiled"] == [] and audit["uncompiled_changes"] == []


def test_the_runtime_image_checks_pass(rehearsed: dict[str, Any]) -> None:
    checks = rehearsed["checks"]
    assert checks["torch"]["cuda"].startswith("13.0")
    assert checks["vllm"]["version"].startswith("0.33.0")
    assert checks["triton"]["stub_bytes"] > 0 and checks["triton"]["compiler"]
    assert checks["cuda_jit"]["nvcc"] == "13.0"
    assert checks["flashinfer"]["version"] == "0.7.2.post1" and checks["flashinfer"]["cuda_path"] == "/opt/sparkbuild/cuda"
    assert set(checks["companions"]) == {"torchvision", "torchaudio", "torchcodec"}
    assert checks["companions"]["torchvision"].startswith("0.29.0")  # vLLM 0.33.0's own pin
    assert checks["multi_node"]["libibverbs.so.1"] == "loads" and checks["multi_node"]["ray"]
    assert checks["multi_node"]["nccl_h"].endswith("/nvidia/nccl/include")  # vLLM's NCCL allocator compiles against it
    # Triton 3.8 compiles for sm_121 with its own ptxas-blackwell (CUDA 13.3), newer than CUDA 13.0's.
    assert checks["triton_ptxas"] == {"arch": "sm_121a", "name": "triton ptxas-blackwell", "release": "13.3"}
    assert checks["fastsafetensors"]["libnuma.so.1"] == "loads"
    # b12x's own vLLM plugins load, and b12x/__init__.py, which FlashInfer's wheel ships too, is b12x's.
    assert {"b12x_fp6", "b12x_loader"} <= set(checks["vllm_plugins"])
    assert "b12x/__init__.py" in checks["shared_files"]["shared"]


def test_only_the_submodule_the_build_uses_is_fetched(rehearsed: dict[str, Any], engine: Engine, tmp_path: Path) -> None:
    """Issue 44, item 3: flash-attention's stand-in has ROCm's two submodules beside csrc/cutlass, as
    upstream's .gitmodules has them; the source stage fetched csrc/cutlass alone (the image's record of
    every source and submodule it was built from says so)."""
    record = engine.copy_out(rehearsed["image"], "/opt/sparkbuild/sources.txt", tmp_path).read_text()
    assert re.search(r"^  csrc/cutlass [0-9a-f]{40}$", record, re.M), record
    assert "composable_kernel" not in record and "aiter" not in record, record


def test_the_images_preflight_record_holds_no_figure_only_this_build_measured(
    rehearsed: dict[str, Any], engine: Engine, tmp_path: Path
) -> None:
    """The preflight report goes into the image as a record, without the build's times and the
    compilers' peak memory: `sparkbuild reproduce` of the source-mode vLLM stage found the two builds
    differing in ``peak_rss_mb`` alone (777 and 750), the wheel the same bytes."""
    record = json.loads(engine.copy_out(rehearsed["image"], "/opt/sparkbuild/preflight.json", tmp_path).read_text())
    exported = json.loads((rehearsed["out"] / TARGET / "preflight" / "preflight.json").read_text())
    measured = {"peak_rss_mb", "configure_seconds", "compile_seconds"}
    assert measured <= set(exported) and not measured & set(record)
    assert record == {
        **{k: v for k, v in exported.items() if k not in measured},
        "compiled": [{k: v for k, v in unit.items() if k not in ("seconds", "peak_rss_mb")} for unit in exported["compiled"]],
    }


def test_the_runtime_keeps_the_vllm_wheel_in_a_layer_of_its_own(rehearsed: dict[str, Any]) -> None:
    """Dependencies, FlashInfer and vLLM in layers of their own: a vLLM change rewrites a small layer."""
    history = subprocess.run(
        ["docker", "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", rehearsed["image"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sizes = {step: size for size, step in (line.split("\t", 1) for line in history.splitlines())}
    vllm = next(size for step, size in sizes.items() if "--no-deps --report /opt/sparkbuild/pip-report-vllm.json" in step)
    deps = next(size for step, size in sizes.items() if "--report /opt/sparkbuild/pip-report-dependencies.json" in step)
    assert vllm.endswith("MB") and float(vllm[:-2]) < 200, vllm  # the Python-only rehearsal wheel, unpacked
    assert deps.endswith("GB") and float(deps[:-2]) > 5, deps  # torch, CUDA's wheels, every dependency


def test_the_wheels_the_build_made_are_published_and_a_fresh_venv_installs_them(
    rehearsed: dict[str, Any], engine: Engine, base: str, registry: Registry, tmp_path: Path
) -> None:
    """What publish attaches: the vLLM wheel (Python-only in a rehearsal: its kernels are not
    compiled) and FlashInfer's real wheel, from the rehearsed stage images, with the arch list the
    vLLM compile recorded; fetched with `sparkbuild wheels` and installed by pip in a fresh venv.
    The subject is the small test base pushed to the registry, standing in for the runtime image
    (several GB) that publish would push: what is attached and fetched is the same."""
    m = matrix.load(ROOT / "matrix.yaml")
    target = rehearsal_target(next(t for t in m.targets if t.id == TARGET), m)
    stages = [(s["stage"], s["ref"]) for s in rehearsed["stages"] if s["stage"] != "runtime"]
    collected = wheels.collect(engine, stages, tmp_path / "collected", wheels.BuiltFor.of(target))
    names = {str(parse_wheel_filename(f.name)[0]): f for f in collected.wheels}
    assert sorted(names) == ["flashinfer-python", "vllm"]
    assert names["vllm"].stage == "vllm" and names["flashinfer-python"].stage == "flashinfer"
    assert collected.build_env["TORCH_CUDA_ARCH_LIST"] == target.arch_list == "12.1a"

    repository = "sparkbuild-test/wheels"
    engine.tag(base, f"{registry.host}/{repository}", "subject")
    try:
        digest = push.push_image(engine, registry, f"{registry.host}/{repository}", "subject")
    finally:
        engine.client.images.remove(f"{registry.host}/{repository}:subject")
    wheels.attach(registry, repository, digest, collected)
    out = tmp_path / "fetched"
    fetched = sparkbuild("wheels", f"{registry.host}/{repository}@{digest}", "--out", str(out), "--json")
    assert fetched.code == 0, fetched.err
    report = json.loads(fetched.out)
    assert {f["file"]: f["sha256"] for f in report["files"] if f["file"].endswith(".whl")} == {
        f.name: f.sha256 for f in collected.wheels
    }
    assert report["index"]["built_for"]["gpu"] == target.gpu and report["install"][-2:] == ["flashinfer-python", "vllm"]

    # A fresh venv on the target's own Python (the runtime image's: the vLLM wheel is cp313), no
    # network: pip takes both wheels from the fetched folder alone (their dependencies, torch and
    # CUDA's 2.6 GB among them, are what the runtime stage installs; not fetched again here).
    show = "import importlib.metadata as m; print(m.version('vllm'), m.version('flashinfer-python'))"
    fresh = (
        "python3 -m venv /tmp/fresh"
        " && /tmp/fresh/bin/pip install --no-index --no-deps --find-links /fetched vllm flashinfer-python"
        f' && /tmp/fresh/bin/python -c "{show}"'
    )
    shown = engine.output(rehearsed["image"], ["sh", "-c", fresh], timeout_s=600, mounts={out: ("/fetched", "ro")})
    versions = shown.strip().splitlines()[-1].split()
    assert versions[0].startswith("0.33.0") and versions[1] == "0.7.2.post1"


def test_the_compile_gets_the_plans_build_jobs(rehearsed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in RESOURCES.items():
        monkeypatch.setenv(key, value)
    (p,) = plan.make(Options.from_env(only=(TARGET,)))
    # 24 GiB: the two heaviest units at once (16.3 GiB measured, 20.4 with the margin) do not fit in 16.
    assert p.jobs is not None and p.jobs.compiles == 1
    done = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "cat", rehearsed["image"], "/opt/sparkbuild/build-env.txt"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split()[:2] == [f"MAX_JOBS={p.jobs.max_jobs}", f"NVCC_THREADS={p.jobs.nvcc_threads}"]


# --- built from upstream's wheel: real kernels -------------------------------------------------------


@pytest.fixture(scope="module")
def from_wheel(shipped: dict[str, Any]) -> dict[str, Any]:
    return {**shipped["results"][WHEEL_TARGET], "out": shipped["out"]}


# Every compiled module of upstream's 0.33.0 wheel (docs/check-binary.md lists their libraries).
MODULES = {
    "vllm._C_stable_libtorch", "vllm._deepselect_C", "vllm._flashkda_C", "vllm._flashmla_C", "vllm._flashmla_extension_C",
    "vllm._moe_C_stable_libtorch", "vllm._qutlass_C", "vllm.cumem_allocator", "vllm.fs_io_C", "vllm.spinloop",
    "vllm.third_party.deep_gemm._C_extension", "vllm.vllm_flash_attn._vllm_fa2_C", "vllm.vllm_flash_attn._vllm_fa3_C",
}  # fmt: skip


def test_a_python_only_patch_keeps_upstreams_wheel_and_its_real_kernels(
    from_wheel: dict[str, Any], rehearsed: dict[str, Any]
) -> None:
    assert from_wheel["status"] == "rehearsed" and from_wheel["error"] is None, from_wheel["error"]
    assert from_wheel["kernels"] == "real" and from_wheel["image"].startswith(f"sparkbuild/rehearsal:{WHEEL_TARGET}-")
    choice = from_wheel["vllm_from"]
    assert (choice["asked"], choice["mode"]) == ("auto", "wheel")
    assert choice["wheel"]["filename"] == "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert choice["why"].startswith(
        "patch nvfp4-moe-b12x-auto: Python files only; upstream's vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    )
    assert "passes check-binary for GPU 12.1" in choice["why"] and "requires torch==2.14.0 and links CUDA 13" in choice["why"]
    # No compile and no preflight; FlashInfer's stage is the source build's (the same inputs).
    assert from_wheel["preflight"] is None and [s["stage"] for s in from_wheel["stages"]] == ["flashinfer", "vllm", "runtime"]
    refs, compiled = ({s["stage"]: s["ref"] for s in r["stages"]} for r in (from_wheel, rehearsed))
    assert refs["flashinfer"] == compiled["flashinfer"] and refs["vllm"] != compiled["vllm"]
    swapped = "\n".join(from_wheel["swapped"])
    assert (
        "upstream's vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl for its aarch64 wheel of vLLM 0.33.0, the same kernels"
        in swapped
    )
    assert "template vllm: the kernel compile" not in swapped and "source cutlass" not in swapped
    assert "check-binary of vLLM's extensions -> not run" not in swapped


def test_both_builds_share_the_runtimes_layers_up_to_vllms_own(
    from_wheel: dict[str, Any], rehearsed: dict[str, Any], engine: Engine, tmp_path: Path
) -> None:
    """vLLM's requirements are the same text from the wheel's METADATA and from the source's setup.py
    (each line in packaging's form), so the runtime's 8.7 GB dependency layer, which BuildKit keys by
    that file, is built once for both; so are FlashInfer's layer and the rest up to vLLM's own. After
    it, six layers differ: the vLLM wheel, the image check (its file and its run), the serving defaults
    (two files) and the manifest."""
    texts = []
    for result in (from_wheel, rehearsed):
        stage = next(s["ref"] for s in result["stages"] if s["stage"] == "vllm")
        found = engine.copy_out(stage, "/wheels/vllm-requirements.txt", tmp_path / result["target"])
        texts.append(found.read_text())
    assert texts[0] == texts[1] and "torch==2.14.0\n" in texts[0]
    wheel_layers, source_layers = (
        engine.client.images.get(r["image"]).attrs["RootFS"]["Layers"] for r in (from_wheel, rehearsed)
    )
    shared = next(i for i, (a, b) in enumerate(zip(wheel_layers, source_layers, strict=True)) if a != b)
    assert len(wheel_layers) == len(source_layers) and shared == len(wheel_layers) - 6


def test_every_compiled_module_of_the_wheel_imports_in_the_runtime_image(from_wheel: dict[str, Any]) -> None:
    """The image check imported each one after torch, with no GPU and no driver: the build base's stub
    libcuda.so, mounted for that check only (most of vLLM's extensions link libcuda.so.1)."""
    found = from_wheel["checks"]["vllm_extensions"]
    assert set(found["modules"]) == MODULES
    assert found["driver_stub"] == "/opt/sparkbuild/driver-stub/libcuda.so"
    # The torch installed is the one the wheel's kernels were built against: its own requirement.
    assert found["torch"]["required"] == ["torch==2.14.0"] and found["torch"]["installed"].startswith("2.14.0")
    assert from_wheel["checks"]["vllm"]["commit"] == "g4ba787ec9"  # what upstream's wheel says of itself
    stub = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "ls", from_wheel["image"], "-A", "/opt/sparkbuild/driver-stub"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert stub.stdout == ""  # mounted for the check only: its mount point stays, empty; no stub driver


def test_an_extension_that_cannot_load_fails_the_image_check_naming_it(from_wheel: dict[str, Any], engine: Engine) -> None:
    """The same check in the built image without the stub driver: vLLM's modules that link the CUDA
    driver cannot load (no GPU, no driver here), and the check names each one with the loader's error.
    This is the failure a module with a missing library or a torch it was not built against gives.
    Only that check runs (``--only``): the others passed in the build, and read the same again."""
    sha256 = from_wheel["vllm_from"]["wheel"]["sha256"]
    check = ["python", "/opt/sparkbuild/check_image.py", "--vllm-version", "0.33.0", "--vllm-wheel-sha256", sha256]
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--entrypoint", check[0], from_wheel["image"], *check[1:],
         "--torch", "2.14.0", "--cuda", "13.0", "--kernels", "real", "--only", "vllm_extensions"],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        "vllm_extensions: RuntimeError: vllm._C_stable_libtorch does not import: ImportError: libcuda.so.1: cannot open"
        in done.stderr
    )
    assert "vllm.vllm_flash_attn._vllm_fa2_C does not import" in done.stderr
    assert "vllm.spinloop does not import" not in done.stderr  # it links no driver: it loads


def test_check_binary_passes_on_the_images_real_extensions(from_wheel: dict[str, Any]) -> None:
    checked = from_wheel["check_binary"]
    assert checked["ok"] and len(checked["libraries"]) == 9  # the nine with GPU code (docs/check-binary.md)
    moe = next(lib for lib in checked["libraries"] if lib["path"].endswith("_moe_C_stable_libtorch.abi3.so"))
    assert moe["counts"]["fails"] == 0 and moe["counts"]["sass"] == 2455
    report = (from_wheel["out"] / WHEEL_TARGET / "check-binary.txt").read_text()
    assert "check-binary for a GPU of compute capability 12.1 (sm_121)" in report and "FAILING" not in report


PROVE_PATCH = """
import base64, hashlib, json, pathlib, vllm
root = pathlib.Path(vllm.__file__).parent.parent
record = next(root.glob("vllm-0.33.0.dist-info")) / "RECORD"
entry = next(line for line in record.read_text().splitlines() if line.startswith(FILE + ","))
data = (root / FILE).read_bytes()
digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
print(json.dumps({"lines": [line.strip() for line in data.decode().splitlines()], "recorded": entry.split(",")[1] == digest,
                  "patches": json.load(open("/opt/sparkbuild/patches.json"))["results"],
                  "sources": open("/opt/sparkbuild/sources.txt").read()}))
"""


def test_the_patch_is_in_the_installed_file_and_the_wheels_record(from_wheel: dict[str, Any], engine: Engine) -> None:
    """The patched wheel was repacked with a RECORD that holds the patched file's hash, so pip installed
    it as a wheel of its own, not files changed behind pip's back."""
    prove = f"FILE = {PYTHON_FILE!r}\n{PROVE_PATCH}"
    found = json.loads(engine.output(from_wheel["image"], ["python3", "-c", prove]).strip().splitlines()[-1])
    at = [i for i, line in enumerate(found["lines"]) if line.startswith(B12X_LINE)]
    assert len(at) == 1 and found["lines"][at[0] + 1] == "NvFp4MoeBackend.MARLIN," and found["recorded"]
    applied = [(r["patch"], r["status"], r["files"]) for r in found["patches"]]
    assert applied == [("nvfp4-moe-b12x-auto", "applies", [PYTHON_FILE])]
    # What the image came from: upstream's file by its URL and sha256, then the patched wheel it became.
    assert "/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl sha256:4b6bdec4ab269990" in found["sources"]
    assert "repacked vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl sha256:" in found["sources"]


def selector_runs(
    built: dict[str, Any], target_id: str, release_file: str, both_ways: Path, engine: Engine, tmp_path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """tests/data/select_moe_backend.py in a rehearsed image (vLLM's real selectors, a GB10's capability
    FAKED, its kernels loaded against the devel base's stub driver): as built (patched), and with
    ``release_file`` of the release's own sdist mounted over the installed one (unpatched)."""
    m = plan.load_matrix(Options.from_env(matrix=both_ways))
    target = rehearsal_target(next(t for t in m.targets if t.id == target_id), m)
    probe = tmp_path / "probe"
    probe.mkdir()
    engine.copy_out(plan.base_name(target.base, target.platform), "/usr/local/cuda/lib64/stubs/libcuda.so", probe)
    shutil.copy(ROOT / "tests" / "data" / "select_moe_backend.py", probe)
    shutil.copy(ROOT / "sparkbuild" / "image" / "startup_probe.py", probe)
    release = sources.vllm_sdist("0.33.0", Options.from_env().cache) / release_file
    installed = f"{built['checks']['vllm_path']}/{release_file.removeprefix('vllm/')}"
    command = ["python3", "/opt/probe/select_moe_backend.py", "/opt/probe/libcuda.so"]

    def selected(mounts: dict[Path, tuple[str, str]]) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(engine.output(built["image"], command, mounts=mounts).strip().splitlines()[-1])
        return found

    return selected({probe: ("/opt/probe", "ro")}), selected({probe: ("/opt/probe", "ro"), release: (installed, "ro")})


def test_vllms_own_selector_takes_b12x_with_the_patch_and_marlin_without(
    from_wheel: dict[str, Any], both_ways: Path, engine: Engine, tmp_path: Path
) -> None:
    """The fix the shipped patch is for, in the rehearsed image: vLLM's real NVFP4 MoE selector
    (upstream's wheel, b12x at vLLM's own pin) with a GB10's capability FAKED, since there is no GB10
    here (tests/data/select_moe_backend.py says how; its kernels load against the devel base's stub
    driver). An NVFP4 W4A16 layer (FP4 weights, bf16 activations) gets B12X; with the release's own
    oracle file mounted over the patched one, Marlin, as vLLM 0.33.0 picks on a Spark (vLLM issue
    #54666). A W4A4 layer gets FlashInfer's CUTLASS either way: the patch reorders nothing before Marlin."""
    patched, unpatched = selector_runs(from_wheel, WHEEL_TARGET, PYTHON_FILE, both_ways, engine, tmp_path)
    assert patched["patched"] and patched["b12x_installed"] and patched["b12x_supports_device"], patched
    assert patched["nvfp4_w4a16"] == {"backend": "B12X", "experts": "B12xExperts"}
    assert not unpatched["patched"] and unpatched["nvfp4_w4a16"]["backend"] == "MARLIN"
    assert patched["nvfp4_w4a4"]["backend"] == unpatched["nvfp4_w4a4"]["backend"] == "FLASHINFER_CUTLASS"


def test_the_report_holds_vllms_own_start_up_of_every_check_with_a_gb10_faked(
    from_wheel: dict[str, Any], rehearsed: dict[str, Any]
) -> None:
    """Issue 38: the rehearsal of the shipped target ran vLLM 0.33.0's own parser, engine config and
    model construction for each of its checks in the built image, a GB10 faked (sparkbuild/verify/startup.py),
    and the kernel-path gate passed each prediction: the FP4 and FP8 MoE checks on FlashInfer's CUTLASS
    and DeepGEMM, every layer named. The source build's image (its compile swapped) predicts nothing, and says why."""
    found = from_wheel["startup"]
    assert found["ok"] and found["vllm"] == "0.33.0" and "GPU FAKED as a GB10" in found["faked"]
    by_check = {c["check"]: c for c in found["checks"]}
    assert sorted(by_check) == ["alphabet", "moe-fp8", "moe-fp8-eager", "moe-nvfp4", "moe-nvfp4-eager", "moe-nvfp4a16"]
    assert all(c["stage"] == "done" and c["ok"] for c in by_check.values())
    chosen = {name: {k["kind"]: [b["backend"] for b in k["chosen"]] for k in c["kernels"]} for name, c in by_check.items()}
    assert chosen["moe-nvfp4"] == {"moe": ["FLASHINFER_CUTLASS"], "nvfp4_gemm": ["FLASHINFER_CUTLASS"]}
    assert chosen["moe-fp8-eager"] == {"moe": ["DEEPGEMM"]}
    assert chosen["moe-nvfp4a16"] == {"moe": ["B12X"]}  # the shipped patch's own check
    assert {(layer["kind"], layer["backend"]) for layer in by_check["moe-nvfp4"]["layers"]} == {
        ("attention", "FLASH_ATTN"),
        ("moe", "FLASHINFER_CUTLASS"),
    }
    assert by_check["moe-nvfp4-eager"]["values"]["cudagraph_mode"] == "NONE"
    # The check served across two Sparks is not predicted (one process on one faked GPU), and says so.
    assert from_wheel["not_predicted"] == {"moe-nvfp4-2node": "served across 2 nodes: the prediction runs one process on one GPU"}
    assert rehearsed["startup"] is None
    assert set(rehearsed["not_predicted"]) == {*by_check, "moe-nvfp4-2node"}
    assert "swapped vLLM's kernel compile" in rehearsed["not_predicted"]["alphabet"]


def test_the_patchs_own_check_fails_its_predicted_start_up_on_the_release_as_it_is(
    from_wheel: dict[str, Any], both_ways: Path, engine: Engine, cache: Path, tmp_path: Path
) -> None:
    """Issue 44, item 7: the shipped patch (nvfp4-moe-b12x-auto) moves W4A16 NVFP4 MoE layers only, and
    moe-nvfp4a16 is the check model with such layers. An image derived from the rehearsed one with the
    release's own oracle file put back (the image as upstream ships it) fails that check's predicted
    start-up on a GB10 (faked): vLLM gives its MoE layers MARLIN. The patched image passes it (B12X:
    test_the_report_holds_vllms_own_start_up_of_every_check_with_a_gb10_faked)."""
    m = plan.load_matrix(Options.from_env(matrix=both_ways))
    target = rehearsal_target(next(t for t in m.targets if t.id == WHEEL_TARGET), m)
    release = sources.vllm_sdist("0.33.0", Options.from_env().cache) / PYTHON_FILE
    installed = f"{from_wheel['checks']['vllm_path']}/{PYTHON_FILE.removeprefix('vllm/')}"
    tag = "sparkbuild-test/unpatched:vllm-0.33.0"
    images.derived_image(
        engine, from_wheel["image"], tag, f"COPY nvfp4.py {installed}", tmp_path / "unpatched", {"nvfp4.py": release.read_text()}
    )
    found = startup.on_gb10(engine, tag, target, [m.checks["moe-nvfp4a16"]], cache)
    (prediction,) = found.predictions
    assert [(c.kind, [b for b, _ in c.found]) for c in prediction.kernels] == [("moe", ["MARLIN"])]
    said = "\n".join(found.problems())
    assert "check moe-nvfp4a16: the kernel path vLLM will choose fails the gate:" in said
    assert "moe: expected B12X or FLASHINFER_B12X, vLLM chose MARLIN: " in said


def test_vllm_starts_on_a_gb10_without_fa3_as_a_compile_with_fa3_hopper_only_leaves_it(
    from_wheel: dict[str, Any], both_ways: Path, engine: Engine, cache: Path, tmp_path: Path
) -> None:
    """Issue 44, item 2: an image without flash-attention's FA3 library (what fa3-hopper-only makes a
    12.1a compile leave out) still starts. Derived from the rehearsed image (upstream's wheel, which
    ships _vllm_fa3_C) with that one file removed: vLLM's FA interface imports and says FA3 is
    unavailable, FA2 loads, and the predicted start-up of a check served with FLASH_ATTN on a GB10
    (faked) is the same as the image's with FA3."""
    m = plan.load_matrix(Options.from_env(matrix=both_ways))
    target = rehearsal_target(next(t for t in m.targets if t.id == WHEEL_TARGET), m)
    fa3 = f"{from_wheel['checks']['vllm_path']}/vllm_flash_attn/_vllm_fa3_C.abi3.so"
    tag = "sparkbuild-test/without-fa3:vllm-0.33.0"
    images.derived_image(engine, from_wheel["image"], tag, f"RUN test -f {fa3} && rm {fa3}", tmp_path / "without-fa3")
    # The build base's stub driver loaded first, as the start-up probe loads it: FA2 links libcuda.
    stub = engine.copy_out(plan.base_name(target.base, target.platform), startup.STUB, tmp_path)
    probe = (
        "import ctypes; ctypes.CDLL('/stub/libcuda.so', mode=ctypes.RTLD_GLOBAL); "
        "import importlib.util as u, vllm.vllm_flash_attn as fa, vllm.vllm_flash_attn.flash_attn_interface as f; "
        "print(u.find_spec('vllm.vllm_flash_attn._vllm_fa3_C') is None, f.FA2_AVAILABLE, f.FA3_UNAVAILABLE_REASON)"
    )
    said = engine.output(tag, ["python3", "-c", probe], mounts={stub.parent: ("/stub", "ro")}).strip().splitlines()[-1]
    assert said.startswith("True True ") and "_vllm_fa3_C" in said, said
    check = [m.checks["moe-nvfp4"]]
    without = startup.on_gb10(engine, tag, target, check, cache)
    # The rehearsed image's own prediction, kept by the rehearsal's cache for the next session (its id stays).
    with_fa3 = startup.on_gb10(engine, from_wheel["image"], target, check, Options.from_env().cache)
    without.require()
    # Every layer's backend, attention's among them (the check's gate names its MoE kinds only).
    chosen = [sorted({(x["kind"], x["backend"]) for x in p.layers}) for p in (without.predictions[0], with_fa3.predictions[0])]
    assert chosen[0] == chosen[1] and ("attention", "FLASH_ATTN") in chosen[0], chosen


def test_gpt_oss_harmony_encoding_loads_with_no_network(from_wheel: dict[str, Any], engine: Engine) -> None:
    """Issue 44, item 6, refuted for 0.33.0 (and its rc): vLLM 0.33.0 requires oss-harmony (>= 0.0.11,
    "includes embedded vocabularies", requirements/common.txt), not openai-harmony, which fetched
    o200k_base.tiktoken at start-up (vLLM #22525). In the rehearsed image with no network at all,
    harmony's gpt-oss encoding loads and encodes."""
    probe = (
        "import importlib.metadata as m; from openai_harmony import load_harmony_encoding as load, HarmonyEncodingName as N; "
        "print(m.version('oss-harmony'), load(N.HARMONY_GPT_OSS).encode('hello world'))"
    )
    said = engine.output(from_wheel["image"], ["python3", "-c", probe], network="none").strip().splitlines()[-1]
    version, tokens = said.split(" ", 1)
    assert tuple(int(p) for p in version.split(".")[:3]) >= (0, 0, 11) and len(json.loads(tokens)) == 2, said


def test_flashinfers_trtllm_kernels_count_as_present_offline_without_a_kernel_wheel(
    from_wheel: dict[str, Any], engine: Engine
) -> None:
    """Issue 44, item 5: the runtime installs no FlashInfer kernel wheel (none is loaded on SM12x; `flashinfer
    download-kernels` put both in unpinned) and says so, yet vLLM takes "flashinfer-cubin is installed" as
    its switch for XQA decode and FlashInfer's attention sinks there; without the image's
    VLLM_HAS_FLASHINFER_CUBIN it asks NVIDIA's artifactory at start-up, and with no network answers no
    (gpt-oss's attention then falls to Triton). With no network at all, vLLM's own check says yes."""
    probe = (
        "import importlib.util as u; from vllm.utils.flashinfer import has_nvidia_artifactory as a; "
        "print(a(), u.find_spec('flashinfer_cubin') is None, u.find_spec('flashinfer_jit_cache') is None)"
    )
    said = engine.output(from_wheel["image"], ["python3", "-c", probe], network="none").strip().splitlines()[-1]
    assert said == "True True True", said
    cubins = engine.output(from_wheel["image"], ["cat", "/opt/sparkbuild/cubins.txt"], network="none")
    assert cubins.strip() == "none: no FlashInfer path on sm_121a loads a cubin"
    unset = engine.output(from_wheel["image"], ["env", "VLLM_HAS_FLASHINFER_CUBIN=0", "python3", "-c", probe], network="none")
    assert unset.strip().splitlines()[-1] == "False True True"  # what the switch decides, offline


# vLLM's own plugin loading, as every vLLM process runs it at start-up.
LOAD_PLUGINS = (
    "import json; from vllm.plugins import load_plugins_by_group; "
    "print(json.dumps(sorted(load_plugins_by_group('vllm.general_plugins'))))"
)


def test_flashinfers_b12x_shim_over_b12x_fails_the_image_naming_the_file_and_both_owners(
    from_wheel: dict[str, Any], engine: Engine, tmp_path: Path
) -> None:
    """The fault the runtime stage now mends, built for real: flashinfer-python 0.7.2.post1's wheel ships
    b12x/__init__.py (a shim that makes `import b12x` FlashInfer's embedded copy), and pip, installing
    FlashInfer after b12x 1.5.1, put it over b12x's own. An image derived from the rehearsed one with
    that file of the FlashInfer stage's own wheel put back: vLLM's own plugin loading drops b12x's
    plugins, and the image's shared-files check fails naming the file, its owner and FlashInfer. The
    rehearsed image (restored after FlashInfer's layer) loads them (test_the_runtime_image_checks_pass)."""
    stage = next(s["ref"] for s in from_wheel["stages"] if s["stage"] == "flashinfer")
    site = str(Path(from_wheel["checks"]["vllm_path"]).parent)
    shim = (
        "import glob, zipfile; wheel = zipfile.ZipFile(glob.glob('/tmp/fi/flashinfer_python-*.whl')[0]); "
        f"open('{site}/b12x/__init__.py', 'wb').write(wheel.read('b12x/__init__.py'))"
    )
    tag = "sparkbuild-test/b12x-shim:vllm-0.33.0"
    steps = f'COPY --from={stage} /wheels /tmp/fi\nRUN python3 -c "{shim}" && rm -r /tmp/fi'
    images.derived_image(engine, from_wheel["image"], tag, steps, tmp_path / "shim")
    loaded = json.loads(engine.output(from_wheel["image"], ["python3", "-c", LOAD_PLUGINS]).strip().splitlines()[-1])
    assert {"b12x_fp6", "b12x_loader"} <= set(loaded)
    broken = json.loads(engine.output(tag, ["python3", "-c", LOAD_PLUGINS]).strip().splitlines()[-1])
    assert not {"b12x_fp6", "b12x_loader"} & set(broken), broken
    with pytest.raises(EngineError) as failed:
        engine.output(tag, ["python3", "/opt/sparkbuild/shared_files.py", "--check"])
    assert "b12x/__init__.py is flashinfer-python's, not its owner b12x 1.5.1's" in str(failed.value)


def test_an_nccl_that_deadlocks_across_nodes_fails_the_image_check_naming_it(
    from_wheel: dict[str, Any], engine: Engine, tmp_path: Path
) -> None:
    """vLLM #52504: NCCL from 2.28.9 until 2.30.4 deadlocks CUDA graphs captured across nodes, so two Sparks
    serving with graphs hang. An image derived from the rehearsed one with NVIDIA's own nvidia-nccl-cu13 2.30.3
    wheel, the release before the fix, installed over torch's 2.30.7 (from PyPI, its sha256 the index's): torch
    loads it, and the image check's multi-node part fails naming the version and the issue; the rehearsed image
    passes it (its build ran it). Not 2.28.9 itself: torch 2.14.0 does not import with it (its libtorch_cuda
    needs ncclCommResume, which 2.28.9 lacks; measured), so that image already fails at `import torch`."""
    machine = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}[from_wheel["platform"]["name"]]
    filename = f"nvidia_nccl_cu13-2.30.3-py3-none-manylinux_2_18_{machine}.whl"
    wheel = sources.fetch(
        sources.index_links("nvidia-nccl-cu13", suffix=".whl")[filename], Options.from_env().cache / "downloads"
    )
    context = tmp_path / "nccl"
    context.mkdir()
    shutil.copy(wheel, context / filename)
    tag = "sparkbuild-test/nccl-2.30.3:vllm-0.33.0"
    steps = f"COPY {filename} /tmp/\nRUN /opt/venv/bin/pip install --no-deps --no-index /tmp/{filename} && rm /tmp/{filename}"
    images.derived_image(engine, from_wheel["image"], tag, steps, context)
    sha256 = from_wheel["vllm_from"]["wheel"]["sha256"]
    script = ROOT / "dockerfiles" / "spark" / "check_image.py"
    check = ["/check_image.py", "--vllm-version", "0.33.0", "--vllm-wheel-sha256", sha256, "--torch", "2.14.0", "--cuda", "13.0"]
    check += ["--kernels", "real", "--only", "multi_node"]

    def multi_node(image: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-v", f"{script}:/check_image.py:ro", "--entrypoint", "python",
             image, *check], capture_output=True, text=True, check=False, timeout=600,
        )  # fmt: skip

    assert multi_node(from_wheel["image"]).returncode == 0
    broken = multi_node(tag)
    assert broken.returncode != 0
    assert "multi_node: RuntimeError: torch loads NCCL 2.30.3, which deadlocks CUDA graphs across nodes (vLLM #52504" in (
        broken.stderr
    ), broken.stderr[-2000:]


@pytest.fixture(scope="module")
def gptoss(shipped: dict[str, Any]) -> dict[str, Any]:
    return {**shipped["results"][GPTOSS_TARGET], "out": shipped["out"]}


def test_the_gpt_oss_target_starts_gpt_oss_on_flashinfers_cutlass_mxfp4_and_its_sinks(gptoss: dict[str, Any]) -> None:
    """Issue 44, item 1: the shipped gpt-oss target, rehearsed as it ships (upstream's 0.33.0 wheel, its
    real kernels, the two patches' Python), and vLLM's own start-up of its checks with a GB10 faked:
    gpt-oss's MoE layers get FlashInfer's CUTLASS MXFP4 x MXFP8 (not Marlin, as on the main image) and
    its attention FlashInfer with sinks, with no network (VLLM_HAS_FLASHINFER_CUBIN), and the gate,
    which accepts that MoE kernel alone, passes, eager and with the image's graphs."""
    assert gptoss["status"] == "rehearsed" and gptoss["error"] is None, gptoss["error"]
    assert gptoss["kernels"] == "real" and gptoss["vllm_from"]["mode"] == "wheel"
    assert "mxfp4-moe-flashinfer-sm12x" in gptoss["vllm_from"]["why"]
    found = gptoss["startup"]
    assert found["ok"] and found["vllm"] == "0.33.0"
    by_check = {c["check"]: c for c in found["checks"]}
    assert sorted(by_check) == ["alphabet", "gptoss-mxfp4", "gptoss-mxfp4-eager"]
    for name in ("gptoss-mxfp4", "gptoss-mxfp4-eager"):
        check = by_check[name]
        assert check["stage"] == "done" and check["ok"], check
        chosen = {k["kind"]: [b["backend"] for b in k["chosen"]] for k in check["kernels"]}
        assert chosen == {"attention": ["FLASHINFER"], "moe": ["FLASHINFER_CUTLASS_MXFP4_MXFP8"]}, name
        assert {(x["kind"], x["backend"]) for x in check["layers"]} == {
            ("attention", "FLASHINFER"),
            ("moe", "FLASHINFER_CUTLASS_MXFP4_MXFP8"),
        }, name
    assert by_check["gptoss-mxfp4-eager"]["values"]["cudagraph_mode"] == "NONE"


def test_vllms_own_mxfp4_selector_gives_gpt_oss_flashinfers_cutlass_with_the_patch_and_marlin_without(
    gptoss: dict[str, Any], both_ways: Path, engine: Engine, tmp_path: Path
) -> None:
    """The fix of mxfp4-moe-flashinfer-sm12x in its target's rehearsed image: vLLM's real MXFP4 selector
    (upstream's wheel, FlashInfer at vLLM's pin) with a GB10's capability FAKED, for gpt-oss's MoE layer
    (expert biases, swigluoai). Patched, automatic selection gives FLASHINFER_CUTLASS_MXFP4_MXFP8; with the
    release's own oracle file mounted over the patched one, MARLIN, as vLLM 0.33.0 picks on a Spark (vLLM
    issue #41477). The kernel was there all along: asked for by name, vLLM takes it unpatched too; b12x
    refuses the layer's biases either way."""
    patched, unpatched = selector_runs(gptoss, GPTOSS_TARGET, MXFP4_FILE, both_ways, engine, tmp_path)
    assert patched["mxfp4_patched"] and not unpatched["mxfp4_patched"]
    assert patched["gpt_oss_mxfp4"]["auto"] == {"backend": "FLASHINFER_CUTLASS_MXFP4_MXFP8"}
    assert unpatched["gpt_oss_mxfp4"]["auto"] == {"backend": "MARLIN"}
    for found in (patched, unpatched):
        assert found["gpt_oss_mxfp4"]["flashinfer_cutlass_afp8"] == {"backend": "FLASHINFER_CUTLASS_MXFP4_MXFP8"}
        assert "does not support expert biases" in found["gpt_oss_mxfp4"]["b12x"]["error"]
    # The NVFP4 selection is the main image's (the other patch): unchanged by this one.
    assert patched["nvfp4_w4a16"]["backend"] == "B12X" and patched["nvfp4_w4a4"]["backend"] == "FLASHINFER_CUTLASS"


def flashinfer_moe_gemm(engine: Engine, image: str, gencode: str | None) -> dict[str, Any]:
    """tests/data/flashinfer_moe_gemm.py run in ``image`` (FlashInfer's own JIT command for one
    instantiation of its SM120 MXFP8 x MXFP4 grouped GEMM), and the MMA instructions of the object's
    GEMM kernel. Kept by the image's id and the script, as the nvcc tests keep theirs: a compile is
    a minute and a half on two cores."""
    script = ROOT / "tests" / "data" / "flashinfer_moe_gemm.py"
    key = hashlib.sha256(f"{engine.inspect(image)['Id']}\0{gencode}\0".encode() + script.read_bytes()).hexdigest()[:32]
    kept = Options.from_env().cache / "test-nvcc" / f"flashinfer-{key}.json"
    if kept.is_file():
        found: dict[str, Any] = json.loads(kept.read_text())
        return found
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copy(script, folder)
        out = folder / "out"
        out.mkdir(mode=0o777)
        command = ["python3", "/opt/probe/flashinfer_moe_gemm.py", "/out", *(["--gencode", gencode] if gencode else [])]
        said = engine.output(image, command, mounts={folder: ("/opt/probe", "ro"), out: ("/out", "rw")}, timeout_s=1200)
        found = json.loads(said.strip().splitlines()[-1])
        listing = sass.gemm_sass(out / "gemm.o")
    found.update(mma=sorted(sass.mma_instructions(listing)), instructions=sass.instructions(listing), trap="TRAP" in listing)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(found))
    return found


@pytest.mark.nvcc
def test_gpt_oss_moe_kernel_as_flashinfers_jit_builds_it_for_a_gb10_is_a_block_scaled_mma(
    gptoss: dict[str, Any], engine: Engine
) -> None:
    """Issue 44, item 1: the proof the CUTLASS MXFP4 patch carries (an SM12x GEMM built without an MMA
    returns garbage, tests/patch/test_mxfp4_sm12x.py), for the kernel the gpt-oss image gives gpt-oss.
    FlashInfer compiles its CUTLASS fused MoE on the GPU that runs it (JIT, nvcc in the image), so no
    binary of it is in the image to read; in the rehearsed image, FlashInfer's own JIT spec for SM120
    (its generator and its ninja command, with FLASHINFER_CUDA_ARCH_LIST=12.1 for the GB10 not here)
    builds the bf16-output instantiation of its MXFP8 x MXFP4 grouped GEMM (the script says what it
    trims). FlashInfer targets sm_121a, and its GEMM kernel is SM120's block-scaled MMA, FP4 x E4M3 with
    E8M0 scales. Built for plain sm_121 (a JIT that lost the arch-specific suffix), the same source holds
    no MMA at all: CUTLASS's SM120 collective becomes a trap."""
    built = flashinfer_moe_gemm(engine, gptoss["image"], None)
    assert built["flashinfer"] == "0.7.2.post1" and "-gencode=arch=compute_121a,code=sm_121a" in built["command"]
    assert built["instantiation"].startswith("INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm120, __nv_fp8_e4m3, SafeFP4,")
    assert built["mma"] == ["QMMA.SF.16832.F32.E2M1.E4M3.E8"] and not built["trap"], built
    plain = flashinfer_moe_gemm(engine, gptoss["image"], "arch=compute_121,code=sm_121")
    assert plain["mma"] == [] and plain["trap"] and plain["instructions"] < 100, plain


def test_gpt_oss_put_back_on_the_0_33_target_fails_its_predicted_start_up_naming_marlin(
    from_wheel: dict[str, Any], both_ways: Path, engine: Engine
) -> None:
    """What the target's left_out says, proven in the rehearsed image: with the GPU faked as a GB10,
    vLLM 0.33.0 gives gpt-oss's MXFP4 MoE layers MARLIN, so its checks fail the gate before any runner
    serves them, naming the check, the kind, the backend and each layer."""
    m = plan.load_matrix(Options.from_env(matrix=both_ways))
    target = rehearsal_target(next(t for t in m.targets if t.id == WHEEL_TARGET), m)
    assert {"gptoss-mxfp4", "gptoss-mxfp4-eager"} <= dict(target.left_out).keys()
    # Kept by the rehearsal's cache, as the prediction above.
    found = startup.on_gb10(engine, from_wheel["image"], target, [m.checks["gptoss-mxfp4-eager"]], Options.from_env().cache)
    with pytest.raises(VerifyError) as failed:
        found.require()
    said = str(failed.value)
    assert "check gptoss-mxfp4-eager: the kernel path vLLM will choose fails the gate:" in said
    assert "vLLM chose MARLIN: " in said and "moe MARLIN on 2 layer(s): model.layers.0.mlp.experts.routed_experts" in said


def test_the_entrypoint_passes_every_users_options_to_vllm_0_33_configured_for_a_faked_gb10(
    from_wheel: dict[str, Any], both_ways: Path, engine: Engine, cache: Path, tmp_path: Path
) -> None:
    """Issue 38 on the release the Spark target builds: tests/support/population.py's population of
    users' options through vLLM 0.33's own parser and engine config in the rehearsed image, configured
    for a GB10, FAKED (sparkbuild/image/startup_probe.py's fakes: capability 12.1, vLLM's CUDA platform
    class, the devel base's stub driver; nothing touches a GPU), where vLLM sizes CUDA graphs for real.
    Judged as on 0.32 (tests/lanes/test_run.py), and where the user sized the graphs (speculative
    decoding, --performance-mode, a capture size) the image adds none. The entrypoint before the fix got
    20 of the 48 cases wrong here: 6 refused by vLLM, 14 with the image's sizes over vLLM's own."""
    m = plan.load_matrix(Options.from_env(matrix=both_ways))
    target = rehearsal_target(next(t for t in m.targets if t.id == WHEEL_TARGET), m)
    stub = engine.copy_out(plan.base_name(target.base, target.platform), "/usr/local/cuda/lib64/stubs/libcuda.so", tmp_path)
    runtime = population.spark_runtime(tmp_path / "render")
    found = population.run(engine, from_wheel["image"], runtime, model.ensure(cache, "alphabet"), tmp_path, gb10_stub=stub)
    assert found["platform"] == "/opt/probe/libcuda.so (a stub)"
    wrong = population.wrong(found)
    assert not wrong, json.dumps(wrong, indent=1)
    assert not population.refused_alone(found), population.refused_alone(found)
    # Where the user sized nothing, the image's promise: vLLM's sizes for the max_num_seqs in effect, and 5 and 10.
    case = next(c for c in found["cases"] if c["name"] == "--max-num-seqs 64")
    vllms = case["reference"]["values"]["cudagraph_capture_sizes"]
    assert vllms and case["entrypoint"]["values"]["cudagraph_capture_sizes"] == sorted({*vllms, 5, 10})


def test_a_lock_whose_wheel_sha256_is_wrong_stops_at_pips_hash_check(
    from_wheel: dict[str, Any], both_ways: Path, tmp_path: Path
) -> None:
    """The wheel stage of the same target, planned from a lock whose pin has another sha256 (the
    index now serves another file, or the lock was edited): pip's --require-hashes refuses the file,
    and the build says so in one message, exit 10. Nothing is patched or built from it."""
    pinned = from_wheel["vllm_from"]["wheel"]
    m = plan.load_matrix(Options.from_env(matrix=both_ways))
    target = rehearsal_target(next(t for t in m.targets if t.id == WHEEL_TARGET), m)
    wrong = "0" * 64
    pin = lock.WheelPin(
        version="0.33.0", platform=target.platform, index="https://pypi.org/simple/", filename=pinned["filename"],
        url=pinned["url"], sha256=wrong, torch="torch==2.14.0", cuda="13",
        check_binary={"12.1": lock.BinaryVerdict(ok=True, libraries=9, kernels=1, sass=1, ptx=0, other=0, fails=0)},
    )  # fmt: skip
    opts = Options.from_env(matrix=both_ways, out=tmp_path / "out")
    p = plan.plan_target(replace(target, wheel=pin), m.patch_folders, opts)
    assert p.choice is not None and p.choice.mode == "wheel"
    stage = next(s for s in p.stages if s.name == "vllm")
    engine = Engine()
    with pytest.raises(SourceError) as info:
        build.ensure_stage(engine, None, p, stage, opts)
    message = str(info.value)
    assert info.value.exit_code == 10 and not engine.image_exists(stage.ref)
    assert f"upstream's wheel {pinned['filename']} from {pinned['url']} has sha256 4b6bdec4ab269990" in message
    assert f"and the lock pins {wrong} (pip's --require-hashes refused it): nothing was patched or built from it" in message


def git_daemons(root: Path) -> list[int]:
    """git daemon processes serving ``root``."""
    base = f"--base-path={root}".encode()
    return pids_where(lambda argv: any(a.endswith(b"git-daemon") or a == b"daemon" for a in argv[:2]) and base in argv)


def test_ctrl_c_during_the_preflight_leaves_no_daemon_and_no_partial_repository(
    rehearsed: dict[str, Any], both_ways: Path, tmp_path: Path
) -> None:
    """A real SIGINT once the preflight has started (after the module's rehearsal, so it starts in
    seconds): exit 130, the offline git daemon stopped, no repository left half made."""
    root = Options.from_env().cache / "offline"
    with cli.start(
        "rehearse", "--offline", "--matrix", str(both_ways), "--only", TARGET, env={"SPARKBUILD_OUT": str(tmp_path), **RESOURCES}
    ) as proc:  # the context closes the pipe it reads
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("==> Preflight of"):
                break
        assert git_daemons(root), "the rehearsal serves its sources while it runs"
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=300) == 130, rest[-3000:]
    assert "interrupted" in rest
    assert git_daemons(root) == []
    assert list(root.glob("*.partial")) == []


# --- made to fail ---------------------------------------------------------------------------------

# A fault no shipped configuration of 0.33.0 produces for real (its FP4 units all get family code, so
# the hardware conversion assembles): the native E2M1 instruction in a unit that gets a plain sm_120
# cubin, the fault e2m1-software exists for. Injected by a diff patch applied like any other.
INJECTED = """\
--- a/csrc/quantization/fp4/nvfp4_quant_entry.cu
+++ b/csrc/quantization/fp4/nvfp4_quant_entry.cu
@@ -1,1 +1,6 @@
+__global__ void sparkbuild_injected(float const* x, unsigned* out) {
+  unsigned r;
+  asm volatile("{ .reg .b8 b; cvt.rn.satfinite.e2m1x2.f32 b, %1, %2; cvt.u32.u8 %0, b; }" : "=r"(r) : "f"(x[0]), "f"(x[1]));
+  out[0] = r;
+}
FIRST
"""
PATCH_YAML = """\
summary: Test fault, injected (tests/lanes/test_rehearsal.py); never shipped.
why: The hardware E2M1 conversion in a unit that gets plain sm_120 code.
component: vllm
versions: ">=0.33"
upstream: {fixed_in: null, links: []}
change: {diff: fault.diff}
"""
# A real change to a kernel a 12.1a build never compiles: 0.33.0 lists nvfp4_scaled_mm_kernels.cu only
# in FP4_SM100_SRCS. A patch set like this changes CUDA code that preflight cannot prove and the
# image will not hold; preflight must fail it, naming the file (issue 29, section 3).
UNCOMPILED = """\
--- a/csrc/quantization/fp4/nvfp4_scaled_mm_kernels.cu
+++ b/csrc/quantization/fp4/nvfp4_scaled_mm_kernels.cu
@@ -1,1 +1,2 @@
+// sparkbuild test: a change to an SM10x-only kernel
FIRST
"""
# A comment added to the FP4 header, its code untouched: preflight compiles every unit that includes
# it, so the same variant shows the unpatched hardware E2M1 conversion building for 12.1a with CUDA
# 13.0, the evidence that e2m1-software is not needed there (docs/patches-needed.md).
E2M1_AS_IS = """\
--- a/csrc/quantization/fp4/nvfp4_utils.cuh
+++ b/csrc/quantization/fp4/nvfp4_utils.cuh
@@ -1,1 +1,2 @@
+// sparkbuild test: the header as upstream has it
FIRST
"""


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped matrix whose target comes twice more, each with one key changed, and the patches
    folder with the fault beside the shipped patches."""
    folder = tmp_path_factory.mktemp("variants")
    shutil.copytree(ROOT / "patches", folder / "patches")
    tree = sources.vllm_sdist("0.33.0", Options.from_env().cache)
    first = (tree / "csrc/quantization/fp4/nvfp4_quant_entry.cu").read_text().splitlines()[0]
    (folder / "patches" / "zz-test-fault").mkdir()
    (folder / "patches" / "zz-test-fault" / "fault.diff").write_text(INJECTED.replace("FIRST", f" {first}"))
    (folder / "patches" / "zz-test-fault" / "patch.yaml").write_text(PATCH_YAML)
    for name, rel, text in (
        ("zz-test-sm100-only", "csrc/quantization/fp4/nvfp4_scaled_mm_kernels.cu", UNCOMPILED),
        ("zz-test-e2m1-as-is", "csrc/quantization/fp4/nvfp4_utils.cuh", E2M1_AS_IS),
    ):
        first_line = (tree / rel).read_text().splitlines()[0]
        (folder / "patches" / name).mkdir()
        (folder / "patches" / name / "change.diff").write_text(text.replace("FIRST", f" {first_line}"))
        (folder / "patches" / name / "patch.yaml").write_text(
            PATCH_YAML.replace("plain sm_120 code", "unit the test names").replace("fault.diff", "change.diff")
        )
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    (target,) = [t for t in shipped["targets"] if t.get("id") == TARGET]
    shipped["targets"] = [
        # No patch: auto would take upstream's wheel, whose arch list is upstream's; this is the compile's.
        {**target, "id": "vllm-0.33.0-cu130-sm120a", "arch_list": "12.0a", "vllm_from": "source"},
        # e2m1-software beside the fault: its patched FP4 units compile, the fault's unit does not.
        {**target, "id": "vllm-0.33.0-cu130-fault", "patches": ["e2m1-software", "zz-test-fault"]},
        {**target, "id": "vllm-0.33.0-cu130-uncompiled", "patches": ["zz-test-e2m1-as-is", "zz-test-sm100-only"]},
    ]
    (folder / "matrix.yaml").write_text(yaml.safe_dump(shipped, sort_keys=False))
    return folder / "matrix.yaml"


@pytest.fixture(scope="module")
def variants_run(engine: Engine, variants: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The variants rehearsed by one command (one offline source set-up): each fails, none stops another.
    Their inputs are the same each session, so their records are the next session's too."""
    out = tmp_path_factory.mktemp("variants-out")
    only = ["--only", "vllm-0.33.0-cu130-sm120a", "--only", "vllm-0.33.0-cu130-fault", "--only", "vllm-0.33.0-cu130-uncompiled"]
    with leftovers.kept_for_next_session(engine, "rehearsal-variants"):
        done = rehearse(out, "--matrix", str(variants), *only)
    assert done.returncode == 8, done.stderr[-3000:]
    return {"results": {r["target"]: r for r in json.loads(done.stdout)}, "out": out, "stderr": done.stderr}


@pytest.fixture(scope="module")
def failed(variants_run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(variants_run["results"])


def daemon_port(stderr: str) -> str:
    """The port the rehearsal's git daemon listened on, from its printed command."""
    (line,) = [line for line in stderr.splitlines() if line.startswith("+ git daemon ")]
    return line.split("--port=")[1].split()[0]


def test_a_later_rehearsal_fetches_no_commit_again_from_a_daemon_on_another_port(
    shipped: dict[str, Any], variants_run: dict[str, Any]
) -> None:
    """Each rehearsal serves its sources on a port of its own; the commits, and so the fetch steps, are
    the same. The daemon's address is a BuildKit secret (git-at-commit.sh), which keys no step: as a
    build argument it keyed every step after it, and each rehearsal fetched every source again."""
    assert daemon_port(shipped["stderr"]) != daemon_port(variants_run["stderr"])
    build_log = (variants_run["out"] / "vllm-0.33.0-cu130-fault" / "build-preflight.log").read_text()
    fetch = r"^(#\d+) \[source +\d+/\d+\] RUN --mount=type=secret,id=git-insteadof git-at-commit (\S+)"
    fetches = re.findall(fetch, build_log, re.M)
    assert any("/vllm-0.33.0" in repo for _, repo in fetches), build_log[:3000]
    for step, repo in fetches:
        assert f"\n{step} CACHED\n" in build_log, f"{repo} was fetched again"


def test_an_arch_list_whose_cubins_do_not_load_on_sm121_fails_naming_the_units(failed: dict[str, dict[str, Any]]) -> None:
    result = failed["vllm-0.33.0-cu130-sm120a"]
    audit = result["preflight"]
    assert result["status"] == "failed (preflight)" and not audit["ok"]
    failing = {u["file"] for u in audit["units"] if u["verdict"] == "none"}
    assert len(failing) > 100 and all(u["codes"] == ["sm_120a"] for u in audit["units"] if u["verdict"] == "none")
    assert "csrc/quantization/fp4/nvfp4_quant_kernels.cu" in failing
    assert (
        "cannot serve sm_121" in result["error"] and "csrc/quantization/fp4/nvfp4_quant_kernels.cu (sm_120a)" in result["error"]
    )
    assert result["stages"] == []  # stopped before any stage was built


def test_a_patched_unit_that_does_not_compile_for_its_code_fails_naming_it(failed: dict[str, dict[str, Any]]) -> None:
    result = failed["vllm-0.33.0-cu130-fault"]
    assert result["preflight"] is not None, result["error"]
    audit = result["preflight"]
    assert "csrc/quantization/fp4/nvfp4_utils.cuh" in audit["changed_files"]  # e2m1-software
    compiled = {c["file"]: c for c in audit["compiled"]}
    fault = compiled["csrc/quantization/fp4/nvfp4_quant_entry.cu"]
    assert not fault["ok"] and "not supported on .target 'sm_120'" in fault["error"]
    assert "csrc/quantization/fp4/nvfp4_quant_entry.cu (does not compile)" in result["error"]
    # The other units, the FP4 ones e2m1-software patched among them, compile with code for the Spark.
    for name in ("csrc/quantization/fp4/nvfp4_quant_kernels.cu", "csrc/nvfp4_kv_cache_kernels.cu"):
        unit = compiled[name]
        assert unit["ok"] and unit["runs_on_device"], unit
        assert unit["codes"] == ["sm_120f"]  # the family cubin, read from the ELF header as the audit does
        assert unit["reaches"] == ["csrc/quantization/fp4/nvfp4_utils.cuh"]
        # Each compile measured apart, its process tree's peak (a ccache hit's is ccache's own).
        assert unit["peak_rss_mb"] > 0 and unit["measured"] is False


def test_without_fa3_hopper_only_setup_py_compiles_fa3_for_no_gpu_of_the_list(
    failed: dict[str, dict[str, Any]], rehearsed: dict[str, Any]
) -> None:
    """Issue 44, item 2, before the fix: the same 0.33.0 source and 12.1a list without the patch. vLLM's
    setup.py lists _vllm_fa3_C, so ninja's closure of its targets compiles flash-attention's FA3 unit,
    which gets no code for any GPU of the list; with the patch (the shipped target compiled from source)
    setup.py leaves the extension out and the unit is configured but never built."""
    found = json.loads((rehearsed["out"] / TARGET / "preflight" / "preflight.json").read_text())
    assert "_vllm_fa2_C" in found["targets"] and "_vllm_fa3_C" not in found["targets"]
    audit = failed["vllm-0.33.0-cu130-uncompiled"]["preflight"]
    assert audit is not None
    fa3 = "/src/externals/vllm-flash-attn/hopper/instantiations/flash_fwd_stub_sm90.cu"
    units = {u["file"]: u for u in audit["units"]}
    assert units[fa3]["verdict"] == "other-gpu" and units[fa3]["codes"] == []
    assert audit["counts"]["other-gpu"] == 1


def test_a_patch_set_whose_cuda_change_no_unit_compiles_fails_naming_the_file(failed: dict[str, dict[str, Any]]) -> None:
    """The patched SM10x-only kernel: preflight compiles no unit that holds it, and says so."""
    result = failed["vllm-0.33.0-cu130-uncompiled"]
    assert result["preflight"] is not None, result["error"]
    audit = result["preflight"]
    changed = "csrc/quantization/fp4/nvfp4_scaled_mm_kernels.cu"
    assert result["status"] == "failed (preflight)" and not audit["ok"]
    assert changed in audit["changed_files"] and audit["uncompiled_changes"] == [changed]
    assert changed not in {c["file"] for c in audit["compiled"]} and audit["counts"]["none"] == 0
    assert f"the patch set changes {changed}, and no unit this configure compiles is or includes it" in result["error"]
    assert result["stages"] == []


def test_the_fp4_header_as_upstream_has_it_builds_in_every_unit_for_121a(failed: dict[str, dict[str, Any]]) -> None:
    """The same variant's other patch adds only a comment to nvfp4_utils.cuh, so preflight compiles
    every unit that includes the header with its hardware E2M1 conversion untouched: each builds, with
    code for sm_121. e2m1-software is not needed for 12.1a with CUDA 13.0 (docs/patches-needed.md)."""
    audit = failed["vllm-0.33.0-cu130-uncompiled"]["preflight"]
    assert audit is not None
    compiled = {c["file"]: c for c in audit["compiled"]}
    assert {
        "csrc/quantization/fp4/nvfp4_quant_entry.cu",
        "csrc/quantization/fp4/nvfp4_quant_kernels.cu",
        "csrc/quantization/fp4/activation_nvfp4_quant_fusion_kernels.cu",
        "csrc/quantization/fp4/nvfp4_experts_quant.cu",
        "csrc/nvfp4_kv_cache_kernels.cu",
    } == set(compiled)
    for unit in compiled.values():
        assert unit["ok"] and unit["runs_on_device"], unit
