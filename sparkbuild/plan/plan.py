"""Targets -> build plans: rendered Dockerfile, inputs, content-addressed and readable tags.

Pure: reads the matrix, templates and patch files, and never talks to Docker or the network.
The content hash covers every input that changes the image; where wheels are downloaded from
does not change the image and stays out of it.
"""

from __future__ import annotations

import configparser
import fnmatch
import hashlib
import json
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbuild import __version__, patch
from sparkbuild.config import project
from sparkbuild.config.options import Options, defaults, env
from sparkbuild.errors import ConfigError
from sparkbuild.image import cuda_layout, serve_defaults, vllm_setup, vllm_wheel
from sparkbuild.patch import bundle as patch_bundle
from sparkbuild.patch import pullrequest
from sparkbuild.plan import base_recipe, lock, matrix, render, toolchain, vllmfrom
from sparkbuild.plan.matrix import Target
from sparkbuild.upstream import externals
from sparkbuild.util import fsutil, host

# Bump when the meaning of the inputs changes, so every tag moves once.
PLAN_FORMAT = 1
STEPS = ("base", "build", "verify", "publish")


STAGE_REPOSITORY = "sparkbuild/stages"
# The first CUDA major whose PyPI wheels carry nvcc (the runtime's JIT compiler comes from PyPI from it on).
JIT_WHEELS_FROM = 13
# sparkbuild modules a stage runs as scripts inside the image.
# Standalone scripts of sparkbuild's that run in the image (standard library only), by context name.
IMAGE_SCRIPTS = {
    "cuda_layout.py": cuda_layout,
    "serve_defaults.py": serve_defaults,
    "vllm_setup.py": vllm_setup,
    "vllm_wheel.py": vllm_wheel,
}


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One stage image: content-addressed, so equal inputs give one image shared by targets."""

    rendered: render.Rendered
    content_hash: str
    ref: str
    final: bool

    @property
    def name(self) -> str:
        return self.rendered.name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ref": self.ref, "needs": list(self.rendered.needs), "content_hash": self.content_hash}


@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    target: Target
    base_ref: str
    stages: tuple[StagePlan, ...]
    inputs: dict[str, Any]
    content_hash: str
    content_tag: str
    tags: tuple[str, ...]
    labels: dict[str, str]
    jobs: toolchain.Jobs | None = None
    # Where pip finds wheels for this build: build args plus an optional local wheel to mount.
    source_args: dict[str, str] = field(default_factory=dict)
    wheel_files: tuple[Path, ...] = ()
    steps: tuple[str, ...] = STEPS
    # Where the stage templates and each patch were found (printed by plan; never part of a hash,
    # so a team's copy of a packaged file builds the same image).
    templates: project.Found | None = None
    patch_sources: dict[str, project.Found] = field(default_factory=dict)
    # Each patch's one-line summary (its patch.yaml): why the target carries it, as plan prints it.
    patch_summaries: dict[str, str] = field(default_factory=dict)
    # Spark: whether vLLM is compiled or upstream's wheel, and why (None: the local profile).
    choice: vllmfrom.Choice | None = None
    # Where the source stages fetch the pinned commits from, when not from the names the plan hashes
    # ("NEW=OLD" URL prefixes; the offline rehearsal's git daemon): given to the build as a BuildKit
    # secret, which keys no step, so another port for the same commits reuses every fetch.
    git_insteadof: str = ""

    @property
    def id(self) -> str:
        return self.target.id

    @property
    def repository(self) -> str:
        return self.target.repository

    @property
    def local_ref(self) -> str:
        """The target's image as built here: its last stage."""
        return self.stages[-1].ref

    @property
    def unresolved(self) -> tuple[str, ...]:
        """Git components not pinned to a commit: building them is refused."""
        return unresolved(self.target, self.choice)

    def build_args(self) -> dict[str, str]:
        """Build arguments: they change how fast or from where, never what is built."""
        jobs = self.jobs.build_args() if self.jobs else {}
        ccache = {"CCACHE_MAXSIZE": f"{self.target.ccache_gb}G"} if self.target.profile == "spark" else {}
        return {**dict(self.target.build_args), **self.source_args, **jobs, **ccache}

    def manifest(self) -> dict[str, Any]:
        """The build manifest written into the image: every input, and the tag it gave."""
        return {
            "sparkbuild": __version__,
            "target": self.id,
            "repository": self.repository,
            "content_tag": self.content_tag,
            "content_hash": self.content_hash,
            "inputs": self.inputs,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "profile": self.target.profile,
            "platform": self.target.platform,
            "vllm": {
                "kind": self.target.vllm.kind,
                "spec": self.target.vllm.spec,
                "version": self.target.vllm.version,
                "commit": self.target.vllm.commit,
            },
            "repository": self.repository,
            "content_tag": self.content_tag,
            "tags": list(self.tags),
            "content_hash": self.content_hash,
            "base": self.base_ref,
            "stages": [s.to_json() for s in self.stages],
            "build_jobs": None
            if self.jobs is None
            else {"max_jobs": self.jobs.max_jobs, "nvcc_threads": self.jobs.nvcc_threads, "compiles": self.jobs.compiles},
            "build_timeout_minutes": self.target.build_timeout_minutes,
            "unresolved": list(self.unresolved),
            "steps": list(self.steps),
            "checks": [c.name for c in self.target.checks],
            "patches": [{"name": n, "summary": self.patch_summaries.get(n)} for n in self.target.patches],
            "left_out": dict(self.target.left_out),
            "vllm_from": None if self.choice is None else self.choice.to_json(),
            "inputs": self.inputs,
            "labels": self.labels,
            "sources": self.source_args,
            "git_insteadof": self.git_insteadof or None,
            "found": {
                "templates": None if self.templates is None else self.templates.to_json(),
                "patches": {name: found.to_json() for name, found in self.patch_sources.items()},
            },
        }


