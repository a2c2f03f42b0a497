"""Where a Spark target's vLLM comes from, without Docker: upstream's published wheel (its Python
files patched) or the source build, chosen by ``vllm_from`` (sparkbuild/plan/vllmfrom.py) from what the
patch engine knows each patch may change and what the lock's ``wheels`` table says of the wheel.

The matrix is the shipped one; the patches are made here from the real 0.33.0 tree: one changes a
Python file of the vllm/ package, one a CUDA header. The lock holds upstream's real aarch64 0.33.0
wheel as ``resolve`` pins it (name, URL and sha256 from PyPI's index; check-binary's counts from
docs/check-binary.md), then each fact that must turn the choice, one at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbuild import patch
from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError, PatchError
from sparkbuild.image import vllm_wheel
from sparkbuild.lanes import upstream_wheel
from sparkbuild.patch import engine, rules, scope
from sparkbuild.plan import lock, matrix, plan
from sparkbuild.upstream import sources
from tests.support import ROOT
from tests.support.matrix import error_of, line_of
from tests.support.trees import TreeFactory

TARGET = "vllm-0.33.0-cu130-sm121"
FILENAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl"
SHA256 = "e9e404f52c8494b69bd83fe99fe7ecfa9f6b89fbd156d2a9639c24ea41d6d606"
URL = f"https://files.pythonhosted.org/packages/eb/e0/bfb969e9a03c55402f08684c2691e1e2a4307ebc9c90aae0cebadb43d9b5/{FILENAME}"
PYTHON_FILE = "vllm/v1/attention/backends/flashinfer.py"
CUDA_FILE = "csrc/quantization/fp4/nvfp4_utils.cuh"
PATCH_YAML = """\
summary: Test patch (tests/plan/test_vllm_from.py); never shipped.
why: A change to {file}.
component: vllm
versions: ">=0.33"
upstream: {{fixed_in: null, links: []}}
change: {{diff: change.diff}}
"""


def pinned(**changes: Any) -> dict[str, Any]:
    """Upstream's aarch64 0.33.0 wheel as resolve writes it into the lock (``changes`` replace keys)."""
    verdict = {"ok": True, "libraries": 9, "kernels": 11038, "sass": 6736, "ptx": 2506, "other": 1796, "fails": 0, "error": ""}
    entry = {
        "version": "0.33.0",
        "platform": "linux/arm64",
        "index": "https://pypi.org/simple/",
        "filename": FILENAME,
        "url": URL,
        "sha256": SHA256,
        "torch": "torch==2.14.0",
        "cuda": "13",
        "check_binary": {"12.1": verdict},
    }
    return {**entry, **changes}


def diff(tree: Path, rel: str, line: str) -> str:
    """A real diff: ``line`` inserted before the first line of ``rel`` in the 0.33.0 tree."""
    first = (tree / rel).read_text().splitlines()[0]
    return f"--- a/{rel}\n+++ b/{rel}\n@@ -1,1 +1,2 @@\n+{line}\n {first}\n"


@pytest.fixture
def project(tmp_path: Path, pristine: TreeFactory) -> Path:
    """The shipped matrix and patches, with two test patches beside them; no lock yet."""
    tree = pristine("0.33.0")
    shutil.copytree(ROOT / "patches", tmp_path / "patches")
    for name, rel, line in (("zz-python", PYTHON_FILE, "# sparkbuild test"), ("zz-cuda", CUDA_FILE, "// sparkbuild test")):
        (tmp_path / "patches" / name).mkdir()
        (tmp_path / "patches" / name / "change.diff").write_text(diff(tree, rel, line))
        (tmp_path / "patches" / name / "patch.yaml").write_text(PATCH_YAML.format(file=rel))
    shutil.copy(ROOT / "matrix.yaml", tmp_path / "matrix.yaml")
    return tmp_path / "matrix.yaml"


def with_target(path: Path, **keys: Any) -> Path:
    """The matrix at ``path`` with the 0.33.0 target's ``keys`` set (YAML, as a person writes them)."""
    data = yaml.safe_load(path.read_text())
    (target,) = [t for t in data["targets"] if t.get("id") == TARGET]
    target.update(keys)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_lock(path: Path, **entries: dict[str, Any]) -> None:
    """``matrix.lock.json`` beside the matrix, holding ``entries`` (key: platform) in its wheels table."""
    wheels = {lock.wheel_key("0.33.0", e["platform"]): e for e in entries.values()}
    lock.Lock(wheels=wheels).write(lock.default_path(path))


