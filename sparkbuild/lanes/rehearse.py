"""``sparkbuild rehearse``: build a Spark target's stages here, for real, in minutes instead of hours.

The Spark templates themselves are built with BuildKit: the source stage (pinned commits from a git
remote, the real patch engine), FlashInfer (its real wheel), vLLM, and the runtime stage with its
real requirements and image checks. What a rehearsal swaps, each listed in its report (``swapped``):

- the platform: this machine's (no emulation), for the target's linux/arm64;
- the bases: each NVIDIA image for a base made here (``rehearsal: bases:``; Debian trixie with
  CUDA from NVIDIA's PyPI wheels: Python 3.13 and GCC 14, where the runner's Ubuntu 24.04 has 3.12
  and 13);
- in the templates: vLLM's kernel compile (preflight runs vLLM's own configure, audited for the
  target GPU, and compiles the patched units; the wheel is Python-only), FlashInfer's AOT modules
  where the target asks for them, FlashInfer's cubin download, and the binary check;
- a target built from upstream's wheel (``vllm_from``: sparkbuild.plan.vllmfrom) keeps its kernels:
  the rehearsal pins upstream's wheel of the release for this machine's platform (the x86_64 wheel
  for the aarch64 one: the same kernels, built by upstream for another CPU), judged by check-binary
  for the target's GPU, and builds from it; the image holds vLLM's real compiled extensions, which its
  check imports, and check-binary runs on them (``kernels: real``; a source build's are ``swapped``);
- with ``--offline``: each source GitHub alone has, for a marked stand-in (``sparkbuild.lanes.offline``):
  CUTLASS (the headers of FlashInfer's sdist, another version than the pinned one) and every
  project vLLM's CMake clones;
- the requirements ``rehearsal: relax:`` names.

Then, in an image built from upstream's wheel, vLLM's own start-up for each check the target names, with
the GPU faked as a GB10 (``sparkbuild.verify.startup``, docs/startup.md: what is faked, exactly), judged
by the kernel-path gate: a check that fails it fails the rehearsal.

A target that cannot be rehearsed here (no stand-in for a base, a torch index this machine cannot
reach) is reported as not rehearsable, with the reason, and the others go on.
"""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import requests

from sparkbuild.build import build, closure, preflight
from sparkbuild.config.options import Options
from sparkbuild.errors import FatalError
from sparkbuild.lanes import offline, upstream_wheel
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import lock, plan, vllmfrom
from sparkbuild.plan.matrix import Base, Matrix, Target
from sparkbuild.upstream import gitrepo, sources
from sparkbuild.util import host, log
from sparkbuild.verify import startup

REPOSITORY = "sparkbuild/rehearsal"


class NotRehearsable(Exception):
    """What this machine lacks to rehearse a target (a stand-in base, a reachable torch index);
    the target's row says so and the others go on (not a FatalError: it fails nothing)."""


def rehearsal_target(target: Target, m: Matrix) -> Target:
    """``target`` as the rehearsal builds it: this platform, bases made here, vLLM's compile swapped."""

    def swap(base: Base) -> Base:
        if base.image is None:
            return base  # made here already
        if base.name not in m.rehearsal.bases:
            raise NotRehearsable(
                f"{m.file}: rehearsal: bases: has no stand-in for '{base.name}' ({base.image}), which "
                f"{target.id} uses; map it to a base made here, e.g. `{base.name}: trixie-cuda-13.0-devel`"
            )
        return m.rehearsal.bases[base.name]

    return replace(
        target,
        platform=m.rehearsal.platform or host.build_platform(target.platform),
        base=swap(target.base),
        source_base=swap(target.source_base),
        runtime_base=swap(target.runtime_base),
        ptxas_base=swap(target.ptxas_base),
        compile="rehearse",
        relax=m.rehearsal.relax,
        repository=REPOSITORY,
    )


def describe_base(base: Base) -> str:
    """What a base is, in the words the swap list uses."""
    if base.image is not None:
        facts = [f"Python {base.python}" if base.python else "", f"glibc {base.glibc}" if base.glibc else ""]
        shown = ", ".join(f for f in facts if f)
        return base.image.split("@")[0] + (f" ({shown})" if shown else "")
    if base.cuda_wheels is not None:
        w = base.cuda_wheels
        return f"{base.name}: CUDA {w.toolkit} {w.flavor} from NVIDIA's PyPI wheels on {describe_base(w.base)}"
    if base.debootstrap is not None:
        return f"{base.name}: Debian {base.debootstrap.suite} made with debootstrap"
    return base.name


