"""Build stage: base images, then each stage image of a planned target, reusing what exists.

Stage images are content-addressed (``sparkbuild/stages:<stage>-<hash>``). A stage already in the
engine is reused; one in the registry is pulled (another runner built it); otherwise it is built
and pushed, so the next runner reuses it. The last stage is the target's image. A stage that is
built reads, and writes, BuildKit's cache in the registry where the builder can (``buildcache``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from sparkbuild.build import base_image, binaries, buildcache, preflight
from sparkbuild.config.options import Options
from sparkbuild.errors import BuildError, ConfigError, SourceError
from sparkbuild.oci import push
from sparkbuild.oci.engine import Bound, Engine
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import render
from sparkbuild.plan.plan import STAGE_REPOSITORY, StagePlan, TargetPlan, base_platform, bases
from sparkbuild.util import fsutil, kept, log

# Under the cache: check-binary's reports of a built image, by its id (``check_binaries``).
KEPT_CHECK_BINARY = "check-binary"

Action = Literal["built", "reused", "pulled"]


@dataclass(frozen=True, kw_only=True)
class StageOutcome:
    name: str
    ref: str
    action: Action
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {"stage": self.name, "ref": self.ref, "action": self.action, "seconds": round(self.seconds, 1)}


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    image: str
    stages: tuple[StageOutcome, ...]
    # The preflight of the vLLM stage, where this build compiled it (a Spark target).
    preflight: preflight.Report | None = None
    # check-binary of vLLM's extensions in the image, where it holds real ones (a Spark target).
    binaries: tuple[binaries.FileReport, ...] | None = None

    def summary(self) -> str:
        return ", ".join(f"{s.name} {s.action}" for s in self.stages)


def write_context(plan: TargetPlan, stage: StagePlan, folder: Path, root: Path) -> Path:
    """Lay out one stage's build context under ``root``: Dockerfile, the files it uses, the manifest, local wheels."""
    if folder.exists() or folder.is_symlink():
        fsutil.remove_tree(folder, root)
    (folder / "wheels").mkdir(parents=True)
    (folder / "Dockerfile").write_text(stage.rendered.dockerfile, encoding="utf-8")
    for name, content in stage.rendered.files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    if stage.final:
        (folder / "sparkbuild-manifest.json").write_text(json.dumps(plan.manifest(), indent=2, sort_keys=True) + "\n")
    for wheel in plan.wheel_files:
        try:
            os.link(wheel, folder / "wheels" / wheel.name)
        except OSError:  # another file system: a copy is the same bytes
            shutil.copy2(wheel, folder / "wheels" / wheel.name)
    return folder


def write_contexts(plan: TargetPlan, folder: Path) -> list[Path]:
    """Every stage's context under ``folder/NN-<stage>/`` (what ``sparkbuild render`` writes)."""
    return [write_context(plan, s, folder / f"{i:02d}-{s.name}", folder) for i, s in enumerate(plan.stages, 1)]


def require_resolved(plan: TargetPlan) -> None:
    if plan.unresolved:
        raise ConfigError(
            f"{plan.target.where}: {', '.join(plan.unresolved)} not pinned to a commit or digest; "
            "run `sparkbuild resolve` (it writes the lock file the build reads), or add 'commit:' in the matrix "
            "(`git ls-remote REPO REF` prints it)"
        )


def ensure_bases(engine: Engine, plan: TargetPlan, opts: Options) -> None:
    """Every base the target's stages use, each for the platform its stages run on (``base_platform``)."""
    target = plan.target
    for base, platform in dict.fromkeys((b, base_platform(target, role)) for role, b in bases(target).items()):
        base_image.ensure(engine, base, platform, opts.cache / "rootfs")