def unresolved(target: Target, choice: vllmfrom.Choice | None = None) -> tuple[str, ...]:
    """What is not pinned yet: git refs without a commit, images without a digest, and for a build
    from upstream's wheel, the wheel (it needs no vLLM commit, CUTLASS or external project)."""
    images = tuple(
        f"base {b.name} ({b.image})" for b in dict.fromkeys(bases(target).values()) if b.image is not None and "@" not in b.image
    )
    if target.profile != "spark":
        return images
    if target.vllm.kind == "candidate":
        return ("vllm release candidate (only `sparkbuild rc` picks it)", *images)
    if choice is not None and choice.mode == "wheel":
        wheel = () if choice.wheel is not None else (f"vllm {target.vllm.version} wheel for {target.platform} ({choice.why})",)
        sources = {"flashinfer": target.flashinfer, "triton": target.triton}
        return (
            wheel + tuple(f"{name} {src.ref}" for name, src in sources.items() if src is not None and src.commit is None) + images
        )
    sources = {"vllm": target.vllm.git(), "flashinfer": target.flashinfer, "triton": target.triton, "cutlass": target.cutlass}
    refs = tuple(f"{name} {src.ref}" for name, src in sources.items() if src is not None and src.commit is None)
    if target.vllm.commit is not None and target.externals is None:
        refs += ("vllm's external projects (resolve reads them from its CMake files)",)
    refs += tuple(f"{e.name} {e.ref}" for e in target.externals or () if e.commit is None)
    return refs + images


def select(targets: tuple[Target, ...], only: tuple[str, ...], profile: str | None) -> tuple[Target, ...]:
    chosen = tuple(
        t
        for t in targets
        if (profile is None or t.profile == profile) and (not only or any(fnmatch.fnmatch(t.id, g) for g in only))
    )
    if not chosen:
        ids = ", ".join(t.id for t in targets)
        raise ConfigError(f"no target matches --only {' '.join(only) or '*'} --profile {profile or 'any'}; targets: {ids}")
    return chosen


def load_matrix(opts: Options) -> matrix.Matrix:
    """The matrix with the lock's pins: ``--lock``, else ``<matrix>.lock.json`` when it exists."""
    path = opts.lock or lock.default_path(opts.matrix)
    if opts.lock is not None and not path.is_file():
        raise ConfigError(f"lock file {path} does not exist; `sparkbuild resolve --lock {path}` writes it")
    return matrix.load(opts.matrix, lock.read(path) if path.is_file() else None)


def make(opts: Options, lane: str = "nightly") -> tuple[TargetPlan, ...]:
    """Load the matrix and plan every selected target of ``lane``."""
    return plan_lane(load_matrix(opts), opts, lane)