def planned(path: Path) -> plan.TargetPlan:
    opts = Options.from_env(matrix=path, only=(TARGET,), cache=path.parent / "cache")
    (p,) = plan.make(opts)
    return p


def refused(path: Path) -> str:
    """The ConfigError planning the matrix at ``path`` with its lock raises, as text."""
    with pytest.raises(ConfigError) as info:
        planned(path)
    return str(info.value)


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARKBUILD_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "sparkbuild", *args], capture_output=True, text=True, env=env, cwd=cwd)


# --- the choice ---------------------------------------------------------------------------------


def test_without_a_pinned_wheel_auto_compiles_and_says_to_run_resolve(project: Path) -> None:
    p = planned(project)
    assert p.choice is not None and (p.choice.asked, p.choice.mode) == ("auto", "source")
    assert p.choice.why == "upstream's wheel of vLLM 0.33.0 for linux/arm64 is not pinned: run `sparkbuild resolve`"
    # The source build needs what it always needed; nothing of the wheel.
    assert p.unresolved == ("vllm v0.33.0", "flashinfer v0.7.2.post1", "cutlass v4.7.1")
    assert [s.name for s in p.stages] == ["flashinfer", "vllm", "runtime"] and "AS preflight-report" in p.stages[
        1
    ].rendered.dockerfile


def test_a_pinned_wheel_that_passes_is_chosen_and_the_plan_says_why(project: Path) -> None:
    write_lock(project, arm=pinned())
    p = planned(project)
    assert p.choice is not None and p.choice.mode == "wheel"
    assert p.choice.why == (
        f"patch nvfp4-moe-b12x-auto: Python files only; upstream's {FILENAME} (sha256 e9e404f52c8494b6...) passes "
        "check-binary for GPU 12.1 (11038 kernels in 9 libraries: 6736 sass, 2506 ptx, 1796 other, 0 fail), requires "
        "torch==2.14.0 and links CUDA 13"
    )
    vllm = p.stages[1].rendered.dockerfile
    # No compile and no preflight: pip fetches the pinned file, held to its sha256; the URL is a build argument.
    assert "AS preflight-report" not in vllm and "setup.py bdist_wheel" not in vllm and "RUN git-at-commit" not in vllm
    # The shipped patch set (nvfp4-moe-b12x-auto, one Python file) applied to the wheel's files.
    assert f"--filename {FILENAME}" in vllm and f"--sha256 {SHA256} --version 0.33.0 --extra b12x" in vllm
    assert "--patches /opt/sparkbuild/patches --patch nvfp4-moe-b12x-auto --out /wheels" in vllm
    assert "ARG VLLM_WHEEL_URL=\n" in vllm and URL not in vllm and p.build_args()["VLLM_WHEEL_URL"] == URL
    # The runtime is the same template: its check holds vLLM to the wheel's sha256 and imports its kernels.
    runtime = p.stages[2].rendered.dockerfile
    assert f"--vllm-wheel-sha256 {SHA256}" in runtime and "--kernels real --driver-stub" in runtime
    # Neither vLLM's commit, CUTLASS nor its external projects are needed or hashed.
    assert p.unresolved == ("flashinfer v0.7.2.post1",)
    assert p.inputs["cutlass"] is None and p.inputs["externals"] is None
    assert p.inputs["vllm_from"] == {"mode": "wheel", "wheel": FILENAME, "sha256": SHA256}
    assert p.labels["io.sparkbuild.vllm.wheel"] == f"{FILENAME} sha256:{SHA256}"

    shown = run("plan", "--matrix", str(project), "--only", TARGET, cwd=project.parent)
    assert shown.returncode == 0, shown.stderr
    said = f"  from:    wheel (patch nvfp4-moe-b12x-auto: Python files only; upstream's {FILENAME} (sha256 e9e404f52c8494b6...)"
    assert said in shown.stdout and "passes check-binary" in shown.stdout
    as_json = run("plan", "--json", "--matrix", str(project), "--only", TARGET, cwd=project.parent)
    (found,) = json.loads(as_json.stdout)
    assert found["vllm_from"] == {
        "asked": "auto",
        "mode": "wheel",
        "why": p.choice.why,
        "wheel": {"filename": FILENAME, "url": URL, "sha256": SHA256},
    }
    assert found["disk_gb"]["vllm"] == 1  # the wheel's stage, not a compile's 40 GB