def swapped(target: Target, rehearsed: Target, choice: vllmfrom.Choice | None = None) -> list[str]:
    """Everything the rehearsal builds differently from the runner, one line each (sources come later)."""
    wheel = choice.wheel if choice is not None and choice.mode == "wheel" else None
    lines: list[str] = []
    # The runner's own platform is no swap (the report's `platform` says where it ran emulated).
    if rehearsed.platform != target.platform:
        line = f"platform: {target.platform} -> {rehearsed.platform} (this machine's, no emulation)"
        if wheel is not None:
            machine = upstream_wheel.MACHINES.get(target.platform, target.platform)
            line += (
                f": upstream's {wheel.filename} for its {machine} wheel of vLLM {target.vllm.version}, "
                "the same kernels built for another CPU"
            )
        lines.append(line)
    seen: set[str] = set()
    for role in ("base", "runtime_base", "ptxas_base", "source_base"):
        before, after = getattr(target, role), getattr(rehearsed, role)
        if before != after and before.name not in seen:
            seen.add(before.name)
            lines.append(f"base {before.name}: {describe_base(before)} -> {describe_base(after)}")
    if wheel is None:
        lines.append(
            "template vllm: the kernel compile -> preflight (vLLM's configure, the audit, the patched units "
            "compiled) and a Python-only wheel (VLLM_TARGET_DEVICE=empty)"
        )
    if target.flashinfer is not None and target.flashinfer_aot:
        lines.append("template flashinfer: the AOT modules (flashinfer-jit-cache) -> not compiled")
    if wheel is None:
        lines.append("build: check-binary of vLLM's extensions -> not run (none compiled)")
    else:
        lines.append(
            "template runtime: the CUDA driver vLLM's extensions link -> the build base's stub libcuda.so "
            "(made from cuda.h here; the runner's is NVIDIA's), for the import check only"
        )
    return lines


@dataclass
class Rehearsal:
    target: str
    status: str = "pending"
    image: str | None = None
    stages: tuple[build.StageOutcome, ...] = ()
    closure: closure.Closure | None = None
    preflight: preflight.Report | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    sources: str = ""
    relaxed: tuple[str, ...] = ()
    swapped: list[str] = field(default_factory=list)
    # "real": the image holds vLLM's compiled extensions (upstream's wheel); "swapped": a Python-only wheel.
    kernels: str | None = None
    # The platform the image was built for, and whether its steps ran emulated (QEMU) here.
    platform: dict[str, Any] | None = None
    vllm_from: vllmfrom.Choice | None = None
    check_binary: dict[str, Any] | None = None
    # vLLM's own start-up for each check the target names, a GB10 faked (sparkbuild.verify.startup).
    startup: startup.Startup | None = None
    # Checks whose start-up was not predicted here, with why (a model only the runner downloads).
    not_predicted: dict[str, str] = field(default_factory=dict)
    # Why this machine cannot rehearse the target (None: it can).
    not_rehearsable: str | None = None
    error: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "status": self.status,
            "image": self.image,
            "stages": [s.to_json() for s in self.stages],
            "closure": self.closure.to_json() if self.closure else None,
            "preflight": self.preflight.to_json() if self.preflight else None,
            "checks": self.checks,
            "sources": self.sources,
            "relaxed": list(self.relaxed),
            "swapped": self.swapped,
            "kernels": self.kernels,
            "platform": self.platform,
            "vllm_from": None if self.vllm_from is None else self.vllm_from.to_json(),
            "check_binary": self.check_binary,
            "startup": None if self.startup is None else self.startup.to_json(),
            "not_predicted": self.not_predicted,
            "not_rehearsable": self.not_rehearsable,
            "error": self.error,
            "seconds": round(self.seconds, 1),
        }


def rehearsable(m: Matrix, opts: Options) -> tuple[Target, ...]:
    """The selected targets a rehearsal builds: the Spark ones with a vLLM version (not a candidate)."""
    return plan.select(tuple(t for t in m.targets if t.profile == "spark" and t.vllm.kind != "candidate"), opts.only, None)


def pins_of(opts: Options) -> lock.Lock:
    """The lock's pins (none where there is no lock file yet)."""
    path = opts.lock or lock.default_path(opts.matrix)
    return lock.read(path) if path.is_file() else lock.Lock()