def build(
    engine: Engine, plan: TargetPlan, opts: Options, registry: Registry | None = None, *, check_first: bool = True
) -> BuildResult:
    """Build the target's stages into the engine; returns its image reference and what each stage did.

    A Spark target's vLLM stage is preflighted before its compile (``check_first``; a lane runs the
    preflight as a stage of its own and passes False).
    """
    require_resolved(plan)
    ensure_bases(engine, plan, opts)
    if plan.jobs is not None:
        log.info(f"build jobs: {plan.jobs.text()}")
    log.info(f"build cache: {cache_choice(engine, opts, registry).text()}")
    report = None
    if check_first and (stage := preflighted_stage(plan)) is not None and not is_present(engine, registry, stage):
        report = run_preflight(engine, plan, opts)
        report.require()
    outcomes = [ensure_stage(engine, registry, plan, stage, opts) for stage in plan.stages]
    checked = None
    if plan.target.profile == "spark":
        if real_kernels(plan):
            checked = check_binaries(
                engine, plan.local_ref, plan.target.gpu, opts.out / plan.id, kept_in=opts.cache / KEPT_CHECK_BINARY
            )
        else:
            log.info(f"{plan.id}: rehearsal: no compiled extensions in the image; preflight checked the patched units")
    result = BuildResult(image=plan.local_ref, stages=tuple(outcomes), preflight=report, binaries=checked)
    out = opts.out / plan.id
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.json").write_text(json.dumps([s.to_json() for s in outcomes], indent=2) + "\n")
    log.info(f"{plan.id}: {result.summary()}")
    return result


def real_kernels(plan: TargetPlan) -> bool:
    """Whether the image holds vLLM's real compiled extensions: a full compile, or upstream's wheel
    (a rehearsal too: the same kernels, for this machine's platform)."""
    wheel = plan.choice is not None and plan.choice.mode == "wheel"
    return plan.target.profile == "spark" and (plan.target.compile == "full" or wheel)


def ensure_stage(engine: Engine, registry: Registry | None, plan: TargetPlan, stage: StagePlan, opts: Options) -> StageOutcome:
    start = time.monotonic()
    action: Action = "built"
    in_registry = not stage.final and registry is not None and registry.digest(STAGE_REPOSITORY, _tag(stage)) is not None
    if engine.image_exists(stage.ref):
        log.info(f"stage {stage.name}: {stage.ref} is in the engine; reused")
        action = "reused"
    elif in_registry:
        assert registry is not None
        push.pull_as(engine, registry, STAGE_REPOSITORY, _tag(stage), plan.target.platform)
        action = "pulled"
    else:
        build_stage(engine, plan, stage, opts, registry)
    if not stage.final and registry is not None and not in_registry:
        # Built here, or made by an earlier run without a registry: share it with other runners.
        push.push_as(engine, registry, stage.ref, f"{registry.host}/{STAGE_REPOSITORY}", _tag(stage))
        if action == "built" and cache_choice(engine, opts, registry).mode is buildcache.Mode.INLINE:
            share_inline_cache(engine, registry, plan, stage)
    return StageOutcome(name=stage.name, ref=stage.ref, action=action, seconds=time.monotonic() - start)


def cache_choice(engine: Engine, opts: Options, registry: Registry | None) -> buildcache.Choice:
    return buildcache.choose(opts.build_cache, engine.cli.builder, registry is not None)


def cache_flags(engine: Engine, opts: Options, registry: Registry | None, plan: TargetPlan, stage: StagePlan) -> tuple[str, ...]:
    """The build cache's flags for one stage; none without a registry (the cache lives there)."""
    if registry is None:
        return ()
    return buildcache.stage_flags(cache_choice(engine, opts, registry).mode, registry.host, plan, stage)


def share_inline_cache(engine: Engine, registry: Registry, plan: TargetPlan, stage: StagePlan) -> None:
    """Move the stage's cache tag to the image just pushed (it carries BuildKit's inline cache), so
    the next build of this stage, here or on another runner, starts from its layers. The registry
    already has every layer: the engine mounts them from the stage repository, uploads none."""
    repository, cache_tag = buildcache.ref(registry.host, plan.id, stage.name).rsplit(":", 1)
    push.push_as(engine, registry, stage.ref, repository, cache_tag)


def _tag(stage: StagePlan) -> str:
    return stage.ref.rsplit(":", 1)[1]


def is_present(engine: Engine, registry: Registry | None, stage: StagePlan) -> bool:
    """Built already: in the engine, or in the registry for another runner's build."""
    if engine.image_exists(stage.ref):
        return True
    return registry is not None and registry.digest(STAGE_REPOSITORY, _tag(stage)) is not None