def plan_lane(m: matrix.Matrix, opts: Options, lane: str = "nightly") -> tuple[TargetPlan, ...]:
    """Plan every selected target of ``lane`` in a loaded matrix."""
    plans = tuple(plan_target(t, m.patch_folders, opts) for t in lane_targets(m, opts, lane))
    _check_tag_clash(plans)
    return plans


def lane_targets(m: matrix.Matrix, opts: Options, lane: str) -> tuple[Target, ...]:
    """The targets of ``lane`` that ``--only`` and ``--profile`` select."""
    in_lane = tuple(t for t in m.targets if t.lane == lane)
    if not in_lane:
        raise ConfigError(f"{opts.matrix}: no target has lane: {lane}; add one (see docs/lanes.md)")
    return select(in_lane, opts.only, opts.profile)


def lane_ids(opts: Options, lane: str) -> tuple[str, ...]:
    """The ids of the targets of ``lane`` that ``--only`` and ``--profile`` select: one job each in a
    fanned-out workflow, each job selecting its own with ``--only ID``.

    The nightly's are planned in full here, so what only a plan of them all finds (two targets
    claiming one tag) stops the run once, before a job per target. An rc target is planned only
    once ``sparkbuild rc`` has found the candidate it is built from.
    """
    if lane == "nightly":
        return tuple(p.id for p in make(opts, lane))
    return tuple(t.id for t in lane_targets(load_matrix(opts), opts, lane))


def choice_of(target: Target, patch_folders: Mapping[str, Path]) -> vllmfrom.Choice | None:
    """``matrix.vllm_choice``, a refusal said as the ConfigError of the target."""
    try:
        return matrix.vllm_choice(target, patch_folders)
    except vllmfrom.Refused as exc:
        raise ConfigError(f"{target.where}: vllm_from: wheel, but {exc}; use vllm_from: auto or source") from None


def plan_target(target: Target, patch_folders: Mapping[str, Path], opts: Options) -> TargetPlan:
    base_ref, base_identity = base_recipe.reference(target.base, target.platform)
    patches = {name: patch.digest(patch_folders[name]) for name in target.patches}
    templates = project.profile_folder(opts, target.profile)
    choice = choice_of(target, patch_folders)
    stages = plan_stages(target, patch_folders, opts, templates.path, choice)
    inputs: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "id": target.id,
        "profile": target.profile,
        "platform": target.platform,
        "vllm": {"kind": target.vllm.kind, "spec": target.vllm.spec, "repo": target.vllm.repo, "commit": target.vllm.commit},
        "candidate": _git_input(target.candidate),
        "triton": _git_input(target.triton),
        "flashinfer": _git_input(target.flashinfer),
        "cutlass": _git_input(target.cutlass),
        "cuda": target.cuda,
        "torch": target.torch,
        "arch_list": target.arch_list,
        "base": base_identity,
        "patches": patches,
        "stages": {s.name: s.content_hash for s in stages},
        "serve": list(target.serve.command()),
        "build_args": dict(target.build_args),
        "externals": None if target.externals is None else [e.to_json() for e in target.externals],
        "compile": target.compile,
        "relax": list(target.relax),
        "runtime_extras": list(target.runtime_extras),
    }
    if choice is not None:
        # Where vLLM comes from: the source build, or upstream's wheel by its sha256 (not its URL:
        # where the bytes come from does not change the image).
        wheel = choice.wheel
        inputs["vllm_from"] = {"mode": choice.mode} | (
            {"wheel": wheel.filename, "sha256": wheel.sha256} if wheel is not None and choice.mode == "wheel" else {}
        )
        if choice.mode == "wheel":
            # Built from the wheel: no vLLM commit, CUTLASS or external project goes into the image.
            inputs |= {"vllm": {**inputs["vllm"], "commit": None}, "cutlass": None, "externals": None}
    content_hash = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    content_tag = f"{target.id}-{content_hash[:12]}"
    final = stages[-1]
    stages = (
        *stages[:-1],
        StagePlan(rendered=final.rendered, content_hash=content_hash, ref=f"{target.repository}:{content_tag}", final=True),
    )
    fields = {"vllm_version": target.version, "date": opts.date, "id": target.id}
    source_args, wheels = torch_source(target, opts)
    if choice is not None and choice.mode == "wheel" and choice.wheel is not None and choice.wheel.url:
        source_args = {**source_args, "VLLM_WHEEL_URL": choice.wheel.url}
    return TargetPlan(
        target=target,
        base_ref=base_ref,
        stages=stages,
        inputs=inputs,
        content_hash=content_hash,
        content_tag=content_tag,
        tags=tuple(matrix.readable_tag(t, fields, target) for t in target.tags),
        labels=labels(target, base_identity, patches, content_hash, choice),
        jobs=toolchain.build_jobs(opts.build_memory, opts.build_cores, target.arch_list, target.build_jobs)
        if target.profile == "spark"
        else None,
        source_args=source_args,
        wheel_files=wheels,
        templates=templates,
        patch_sources={name: project.patch_found(patch_folders[name]) for name in target.patches},
        patch_summaries={name: patch.load_one(patch_folders[name]).summary for name in target.patches},
        choice=choice,
    )