def rehearse(opts: Options, *, offline_sources: bool) -> list[Rehearsal]:
    """Rehearse every selected Spark target; every target is tried, failures are reported per target."""
    m = plan.load_matrix(opts)
    pins = pins_of(opts)
    targets = rehearsable(m, opts)
    results = [Rehearsal(target=t.id) for t in targets]
    engine = Engine()
    with ExitStack() as stack:
        url = stack.enter_context(gitrepo.daemon(opts.cache / "offline")) if offline_sources else None
        for target, result in zip(targets, results, strict=True):
            with log.step(f"Rehearsing {target.id}"):
                _one(engine, m, pins, target, opts, url, result)
    return results


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A target as the rehearsal builds it: the target swapped (``rehearsal_target``, upstream's wheel
    for this platform where it may use one, offline sources applied), where its vLLM comes from, what
    was swapped, and where its sources come from."""

    target: Target
    choice: vllmfrom.Choice | None
    swapped: list[str]
    sources: str = ""

    @property
    def wheel_mode(self) -> bool:
        return self.choice is not None and self.choice.mode == "wheel"


def prepare(m: Matrix, target: Target, opts: Options, url: str | None, pins: lock.Lock | None = None) -> Prepared:
    """``target`` made ready to rehearse (NotRehearsable where this machine cannot): upstream's wheel
    for this platform pinned where the target may build from it; with ``url`` (the git daemon's) its
    sources are the offline ones, fetched into the cache."""
    rehearsed = rehearsal_target(target, m)
    _require_torch_index(rehearsed)
    wheel = rehearsal_wheel(target, rehearsed, m, pins_of(opts) if pins is None else pins, opts)
    rehearsed = replace(rehearsed, wheel=wheel)
    choice = plan.choice_of(rehearsed, m.patch_folders)
    prepared = Prepared(target=rehearsed, choice=choice, swapped=swapped(target, rehearsed, choice))
    if url is None:
        return prepared
    found = offline.prepare(rehearsed, opts.cache)
    described = offline.describe(found)
    log.info(described)
    # A build from the wheel fetches no vLLM, CUTLASS or external project: nothing of theirs is swapped.
    lines = prepared.swapped + ([] if prepared.wheel_mode else offline.swapped(found, target))
    return replace(prepared, target=found.apply(rehearsed), swapped=lines, sources=described)


def plan_of(prepared: Prepared, m: Matrix, opts: Options, url: str | None) -> plan.TargetPlan:
    """The plan of a prepared target; with ``url``, its source stages fetch from the git daemon."""
    p = plan.plan_target(prepared.target, m.patch_folders, opts)
    if url is not None:
        # The daemon's address: where the source stages fetch from; a secret, so in no hash or cache key.
        p = replace(p, git_insteadof=f"{url}/={offline.URL}/")
    return p


def _one(engine: Engine, m: Matrix, pins: lock.Lock, target: Target, opts: Options, url: str | None, result: Rehearsal) -> None:
    start = time.monotonic()
    try:
        try:
            result.status = "pinning"
            prepared = prepare(m, target, opts, url, pins)
        except NotRehearsable as exc:
            result.status, result.not_rehearsable = "not rehearsable", str(exc)
            log.warning(f"{target.id}: not rehearsable here: {exc}")
            return
        rehearsed = prepared.target
        result.vllm_from, result.kernels = prepared.choice, "real" if prepared.wheel_mode else "swapped"
        result.relaxed = rehearsed.relax
        result.platform = {"name": rehearsed.platform, "emulated": host.emulated(rehearsed.platform)}
        result.swapped, result.sources = prepared.swapped, prepared.sources
        # The closure of the image as the runner builds it (its platform and runtime base), with
        # this machine's relaxed pins.
        result.status = "closure"
        tree = sources.vllm_sdist(target.vllm.version, opts.cache)
        result.closure = closure.check(replace(target, relax=rehearsed.relax), tree, opts)
        closure.log_closure(result.closure)
        closure.require(result.closure)
        p = plan_of(prepared, m, opts, url)
        if build.preflighted_stage(p) is not None:
            result.status = "preflight"
            result.preflight = build.run_preflight(engine, p, opts)
            result.preflight.require()
        result.status = "building"
        outcome = build.build(engine, p, opts, check_first=False)
        result.image, result.stages = outcome.image, outcome.stages
        if outcome.binaries is not None:
            result.check_binary = _binaries_summary(outcome.binaries)
        result.checks = _image_checks(engine, outcome.image)
        result.status = "start-up"
        _startup(engine, rehearsed, outcome.image, opts, result)
        result.status = "rehearsed"
    except FatalError as exc:
        result.status, result.error = f"failed ({result.status})", str(exc)
        log.error(f"{target.id}: {exc}")
    finally:
        result.seconds = time.monotonic() - start


def rehearsal_wheel(target: Target, rehearsed: Target, m: Matrix, pins: lock.Lock, opts: Options) -> lock.WheelPin | None:
    """Upstream's wheel of the target's release for this machine's platform, where the target may
    build from a wheel: the lock's pin when it has one for this platform, else pinned here for real
    (the index, the download checked by sha256, check-binary for the target's GPU)."""
    if target.vllm.kind != "version" or target.vllm_from == "source":
        return None
    if vllmfrom.compiled_changes(target.patches, m.patch_folders):
        return None  # a patch needs the compile: no wheel to pin (the plan says which patch)
    found = pins.wheel(target.vllm.version, rehearsed.platform)
    if found is not None:
        log.info(f"{target.id}: upstream's wheel for {rehearsed.platform} as the lock pins it: {found.filename or found.missing}")
        return found
    base = rehearsed.runtime_base
    if base.python is None or base.glibc is None:
        raise NotRehearsable(f"the rehearsal's runtime base {base.name} says no python: or glibc: to choose a wheel for")
    with log.step(f"Upstream's vLLM {target.vllm.version} wheel for {rehearsed.platform} (the rehearsal's platform)"):
        return upstream_wheel.pin(
            target.vllm.version, rehearsed.platform, (target.gpu,), python=base.python, glibc=base.glibc, cache=opts.cache
        )


def _binaries_summary(reports: tuple[Any, ...]) -> dict[str, Any]:
    """check-binary of the image's extensions, per library: its verdict and counts."""
    libraries = [
        {"path": str(r.path), "ok": r.ok, "kernels": len(r.kernels), "counts": r.counts()} for r in reports if r.ok is not None
    ]
    return {"ok": all(lib["ok"] for lib in libraries) and bool(libraries), "libraries": libraries}


def _require_torch_index(target: Target) -> None:
    """A rehearsal installs torch for real: say at once when its index cannot be reached from here."""
    args, _ = plan.torch_source(target, Options.from_env())
    index = args.get("PIP_EXTRA_INDEX_URL")
    if not index:
        return
    try:
        requests.head(index.rstrip("/") + "/torch/", timeout=10, allow_redirects=True)
    except requests.RequestException as exc:
        raise NotRehearsable(
            f"{target.id} installs torch {target.torch} from {index}, which this machine cannot reach ({type(exc).__name__}); "
            "rehearse it where that index answers, or give the target a torch that PyPI serves (torch_index: pypi)"
        ) from None


def _startup(engine: Engine, rehearsed: Target, image: str, opts: Options, result: Rehearsal) -> None:
    """vLLM's own start-up for each check the target names, in the rehearsed image with a GB10 faked
    (the build base's stub driver); the kernel-path gate judges it, and a check that fails it fails
    the rehearsal, naming the check, the kind and the backend."""
    predicted = []
    for check in rehearsed.checks:
        if result.kernels != "real":
            # vLLM's selectors ask its compiled ops what they support: without them they would judge
            # another image than the runner's.
            result.not_predicted[check.name] = "the rehearsal swapped vLLM's kernel compile: its image has no compiled ops to ask"
        elif check.hub is not None:
            result.not_predicted[check.name] = f"its model ({check.hub.id}) is downloaded from the Hub on the runner"
        elif why := startup.unpredictable(check):
            result.not_predicted[check.name] = why
        else:
            predicted.append(check)
    if not predicted:
        return
    result.startup = startup.on_gb10(engine, image, rehearsed, predicted, opts.cache)
    result.startup.require()


def _image_checks(engine: Engine, image: str) -> dict[str, Any]:
    """What the runtime stage's image check found (it fails the build on any problem)."""
    with tempfile.TemporaryDirectory() as tmp:
        found = engine.copy_out(image, "/opt/sparkbuild/installed.json", Path(tmp))
        data: dict[str, Any] = json.loads(found.read_text(encoding="utf-8"))
    return data


def table(results: list[Rehearsal]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.target}: {r.status} in {log.format_seconds(r.seconds)}")
        if r.not_rehearsable:
            lines.append(f"  not rehearsable here: {r.not_rehearsable}")
        if r.swapped:
            lines.append("  SWAPPED (the runner builds these as the matrix says):")
            lines += [f"    {line}" for line in r.swapped]
        if r.sources:
            lines += ["  " + line for line in r.sources.splitlines()]
        if r.vllm_from is not None:
            lines.append(f"  vllm from: {r.vllm_from.text()}; kernels: {r.kernels}")
        if r.check_binary is not None:
            verdict = "passes" if r.check_binary["ok"] else "FAILS"
            count = len(r.check_binary["libraries"])
            lines.append(f"  check-binary of the image's extensions: {verdict} ({count} libraries with GPU code)")
        if r.relaxed:
            lines.append(f"  RELAXED for this machine's package index (the runner installs vLLM's pins): {', '.join(r.relaxed)}")
        if r.stages:
            lines.append("  stages: " + ", ".join(f"{s.name} {s.action} ({s.seconds:.0f}s)" for s in r.stages))
        if r.closure:
            lines += ["  " + line for line in r.closure.text().splitlines()]
        if r.preflight:
            lines += ["  " + line for line in r.preflight.text().splitlines()]
        if r.startup is not None:
            lines += ["  " + line for line in r.startup.text().splitlines()]
        lines += [f"  {name}: start-up not predicted here: {why}" for name, why in r.not_predicted.items()]
        if r.checks:
            lines.append("  image checks: " + ", ".join(f"{k} ok" for k in r.checks if k != "vllm_path"))
        if r.error:
            lines.append(f"  error: {r.error}")
    return "\n".join(lines)