# --- preflight: the vLLM stage's configure and patched units, before its compile -----------------

PREFLIGHT_TARGET = "preflight-report"


def preflighted_stage(plan: TargetPlan) -> StagePlan | None:
    """The stage whose Dockerfile has a preflight target (the Spark vLLM stage); None elsewhere."""
    return next((s for s in plan.stages if f" AS {PREFLIGHT_TARGET}" in s.rendered.dockerfile), None)


def run_preflight(engine: Engine, plan: TargetPlan, opts: Options, measure: str = "") -> preflight.Report:
    """Build the vLLM stage up to its preflight target, export what it found, audit it (``require()``
    on the report raises on a failure, naming the units). ``measure``: a regular expression naming
    configured units to compile too, each measured (bench/compile_memory.py)."""
    stage = preflighted_stage(plan)
    if stage is None:
        raise ConfigError(f"{plan.id}: no stage of profile '{plan.target.profile}' has a {PREFLIGHT_TARGET} target")
    require_resolved(plan)
    ensure_bases(engine, plan, opts)
    folder = opts.out / plan.id / "preflight"
    shutil.rmtree(folder, ignore_errors=True)
    context = write_context(plan, stage, opts.cache / "contexts" / plan.id / stage.name, opts.cache / "contexts")
    with log.step(f"Preflight of {plan.id}: vLLM's configure for {plan.target.arch_list}, patched units compiled"):
        engine.build(
            context=context,
            tag=f"{stage.ref}-preflight",
            platform=plan.target.platform,
            labels={},
            build_args={**plan.build_args(), **({"SPARKBUILD_PREFLIGHT_MEASURE": measure} if measure else {})},
            secrets=_secrets(opts, plan),
            log_file=opts.out / plan.id / "build-preflight.log",
            target=PREFLIGHT_TARGET,
            output=folder,
            bound=bound(plan),
        )
    report = preflight.read(folder, plan.id, plan.target.gpu)
    preflight.save(report, folder)
    return report


def bound(plan: TargetPlan) -> Bound:
    """How long each of the target's stage builds may take (the matrix's ``build_timeout_minutes``)."""
    minutes = plan.target.build_timeout_minutes
    return Bound(minutes * 60, f"build_timeout_minutes: {minutes} for {plan.id}, {plan.target.where}")


def _secrets(opts: Options, plan: TargetPlan) -> dict[str, Path]:
    """The build's secrets: pip's CA bundle, and where the source stages fetch from (``git-insteadof``)."""
    secrets = {"pip-ca": opts.ca_bundle} if opts.ca_bundle and opts.ca_bundle.is_file() else {}
    if not secrets:
        log.info(f"no CA bundle at {opts.ca_bundle}: pip in the build uses the image's own certificates")
    if plan.git_insteadof:
        # Beside the target's logs, never in a build context (a secret is in no layer either).
        path = opts.out / plan.id / "git-insteadof"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plan.git_insteadof, encoding="utf-8")
        secrets["git-insteadof"] = path
    return secrets


def stage_args(plan: TargetPlan, stage: StagePlan, registry: Registry | None) -> dict[str, str]:
    """Earlier stages by their registry-qualified name, so any BuildKit builder can pull them
    (the Dockerfile's defaults are the local names, which only the docker driver's store holds)."""
    if registry is None:
        return {}
    refs = {s.name: s.ref for s in plan.stages}
    return {render.stage_arg(n): f"{registry.host}/{refs[n]}" for n in stage.rendered.needs}