def _git_input(source: matrix.GitSource | None) -> dict[str, Any] | None:
    return None if source is None else {"repo": source.repo, "ref": source.ref, "commit": source.commit}


def template_variables(target: Target, choice: vllmfrom.Choice | None = None) -> dict[str, Any]:
    """What the stage templates see. Everything here is an input of the stage that uses it."""
    refs = {role: base_recipe.reference(b, base_platform(target, role))[0] for role, b in bases(target).items()}
    spark: dict[str, Any] = defaults()["spark_runtime"]
    return {
        "target": target,
        "base_image": refs["base"],
        "source_base_image": refs["source_base"],
        "runtime_base_image": refs["runtime_base"],
        "ptxas_image": refs["ptxas_base"],
        "torch": target.torch,
        "vllm_wheel": target.vllm.spec,
        "vllm_version": target.vllm.version,
        "vllm_git": target.vllm.git() if target.profile == "spark" else None,
        "flashinfer_arch_list": toolchain.flashinfer_arch_list(target.flashinfer.version, target.arch_list)
        if target.flashinfer
        else None,
        "serve_command": target.serve.command(),
        "patches": target.patches,
        "unresolved": "unresolved",
        "externals": target.externals or (),
        "external_env": externals.handoff(target.externals or ())[0],
        "external_cmake_args": externals.handoff(target.externals or ())[1],
        "compile": target.compile,
        "jit_components": ",".join(spark["jit_components"]),
        # NVIDIA's PyPI wheels carry nvcc from CUDA 13 on (CUDA 12's have ptxas and NVVM only).
        "jit_from_wheels": target.cuda is not None and int(target.cuda.split(".")[0]) >= JIT_WHEELS_FROM,
        "gpu_arch": target.gpu.replace(".", "") + "a",
        "gpu_sm12x": target.gpu.split(".")[0] == "12",
        "jit_home": "/opt/sparkbuild/cuda"
        if target.cuda and int(target.cuda.split(".")[0]) >= JIT_WHEELS_FROM
        else "/usr/local/cuda",
        "cuda_dash": (target.cuda or "").replace(".", "-"),
        # "source" (compiled) or "wheel" (upstream's, pinned by sha256); None for the local profile.
        "vllm_from": None if choice is None else choice.mode,
        "wheel": None if choice is None else choice.wheel,
    }


def bases(target: Target) -> dict[str, matrix.Base]:
    """Every base image a target's stages use, by role."""
    return {
        "base": target.base,
        "source_base": target.source_base,
        "runtime_base": target.runtime_base,
        "ptxas_base": target.ptxas_base,
    }


def base_platform(target: Target, role: str) -> str:
    """The platform the base of ``role`` is made for. The source stages run on the build platform
    (`FROM --platform=$BUILDPLATFORM`: fetching and patching need no emulation), so theirs is the base
    made for it: a made base's reference names one platform, and BuildKit would look another
    platform's up on Docker Hub (a pinned image is a multi-platform index: its reference is the same).
    Every other stage runs on the target's. Only a cross build (an arm64 target on x86_64) differs."""
    return host.build_platform(target.platform) if role == "source_base" else target.platform


def plan_stages(
    target: Target, patch_folders: Mapping[str, Path], opts: Options, templates: Path, choice: vllmfrom.Choice | None = None
) -> tuple[StagePlan, ...]:
    # Each stage's hash is needed while rendering (later stages name it) and in its plan: once each.
    hashes: dict[str, str] = {}

    def ref_of(stage: render.Rendered) -> str:
        hashes[stage.name] = stage_hash(target, stage)
        return f"{STAGE_REPOSITORY}:{stage.name}-{hashes[stage.name][:16]}"

    rendered = render.render(
        templates,
        target.profile,
        template_variables(target, choice),
        stage_ref=ref_of,
        resources=resources(target, patch_folders),
    )
    return tuple(
        StagePlan(rendered=r, content_hash=hashes[r.name], ref=f"{STAGE_REPOSITORY}:{r.name}-{hashes[r.name][:16]}", final=False)
        for r in rendered
    )