def test_hadolint_passes_the_wheel_builds_dockerfiles(project: Path, tmp_path: Path) -> None:
    write_lock(project, arm=pinned())
    folders = build.write_contexts(planned(with_target(project, patches=["zz-python"])), tmp_path / "render")
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([hadolint, "--no-color", *(f / "Dockerfile" for f in folders)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_content_hash_holds_the_mode_and_the_sha256_not_the_url(project: Path) -> None:
    write_lock(project, arm=pinned())
    wheel = planned(project)
    write_lock(project, arm=pinned(url="https://mirror.example/simple/vllm/" + FILENAME))
    mirrored = planned(project)
    assert mirrored.content_tag == wheel.content_tag and [s.ref for s in mirrored.stages] == [s.ref for s in wheel.stages]
    write_lock(project, arm=pinned(sha256="f" * 64))
    assert planned(project).content_tag != wheel.content_tag
    source = planned(with_target(project, vllm_from="source"))
    assert source.choice is not None and source.choice.mode == "source" and source.content_tag != wheel.content_tag
    assert source.choice.why == "the matrix asks for the source build"


def test_a_python_only_patch_keeps_the_wheel_and_a_cuda_patch_compiles(project: Path) -> None:
    write_lock(project, arm=pinned())
    p = planned(with_target(project, patches=["zz-python"]))
    assert p.choice is not None and p.choice.mode == "wheel" and p.choice.why.startswith("patch zz-python: Python files only; ")
    assert "--patches /opt/sparkbuild/patches --patch zz-python --out /wheels" in p.stages[1].rendered.dockerfile
    p = planned(with_target(project, patches=["zz-python", "zz-cuda"]))
    assert p.choice is not None and p.choice.mode == "source"
    assert p.choice.why == f"patch zz-cuda changes {CUDA_FILE}, a compiled source the wheel cannot take"


@pytest.mark.parametrize(
    ("name", "wheel"),
    [
        ("cmake-arch-sm121", False),
        ("e2m1-software", False),
        ("mxfp4-cutlass-sm12x", False),
        ("flashinfer-sinks-sm12x", True),
        ("mxfp4-moe-flashinfer-sm12x", True),
    ],
)
def test_each_shipped_rule_declares_what_it_may_change(name: str, wheel: bool) -> None:
    """The patch engine knows a rule's files from its module (WRITES): flashinfer-sinks-sm12x and
    mxfp4-moe-flashinfer-sm12x change Python files alone."""
    (found,) = [p for p in patch.load(ROOT / "patches") if p.name == name]
    assert scope.changes(found) == rules.load(found.rule or "").writes
    assert (scope.compiled(found) == ()) is wheel


def test_vllm_from_wheel_with_a_cuda_patch_is_refused_at_the_patch(project: Path) -> None:
    write_lock(project, arm=pinned())
    path = with_target(project, vllm_from="wheel", patches=["zz-python", "zz-cuda"])
    error = error_of(path)  # the patch alone says it: no lock is read
    assert error.startswith(f"{path}:{line_of(path, '- zz-cuda')}: targets[1].patches[1]: vllm_from: wheel, but patch zz-cuda")
    assert f"changes {CUDA_FILE}, a compiled source the wheel cannot take; build from source" in error


REASONS = [
    (
        "fails",
        {"check_binary": {"12.1": {"ok": False, "libraries": 1, "kernels": 3, "sass": 2, "ptx": 0, "other": 0, "fails": 1,
                                   "error": "1 kernel(s) have code for sm_12x but none that runs on sm_121"}}},
        f"{FILENAME} fails check-binary for GPU 12.1: 3 kernels in 1 libraries: 2 sass, 0 ptx, 0 other, 1 fail "
        "(1 kernel(s) have code for sm_12x but none that runs on sm_121)",
    ),
    ("torch", {"torch": "torch==2.13.0"}, f"{FILENAME} requires torch==2.13.0; the target's torch is 2.14.0"),
    ("cuda", {"cuda": "12"}, f"{FILENAME}'s extensions link libcudart.so.12 (CUDA 12); the target is CUDA 13.0"),
    (
        "missing",
        {"missing": "the index https://pypi.org/simple/ has no vLLM 0.33.0 wheel for linux/arm64 (CPython 3.12, glibc 2.39)"},
        "the index https://pypi.org/simple/ has no vLLM 0.33.0 wheel for linux/arm64 (CPython 3.12, glibc 2.39)",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "changes", "why"), REASONS, ids=[r[0] for r in REASONS])
def test_each_fact_against_the_wheel_compiles_and_vllm_from_wheel_refuses_it(
    project: Path, case: str, changes: dict[str, Any], why: str
) -> None:
    write_lock(project, arm=pinned(**changes))
    p = planned(project)
    assert p.choice is not None and (p.choice.mode, p.choice.why) == ("source", why), case
    path = with_target(project, vllm_from="wheel")
    assert refused(path) == (
        f"{path}:{line_of(path, 'vllm_from: wheel')}: targets[1].vllm_from: upstream's wheel cannot be used: {why}; "
        "use vllm_from: auto (it chooses the source build) or source"
    )


def test_a_wheel_judged_for_another_gpu_only_is_not_resolved_for_this_one(project: Path) -> None:
    verdicts = pinned()["check_binary"]
    write_lock(project, arm=pinned(check_binary={"9.0": verdicts["12.1"]}))
    why = f"{FILENAME} has no check-binary verdict for GPU 12.1 in the lock: run `sparkbuild resolve`"
    p = planned(project)
    assert p.choice is not None and (p.choice.mode, p.choice.why) == ("source", why)
    # Asked for the wheel: unresolved, as an unpinned commit is, and the build refuses it.
    p = planned(with_target(project, vllm_from="wheel"))
    assert p.choice is not None and p.choice.mode == "wheel" and p.unresolved[0] == f"vllm 0.33.0 wheel for linux/arm64 ({why})"


def test_a_git_ref_or_a_release_candidate_compiles(project: Path) -> None:
    m = matrix.load(with_target(project, vllm={"ref": "main"}, id="vllm-main"))
    ref = next(t for t in m.targets if t.id == "vllm-main")
    assert matrix.vllm_choice(ref, m.patch_folders) is not None
    assert matrix.vllm_choice(ref, m.patch_folders).why == "vLLM from a git ref: upstream publishes wheels of releases only"  # type: ignore[union-attr]
    rc = next(t for t in m.targets if t.lane == "rc")
    candidate = matrix.at_commit(rc, matrix.GitSource(repo=rc.vllm.repo or "", ref="v0.34.0rc1", commit="a" * 40), "0.34.0rc1")
    choice = matrix.vllm_choice(candidate, m.patch_folders)
    assert choice is not None and choice.mode == "source" and "release candidate" in choice.why


def test_vllm_from_is_for_the_spark_profile(project: Path) -> None:
    data = yaml.safe_load(project.read_text())
    data["targets"][0]["vllm_from"] = "source"
    project.write_text(yaml.safe_dump(data, sort_keys=False))
    assert "targets[0].vllm_from: vllm_from is for the spark profile" in error_of(project)
    data["targets"][0]["vllm_from"] = "auto"
    data["targets"][1]["vllm_from"] = "wheels"
    project.write_text(yaml.safe_dump(data, sort_keys=False))
    assert "targets[1].vllm_from:" in error_of(project) and "Perhaps you meant 'wheel'?" in error_of(project)


# --- the lock's wheels table ---------------------------------------------------------------------


def test_the_lock_keeps_each_wheel_and_refuses_a_broken_entry(tmp_path: Path) -> None:
    path = tmp_path / "matrix.lock.json"
    lock.Lock(wheels={lock.wheel_key("0.33.0", "linux/arm64"): pinned()}).write(path)
    found = lock.read(path).wheel("0.33.0", "linux/arm64")
    assert found is not None and found.to_json() == pinned() and lock.read(path).wheel("0.33.0", "linux/amd64") is None
    data = json.loads(path.read_text())
    data["wheels"]["vllm==0.33.0 linux/arm64"]["sha256"] = "abc"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"wheels\.vllm==0\.33\.0 linux/arm64: sha256 'abc' is not 64 hex digits; run"):
        lock.read(path)


def test_a_wheel_fits_its_platform_python_and_glibc() -> None:
    assert upstream_wheel.fits(FILENAME, "linux/arm64", "3.12", "2.39")
    assert upstream_wheel.fits(FILENAME, "linux/arm64", "3.13", "2.41")  # abi3: any later CPython
    assert not upstream_wheel.fits(FILENAME, "linux/amd64", "3.12", "2.39")
    assert not upstream_wheel.fits(FILENAME, "linux/arm64", "3.12", "2.27")  # manylinux_2_28 needs glibc 2.28
    assert not upstream_wheel.fits("vllm-0.33.0-cp311-cp311-manylinux2014_x86_64.whl", "linux/amd64", "3.12", "2.39")
    assert upstream_wheel.fits("vllm-0.33.0-cp312-cp312-manylinux2014_x86_64.whl", "linux/amd64", "3.12", "2.39")


# --- what a patch may change, and the wheel stage's own check --------------------------------------


def test_installed_python_files_are_the_vllm_packages_py_files_alone() -> None:
    for path in (PYTHON_FILE, "vllm/**/*.py", "vllm/envs.py"):
        assert scope.installed(path), path
    for path in (
        CUDA_FILE,
        "CMakeLists.txt",
        "setup.py",
        "vllm/model_executor/configs/x.json",
        "vllm/**",
        "vllm/*.p?",
        "tests/a.py",
    ):
        assert not scope.installed(path), path


def test_applying_to_an_unpacked_wheel_refuses_a_change_beyond_its_python_files(tmp_path: Path, pristine: TreeFactory) -> None:
    """``python3 -m sparkbuild.patch apply --installed``, as the wheel stage runs it: a patch that
    changes a file of the vllm/ package that is not Python fails naming it, and nothing is written."""
    tree = tmp_path / "vllm-0.33.0"
    (tree / "vllm" / "v1" / "attention" / "backends").mkdir(parents=True)
    shutil.copy(pristine("0.33.0") / PYTHON_FILE, tree / PYTHON_FILE)
    (tree / "vllm" / "configs.json").write_text("{}\n")
    before = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    patches = tmp_path / "patches"
    for name, rel, text in (("a-python", PYTHON_FILE, "# ok"), ("b-json", "vllm/configs.json", '{"x": 1}')):
        (patches / name).mkdir(parents=True)
        (patches / name / "change.diff").write_text(diff(tree, rel, text))
        (patches / name / "patch.yaml").write_text(PATCH_YAML.format(file=rel))
    args = ["apply", "--installed", "--source", str(tree), "--version", "0.33.0", "--patches", str(patches)]
    done = subprocess.run([sys.executable, "-m", "sparkbuild.patch", *args, "--patch", "a-python", "--patch", "b-json"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == PatchError.exit_code, done.stderr
    assert "b-json changes vllm/configs.json: the wheel's compiled extensions cannot take it. Nothing was written" in done.stderr
    assert {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()} == before
    done = subprocess.run(
        [sys.executable, "-m", "sparkbuild.patch", *args, "--patch", "a-python"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (tree / PYTHON_FILE).read_text().startswith("# ok\n") and (tree / engine.RECORD).is_file()


def test_a_rule_that_edits_beyond_its_declared_files_is_a_bug_named(
    pristine: TreeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault no shipped rule has (each edits only what it declares): e2m1-software with its WRITES
    narrowed to CMakeLists.txt, injected by replacing what ``rules.load`` returns; its real edit of the
    FP4 header is then outside them."""
    real = rules.load("e2m1-software")
    monkeypatch.setattr(rules, "load", lambda name: real.__class__(**{**vars(real), "writes": ("CMakeLists.txt",)}))
    (found,) = [p for p in patch.load(ROOT / "patches") if p.name == "e2m1-software"]
    with pytest.raises(PatchError, match=rf"rule e2m1-software changed {CUDA_FILE}, outside the files its module declares"):
        engine.check(pristine("0.33.0"), (found,), "0.33.0")


# --- the wheel stage's requirements: the wheel's own metadata -----------------------------------------


def test_the_requirements_are_the_wheels_own_with_its_extras_and_relaxed_bounds() -> None:
    """From the Requires-Dist of vLLM 0.33.0's real metadata (its sdist's PKG-INFO, as the wheel's METADATA)."""
    tree = sources.vllm_sdist("0.33.0", Options.from_env().cache)
    lines = [
        line.split(": ", 1)[1] for line in (tree / "PKG-INFO").read_text().splitlines() if line.startswith("Requires-Dist: ")
    ]
    found = vllm_wheel.requirements(lines, ["b12x"], ["certifi"])
    assert found[-1] == "b12x==1.5.1" and "certifi" in found and "torch==2.14.0" in found
    assert not any("extra ==" in r or r.startswith(("pandas", "zentorch")) for r in found)  # other extras left out
    assert 'protobuf==7.36.1; platform_machine == "s390x"' in found  # pip evaluates the markers
    with pytest.raises(vllm_wheel.WheelError, match=r"the wheel declares no extra nope; it has .*b12x"):
        vllm_wheel.requirements(lines, ["nope"], [])