def build_stage(
    engine: Engine,
    plan: TargetPlan,
    stage: StagePlan,
    opts: Options,
    registry: Registry | None = None,
    *,
    apart: Apart | None = None,
) -> None:
    """Build one stage into the engine as its content-addressed reference, or with ``apart`` as
    that build's own tag, without BuildKit's layer cache."""
    context = write_context(plan, stage, opts.cache / "contexts" / plan.id / stage.name, opts.cache / "contexts")
    labels = plan.labels if stage.final else {"io.sparkbuild.stage": stage.name, "io.sparkbuild.content-hash": stage.content_hash}
    tag = stage.ref if apart is None else apart.tags[stage.name]
    args = {**plan.build_args(), **stage_args(plan, stage, registry)}
    if apart is not None:
        args.update(apart.stage_args(stage))
    log_file = (opts.out / plan.id if apart is None else apart.logs) / f"build-{stage.name}.log"
    with log.step(f"Building stage {stage.name} of {plan.id}{'' if apart is None else ' without cache'}: {tag}"):
        try:
            engine.build(
                context=context,
                tag=tag,
                platform=plan.target.platform,
                labels=labels,
                build_args=args,
                secrets=_secrets(opts, plan),
                log_file=log_file,
                cache=cache_flags(engine, opts, registry, plan, stage),
                no_cache=apart is not None,
                hosts=apart.hosts if apart is not None else {},
                bound=bound(plan),
            )
        except BuildError as exc:
            mismatch = wheel_mismatch(log_file)
            if mismatch is not None:
                raise SourceError(_mismatch_report(mismatch, plan, log_file)) from exc
            failed = compile_failures(log_file)
            if not failed:
                raise
            raise BuildError(_compile_report(failed, opts.out / plan.id, stage.name, log_file)) from exc


# --- a build apart: every stage anew, under tags of its own (sparkbuild reproduce) -------------------


@dataclass(frozen=True, kw_only=True)
class Apart:
    """A build of every stage of a target anew: BuildKit's layer cache off (``--no-cache``, which
    also gives every cache mount, pip's, apt's and ccache's, as a new empty one), each stage tagged
    ``tags[stage]`` and never its content-addressed reference, a later stage built FROM these (its
    stage arguments). The bases are inputs, made once by their content.

    Every RUN step also gets a host name of this build's own (``marker``): without it, BuildKit runs
    a step once for every build that asks for the same step while it is held in its solver, with or
    without cache (two builds at once, or one kept alive by a third build of the same step), and two
    builds would get one result. The name is in /etc/hosts during the step only, not in the image."""

    # Each stage built, with its tag; a stage's earlier stages must be among them.
    tags: Mapping[str, str]
    logs: Path
    marker: str

    @property
    def hosts(self) -> dict[str, str]:
        return {f"sparkbuild-reproduce-{self.marker}": "127.0.0.1"}

    def stage_args(self, stage: StagePlan) -> dict[str, str]:
        """The earlier stages ``stage`` is built FROM: this build's."""
        return {render.stage_arg(n): self.tags[n] for n in stage.rendered.needs}


def build_apart(engine: Engine, plan: TargetPlan, opts: Options, apart: Apart) -> tuple[StageOutcome, ...]:
    """Build each stage of ``plan`` that ``apart`` tags, anew (``Apart``); the content-addressed images
    are neither made nor moved."""
    require_resolved(plan)
    ensure_bases(engine, plan, opts)
    outcomes = []
    for stage in (s for s in plan.stages if s.name in apart.tags):
        start = time.monotonic()
        build_stage(engine, plan, stage, opts, apart=apart)
        outcomes.append(
            StageOutcome(name=stage.name, ref=apart.tags[stage.name], action="built", seconds=time.monotonic() - start)
        )
    return tuple(outcomes)


# --- upstream's wheel whose sha256 is not the lock's ----------------------------------------------

WHEEL_MARK = "sparkbuild-wheel: sha256 mismatch "


def wheel_mismatch(log_file: Path) -> dict[str, str] | None:
    """What the vllm stage's pip found when the wheel it downloaded was not the one the lock pins
    (``vllm_wheel.py`` prints it): the file, the sha256 pinned and the one it got."""
    if not log_file.is_file():
        return None
    for line in log_file.read_text(encoding="utf-8", errors="replace").splitlines():
        line = _BUILDKIT_PREFIX.sub("", line)
        if line.startswith(WHEEL_MARK):
            words = line[len(WHEEL_MARK) :].split()
            if len(words) == 5 and words[1] == "expected" and words[3] == "got":
                return {"file": words[0], "expected": words[2], "got": words[4]}
    return None