def stage_hash(target: Target, stage: render.Rendered) -> str:
    """A stage's identity: its Dockerfile (which names every input and earlier stage) and files."""
    key = {"format": PLAN_FORMAT, "profile": target.profile, "platform": target.platform, "stage": stage.name}
    return hashlib.sha256(json.dumps({**key, "digest": stage.digest()}, sort_keys=True).encode()).hexdigest()


class Resources(Mapping[str, render.Files]):
    """Context files by name; those in ``later`` are made the first time a stage's ``file()`` asks
    for them: deriving the patch engine's modules parses their source (tens of ms), and only a Spark
    source stage copies them, so a local target's plan never pays for it."""

    def __init__(self, ready: Mapping[str, render.Files], later: Mapping[str, Callable[[], render.Files]]) -> None:
        self._made = dict(ready)
        self._later = later

    def __getitem__(self, name: str) -> render.Files:
        if name not in self._made:
            self._made[name] = self._later[name]()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._made, *self._later]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self._made, *self._later]))


def resources(target: Target, patch_folders: Mapping[str, Path]) -> Resources:
    """Context files a stage can ask for with ``file()`` beyond its profile folder."""
    patch_files: list[tuple[str, bytes]] = []
    for name in target.patches:
        folder = patch_folders[name]
        patch_files += [(f"patches/{name}/{f.relative_to(folder)}", f.read_bytes()) for f in fsutil.files(folder)]
        spec = patch.load_one(folder).pr
        if spec is not None:
            # An upstream PR: its fetched files (by sha256, so the stage hash holds still) go with it,
            # and the source stage merges them without fetching.
            patch_files += [(f"patches/{name}/{rel}", data) for rel, data in pullrequest.materialized(folder, spec)]
    # Standalone scripts of sparkbuild's that run in the image (standard library only).
    scripts = {name: ((name, Path(str(module.__file__)).read_bytes()),) for name, module in IMAGE_SCRIPTS.items()}
    serve = json.dumps(target.serve.defaults_json()).encode()
    ready = {"patches": tuple(patch_files), "serve-defaults.json": (("serve-defaults.json", serve),), **scripts}
    return Resources(ready, later={"sparkbuild": engine_files})


def engine_files() -> render.Files:
    """The patch engine as a source stage runs it: the modules sparkbuild.patch.bundle derives."""
    return tuple((f"sparkbuild/{path}", data) for path, data in patch_bundle.files())


def labels(
    target: Target, base_identity: str, patches: dict[str, str], content_hash: str, choice: vllmfrom.Choice | None = None
) -> dict[str, str]:
    oci = "org.opencontainers.image"
    candidate = (
        {} if target.candidate is None else {"io.sparkbuild.candidate": f"{target.candidate.ref}@{target.candidate.commit}"}
    )
    wheel = choice.wheel if choice is not None and choice.mode == "wheel" else None
    # A build from upstream's wheel: the wheel it installs, by name and sha256.
    vllm_from = {} if wheel is None else {"io.sparkbuild.vllm.wheel": f"{wheel.filename} sha256:{wheel.sha256}"}
    # The commit where the lock has it (upstream's wheel names only a short one: vllm/_version.py).
    unpinned = "unresolved" if wheel is None else f"not pinned (upstream wheel {wheel.filename})"
    return (
        candidate
        | vllm_from
        | {
            f"{oci}.title": f"vLLM {target.version} ({target.id})",
            f"{oci}.description": "vLLM built, patched and verified by sparkbuild",
            f"{oci}.version": target.version,
            f"{oci}.revision": target.vllm.spec if target.vllm.kind == "wheel" else (target.vllm.commit or unpinned),
            f"{oci}.source": target.vllm.repo or "https://github.com/vllm-project/vllm",
            # The image is built FROM the runtime base; the compile ran on the build base.
            f"{oci}.base.name": base_name(target.runtime_base, target.platform),
            "io.sparkbuild.build-base": base_name(target.base, target.platform),
            "io.sparkbuild.target": target.id,
            "io.sparkbuild.content-hash": content_hash,
            "io.sparkbuild.vllm.version": target.vllm.version,
            "io.sparkbuild.vllm.source": f"{target.vllm.kind}:{target.vllm.spec}",
            "io.sparkbuild.vllm.commit": "none (PyPI wheel)" if target.vllm.kind == "wheel" else (target.vllm.commit or unpinned),
            "io.sparkbuild.serve": shlex.join(target.serve.command()),
            "io.sparkbuild.patches": ",".join(target.patches),
            "io.sparkbuild.patch-hashes": ",".join(f"{n}={h[:16]}" for n, h in patches.items()),
            "io.sparkbuild.cuda": target.cuda or "none",
            "io.sparkbuild.torch": target.torch,
            "io.sparkbuild.arch-list": target.arch_list,
            "io.sparkbuild.gpu": target.gpu,
            "io.sparkbuild.base": base_identity,
            # The checks verify runs, in order.
            "io.sparkbuild.checks": ",".join(c.name for c in target.checks),
        }
    )


def base_name(base: matrix.Base, platform: str) -> str:
    """A base as a label shows it: the pinned image, or the made image's content-addressed name."""
    return base.image or base_recipe.reference(base, platform)[0]


def _check_tag_clash(plans: tuple[TargetPlan, ...]) -> None:
    owner: dict[tuple[str, str], str] = {}
    for p in plans:
        for tag in p.tags:
            key = (p.repository, tag)
            if key in owner:
                raise ConfigError(
                    f"{p.target.where}: readable tag {p.repository}:{tag} is claimed by {owner[key]} and {p.id}; "
                    "give one of them its own 'repository:' or 'tags:'"
                )
            owner[key] = p.id


# --- where pip finds torch -------------------------------------------------------------------


def torch_source(target: Target, opts: Options) -> tuple[dict[str, str], tuple[Path, ...]]:
    """Build args and local wheels that let pip find ``torch==<target.torch>``.

    ``torch_index`` is a folder of wheels, an index URL, or ``auto``: the folders in this host's pip
    configuration (``find-links``) when one holds the wheel, else the configured PyTorch CPU index.
    """
    choice = target.torch_index
    if choice == "pypi":
        return {}, ()  # pip's default index: PyPI (where the aarch64 torch >= 2.11 is a CUDA build)
    if target.profile == "spark":
        if choice == "auto":
            assert target.cuda is not None
            choice = f"https://download.pytorch.org/whl/cu{target.cuda.replace('.', '')}"
        return {"PIP_EXTRA_INDEX_URL": choice}, ()
    folders = _pip_find_links() if choice == "auto" else ([Path(choice)] if "://" not in choice else [])
    for folder in folders:
        wheel = _find_wheel(folder, target.torch, target.platform)
        if wheel is not None:
            return {"PIP_FIND_LINKS": "/wheels"}, (wheel,)
    if choice == "auto":
        return {"PIP_EXTRA_INDEX_URL": opts.torch_cpu_index}, ()
    if "://" in choice:
        return {"PIP_EXTRA_INDEX_URL": choice}, ()
    raise ConfigError(f"{target.where}: torch_index '{choice}' holds no torch {target.torch} wheel for {target.platform}")


def _find_wheel(folder: Path, version: str, platform: str) -> Path | None:
    machine = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}[platform]
    if not folder.is_dir():
        return None
    found = sorted(folder.glob(f"torch-{version}-*{machine}.whl"))
    return found[0] if found else None


def _pip_find_links() -> list[Path]:
    """``find-links`` folders from PIP_FIND_LINKS and pip's configuration files."""
    values = env("PIP_FIND_LINKS", "").split()
    files = [
        env("PIP_CONFIG_FILE", ""),
        "/etc/pip.conf",
        "/etc/xdg/pip/pip.conf",
        str(Path.home() / ".config/pip/pip.conf"),
        str(Path.home() / ".pip/pip.conf"),
    ]
    for name in files:
        if not name or not Path(name).is_file():
            continue
        parser = configparser.ConfigParser()
        parser.read(name)
        for section in ("global", "install"):
            values.extend(parser.get(section, "find-links", fallback="").split())
    return [Path(v.removeprefix("file://")) for v in values if "://" not in v or v.startswith("file://")]