def _mismatch_report(found: dict[str, str], plan: TargetPlan, log_file: Path) -> str:
    url = plan.source_args.get("VLLM_WHEEL_URL", "its URL")
    return (
        f"{plan.id}: upstream's wheel {found['file']} from {url} has sha256 {found['got']}, and the lock pins "
        f"{found['expected']} (pip's --require-hashes refused it): nothing was patched or built from it. The index serves "
        f"another file than the one resolved, or the lock was edited: run `sparkbuild resolve` to pin the file the index "
        f"serves now (check-binary judges it again). Log: {log_file}"
    )


# --- a failed compile: every unit that failed, with its first error --------------------------------

COMPILE_MARK = "sparkbuild-compile: json "
_BUILDKIT_PREFIX = re.compile(r"^#\d+ \d+(?:\.\d+)? ")


def compile_failures(log_file: Path) -> list[dict[str, str]]:
    """The units the stage's compile report (``compile_report.py``, printed in the build) names."""
    if not log_file.is_file():
        return []
    found: list[dict[str, str]] = []
    for line in log_file.read_text(encoding="utf-8", errors="replace").splitlines():
        line = _BUILDKIT_PREFIX.sub("", line)
        if line.startswith(COMPILE_MARK):
            found = json.loads(line[len(COMPILE_MARK) :])
    return found


def _compile_report(failed: list[dict[str, str]], out: Path, stage: str, log_file: Path) -> str:
    """Write ``compile-failures.json``/``.txt`` beside the stage's log; the error's text."""
    lines = [f"{f['unit']}: {f['error'] or '(no error line; see the log)'}" for f in failed]
    (out / "compile-failures.json").write_text(json.dumps(failed, indent=2) + "\n", encoding="utf-8")
    (out / "compile-failures.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    shown = "\n  ".join(lines[:20]) + (f"\n  ... {len(lines) - 20} more" if len(lines) > 20 else "")
    return (
        f"stage {stage}: {len(failed)} unit(s) failed to compile (every other unit compiled and is in ccache, so the "
        f"rerun after a fix compiles only what changed):\n  {shown}\nlist: {out / 'compile-failures.txt'}; full log: {log_file}"
    )


def check_binaries(
    engine: Engine, image: str, gpu: str, out: Path, *, kept_in: Path | None = None
) -> tuple[binaries.FileReport, ...]:
    """Run check-binary on vLLM's compiled extensions in the image, for the GPU the image is for.

    The image's build-time check wrote where vLLM is installed (``installed.json``). With ``kept_in`` (a
    folder, sparkbuild.util.kept), the reports are kept there by the image's id, the GPU and
    check-binary's rules, and an image checked before (a rehearsal or lane run again on an image that
    did not change) is not copied out and read again.
    """
    device = binaries.Arch.parse(gpu)
    key = f"{str(engine.inspect(image)['Id']).removeprefix('sha256:')}-{gpu}-{binaries.rules()}"
    found = None if kept_in is None else kept.read(kept_in, key)
    if found is not None:
        log.info(f"check-binary of {image} for GPU {gpu}: its reports kept for this image id and check-binary ({kept_in}/{key})")
        reports = binaries.from_kept(found, device)
    else:
        reports = _check_image_binaries(engine, image, device)
        if kept_in is not None:
            kept.write(kept_in, key, binaries.kept_json(reports))
    shown = binaries.table(reports, device)
    log.info(shown)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check-binary.txt").write_text(shown + "\n")
    binaries.require(reports, device)
    return reports


def _check_image_binaries(engine: Engine, image: str, device: binaries.Arch) -> tuple[binaries.FileReport, ...]:
    with tempfile.TemporaryDirectory() as tmp:
        info = engine.copy_out(image, "/opt/sparkbuild/installed.json", Path(tmp))
        vllm_path = json.loads(info.read_text())["vllm_path"]
        folder = engine.copy_out(image, vllm_path, Path(tmp) / "image")
        # Each library named by its path in the image, not in this copy of it.
        return tuple(replace(r, path=Path(vllm_path) / r.path.relative_to(folder)) for r in binaries.check([folder], device))
