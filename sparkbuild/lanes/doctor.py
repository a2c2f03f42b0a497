"""``sparkbuild doctor``: what this host can run, at a glance, and why not the rest.

Facts are read once (``gather``): the machine, its CPU, memory and binfmt handlers, and its NVIDIA
GPUs (``sparkbuild.util.host``), free disk, the engine and the docker CLI that drives BuildKit
(``sparkbuild.oci.engine.probe``), the registry. Verdicts are pure functions of the facts and the matrix,
so each kind of machine is tested from recorded facts (cpuinfo texts, nvidia-smi outputs).

``require`` is the gate a lane passes before any work: what a selected target needs and this host
lacks is one message, after this report, with the exit code of ``sparkbuild.errors``.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkbuild.config.options import Options, env
from sparkbuild.errors import ConfigError, EngineError, FatalError, RegistryUnavailableError, ToolMissingError
from sparkbuild.oci.engine import EngineFacts, probe
from sparkbuild.plan import runnable
from sparkbuild.plan.matrix import PLATFORMS, Check, Target
from sparkbuild.util import host

GB = 10**9
REGISTRY_HELP = "apt-get install docker-registry (the embedded registry), or set SPARKBUILD_REGISTRY=host:port"


@dataclass(frozen=True, kw_only=True)
class Disk:
    what: str
    path: str
    free_gb: float


@dataclass(frozen=True, kw_only=True)
class RegistryFacts:
    """Where the lanes publish: the registry SPARKBUILD_REGISTRY (or --registry) names, and whether it
    answers; else the embedded one, which needs Debian's docker-registry."""

    configured: str | None
    answers: bool | None
    binary: str | None


@dataclass(frozen=True, kw_only=True)
class Facts:
    machine: str
    # None: a machine sparkbuild builds no image for.
    platform: str | None
    cpu: host.Cpu
    memory_gb: float | None
    disks: tuple[Disk, ...]
    engine: EngineFacts
    # Each platform sparkbuild builds for: whether its images run here, and how or why not.
    platforms: dict[str, tuple[bool, str]]
    binfmt: dict[str, str]
    gpus: host.Gpus
    registry: RegistryFacts

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "platform": self.platform,
            "cpu": {
                "model": self.cpu.model,
                "cores": self.cpu.cores,
                "features": list(self.cpu.features()),
                "avx512": self.cpu.avx512,
                "amx": self.cpu.amx,
            },
            "memory_gb": None if self.memory_gb is None else round(self.memory_gb, 1),
            "disks": [dataclasses.asdict(d) | {"free_gb": round(d.free_gb, 1)} for d in self.disks],
            "engine": {
                "address": self.engine.address,
                "reachable": self.engine.reachable,
                "error": self.engine.error,
                "version": self.engine.version,
                "architecture": self.engine.architecture,
                "root": self.engine.root,
                "runtimes": list(self.engine.runtimes),
            },
            "buildkit": {
                "command": None if self.engine.cli is None else " ".join(self.engine.cli.prefix),
                "env": {} if self.engine.cli is None else dict(self.engine.cli.env),
                "error": self.engine.cli_error,
            },
            "platforms": {p: {"runs": ok, "how": how} for p, (ok, how) in self.platforms.items()},
            "binfmt": self.binfmt,
            "gpus": {
                "found": [dataclasses.asdict(g) for g in self.gpus.found],
                "driver": self.gpus.driver,
                "cuda": self.gpus.cuda,
                "error": self.gpus.error,
            },
            "registry": dataclasses.asdict(self.registry),
        }


def native(platform: str | None, engine: EngineFacts) -> str | None:
    """The platform the engine runs natively: its machine's where it says, else this host's."""
    if not engine.architecture:
        return platform
    try:
        return host.platform_of(engine.architecture)
    except host.UnknownMachineError:
        return None


def platforms(native: str | None, binfmt: Path = host.BINFMT) -> dict[str, tuple[bool, str]]:
    """Whether images of each platform sparkbuild builds run where the engine runs."""
    if native is None:
        return {p: (False, "the engine's machine is none sparkbuild builds images for") for p in sorted(PLATFORMS)}
    return {p: host.can_run(p, binfmt, native=native) for p in sorted(PLATFORMS)}


def gather(opts: Options, *, registry: str | None = None) -> Facts:
    """Read this host's facts (a few seconds at most: nothing is built or pulled)."""
    try:
        platform: str | None = host.host_platform()
    except host.UnknownMachineError:
        platform = None
    engine = probe()
    binfmt = Path(env("SPARKBUILD_BINFMT_MISC", str(host.BINFMT)))
    return Facts(
        machine=host.machine(),
        platform=platform,
        cpu=host.read_cpu(),
        memory_gb=host.memory_gb(),
        disks=disks(opts.cache, engine.root),
        engine=engine,
        platforms=platforms(native(platform, engine), binfmt),
        binfmt=host.binfmt_handlers(binfmt),
        gpus=host.read_gpus(),
        registry=registry_facts(registry if registry is not None else opts.registry),
    )


def disks(cache: Path, engine_root: str | None) -> tuple[Disk, ...]:
    found = [Disk(what="the cache", path=str(cache), free_gb=_free_gb(cache))]
    if engine_root and Path(engine_root).is_dir():  # not where the engine runs on another machine
        found.append(Disk(what="Docker's data root", path=engine_root, free_gb=_free_gb(Path(engine_root))))
    return tuple(found)


def _free_gb(path: Path) -> float:
    while not path.exists() and path.parent != path:
        path = path.parent  # a cache not made yet: the disk it will be made on
    return shutil.disk_usage(path).free / GB


def registry_facts(configured: str | None) -> RegistryFacts:
    binary = shutil.which("docker-registry")
    if not configured:
        return RegistryFacts(configured=None, answers=None, binary=binary)
    from sparkbuild.config.options import default_limits
    from sparkbuild.oci.registry import Registry  # requests and tenacity: only here

    quick = dataclasses.replace(default_limits(), attempts=1, timeout_s=5.0, give_up_after_s=5.0)
    try:
        answers = Registry.parse(configured, quick).ping()
    except ConfigError:
        answers = False
    return RegistryFacts(configured=configured, answers=answers, binary=binary)


# --- what can run here ------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocker:
    """Why a target cannot run here: in full, saying what to do (the error's message); in a few words
    (doctor's table); and the error that says so."""

    reason: str
    short: str
    error: type[FatalError]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def gpu_blockers(target: Target, gpus: host.Gpus, runtimes: tuple[str, ...] = ()) -> tuple[Blocker, ...]:
    """Why the GPU of this host cannot serve ``target``'s image: none, another compute capability,
    a driver whose CUDA is of an older major than the image's."""
    if not gpus.found:
        if "nvidia" in runtimes:
            return ()  # nvidia-smi is not here, but the engine has NVIDIA's runtime: the GPU is the engine's
        return (
            Blocker(
                f"its checks serve on an NVIDIA GPU (compute capability {target.gpu}, CUDA {target.cuda}): {gpus.error}",
                "no NVIDIA GPU",
                EngineError,
            ),
        )
    found = []
    if not any(g.compute_cap == target.gpu for g in gpus.found):
        have = ", ".join(f"{g.name} ({g.compute_cap})" for g in gpus.found)
        found.append(
            Blocker(
                f"its image is built for compute capability {target.gpu} (arch_list {target.arch_list}: a DGX Spark's GB10); "
                f"this host has {have}",
                f"needs a compute {target.gpu} GPU, not {', '.join(dict.fromkeys(g.compute_cap for g in gpus.found))}",
                EngineError,
            )
        )
    if target.cuda and gpus.cuda and _version(gpus.cuda)[:1] < _version(target.cuda)[:1]:
        found.append(
            Blocker(
                f"the driver ({gpus.driver}) supports CUDA up to {gpus.cuda}; the image is CUDA {target.cuda}: "
                "install a driver of that CUDA major or newer",
                f"driver CUDA {gpus.cuda} < {target.cuda}",
                EngineError,
            )
        )
    return tuple(found)


def gpu_notes(target: Target, gpus: host.Gpus) -> tuple[str, ...]:
    """What a Spark target's check of the driver found (the CUDA it supports against the image's)."""
    if not target.cuda or not gpus.cuda:
        return ()
    if _version(gpus.cuda) < _version(target.cuda):
        return (
            f"driver CUDA {gpus.cuda} < {target.cuda}: runs by CUDA's minor-version compatibility; "
            "PTX from the newer toolkit will not JIT",
        )
    return (f"driver CUDA {gpus.cuda} >= {target.cuda}",)


def target_blockers(target: Target, facts: Facts, *, registry: bool = True, gpu: bool = True) -> tuple[Blocker, ...]:
    """What this host lacks to build ``target``'s image, serve it (``gpu``: a Spark image on its GPU)
    and publish it (``registry``)."""
    found: list[Blocker] = []
    if not facts.engine.reachable:
        found.append(Blocker(facts.engine.error or "no Docker engine answers", "no Docker engine answers", EngineError))
    if facts.engine.cli is None:
        found.append(Blocker(facts.engine.cli_error or "no docker CLI drives BuildKit", "no BuildKit CLI", EngineError))
    runs, how = facts.platforms.get(target.platform, (False, f"{target.platform} is no platform sparkbuild builds for"))
    if not runs:
        hint = "; or give the target a 'platform:' this host runs" if target.profile == "local" else ""
        found.append(Blocker(f"{how}{hint}", f"{target.platform} does not run here", ToolMissingError))
    if registry:
        found += _registry_blockers(facts.registry)
    if gpu and target.profile == "spark":
        found += gpu_blockers(target, facts.gpus, facts.engine.runtimes)
    return tuple(found)


def _registry_blockers(registry: RegistryFacts) -> list[Blocker]:
    if registry.configured and registry.answers is False:
        return [
            Blocker(
                f"registry {registry.configured} (SPARKBUILD_REGISTRY or --registry) does not answer GET /v2/; "
                "start it, or unset SPARKBUILD_REGISTRY to use an embedded one",
                f"registry {registry.configured} does not answer",
                RegistryUnavailableError,
            )
        ]
    if not registry.configured and registry.binary is None:
        return [
            Blocker(
                f"no registry: docker-registry is not installed and SPARKBUILD_REGISTRY is not set; {REGISTRY_HELP}",
                "no registry",
                ToolMissingError,
            )
        ]
    return []


# A rule on one check of one target's image: None where it can run here, else why not (what to do).
CheckRule = Callable[[Check, Target, Facts], "str | None"]


def _serves_with_the_engine(check: Check, target: Target, facts: Facts) -> str | None:
    return None if facts.engine.reachable else f"serving needs the Docker engine: {facts.engine.error}"


def _serves_on_this_platform(check: Check, target: Target, facts: Facts) -> str | None:
    runs, how = facts.platforms.get(target.platform, (False, f"{target.platform} is unknown here"))
    return None if runs else f"the image cannot run here: {how}"


def _serves_on_the_gpu(check: Check, target: Target, facts: Facts) -> str | None:
    if target.profile != "spark":
        return None
    return "; ".join(b.reason for b in gpu_blockers(target, facts.gpus, facts.engine.runtimes)) or None


# What any check of the image needs here: the engine, the image's platform, the GPU of a Spark image.
SERVING_RULES: tuple[CheckRule, ...] = (_serves_with_the_engine, _serves_on_this_platform, _serves_on_the_gpu)


def _cpu_serves_the_format(check: Check, target: Target, facts: Facts) -> str | None:
    """The local image serves on this CPU: its vLLM's CPU kernels by the model's format and the
    CPU's ISA (sparkbuild/resources/cpu-serving.yaml)."""
    serving = runnable.Serving(cpu_image=target.profile == "local", vllm_version=target.version, cpu=facts.cpu)
    return runnable.skip_reason(check, serving)


# What one check needs beyond that, by its model and the CPU or GPU it would run on.
CHECK_RULES: tuple[CheckRule, ...] = (_cpu_serves_the_format,)


def check_blocker(check: Check, target: Target, facts: Facts) -> str | None:
    """Whether ``check`` can be served from ``target``'s image on this host: None, or why not.

    verify asks this before a check's server starts, and reports a check that cannot run here as
    skipped with this reason (never a pass, never a crash); doctor shows it per check."""
    return _reasons((*SERVING_RULES, *CHECK_RULES), check, target, facts)


def _reasons(rules: Iterable[CheckRule], check: Check, target: Target, facts: Facts) -> str | None:
    """Every objection of ``rules``, in order; None where none objects."""
    reasons = [reason for rule in rules if (reason := rule(check, target, facts))]
    return "; ".join(dict.fromkeys(reasons)) or None


# --- the report -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TargetVerdict:
    target: Target
    blockers: tuple[Blocker, ...]
    notes: tuple[str, ...]
    # Each check by name: None where it can run here, else why not.
    checks: tuple[tuple[str, str | None], ...]
    # The reasons of each check's own rules (CHECK_RULES), beyond what its target lacks.
    own: tuple[tuple[str, str | None], ...] = ()

    @property
    def runnable(self) -> bool:
        return not self.blockers

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.target.id,
            "profile": self.target.profile,
            "platform": self.target.platform,
            "lane": self.target.lane,
            "cuda": self.target.cuda,
            "runnable": self.runnable,
            "why_not": [b.reason for b in self.blockers],
            "why_not_short": [b.short for b in self.blockers],
            "notes": list(self.notes),
            "checks": [{"name": name, "runnable": why is None, "why_not": why} for name, why in self.checks],
        }


def judge(target: Target, facts: Facts, *, registry: bool = True, gpu: bool = True) -> TargetVerdict:
    notes = list(gpu_notes(target, facts.gpus)) if target.profile == "spark" else []
    runs, how = facts.platforms.get(target.platform, (False, ""))
    if runs and "emulation" in how:
        notes.append(how)
    return TargetVerdict(
        target=target,
        blockers=target_blockers(target, facts, registry=registry, gpu=gpu),
        notes=tuple(notes),
        checks=tuple((c.name, check_blocker(c, target, facts)) for c in target.checks),
        own=tuple((c.name, _reasons(CHECK_RULES, c, target, facts)) for c in target.checks),
    )


@dataclass(frozen=True, kw_only=True)
class Report:
    facts: Facts
    # The matrix judged; None where there is none to judge (no matrix.yaml where doctor runs).
    matrix: str | None
    matrix_error: str | None = None
    verdicts: tuple[TargetVerdict, ...] = ()

    def profiles(self) -> dict[str, dict[str, Any]]:
        """Each profile of the matrix: runnable when every one of its targets is; else why not."""
        found: dict[str, dict[str, Any]] = {}
        for v in self.verdicts:
            entry = found.setdefault(v.target.profile, {"runnable": True, "targets": 0, "runnable_targets": 0, "why_not": []})
            entry["targets"] += 1
            entry["runnable_targets"] += v.runnable
            entry["runnable"] = entry["runnable"] and v.runnable
            entry["why_not"] = list(dict.fromkeys([*entry["why_not"], *(b.short for b in v.blockers)]))
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.facts.to_json(),
            "matrix": {
                "file": self.matrix,
                "error": self.matrix_error,
                "profiles": self.profiles(),
                "targets": [v.to_json() for v in self.verdicts],
            },
        }

    def text(self) -> str:
        return "\n".join([*host_lines(self.facts), "", *self.matrix_lines()])

    def matrix_lines(self) -> list[str]:
        if self.matrix is None:
            return ["matrix: none here (`sparkbuild init` writes one; --matrix FILE names another)"]
        if self.matrix_error is not None:
            return [f"matrix {self.matrix}: invalid, nothing judged (the error follows)"]
        lines = [f"what can run here (matrix {self.matrix}):"]
        rows: list[tuple[str, str, str]] = []
        for profile, entry in self.profiles().items():
            counted = f"{entry['runnable_targets']} of {entry['targets']} target(s)"
            if not entry["runnable"]:
                counted += f": {'; '.join(entry['why_not'])}"
                if profile == "spark":
                    counted += " (`sparkbuild rehearse` builds their stages here without a GPU)"
            rows.append((f"profile {profile}", "yes" if entry["runnable"] else "no", counted))
            for v in (v for v in self.verdicts if v.target.profile == profile):
                why = "; ".join([*(b.short for b in v.blockers), *v.notes])
                rows.append((f"  {v.target.id}", "yes" if v.runnable else "no", why))
                own = dict(v.own)
                for name, reason in v.checks:
                    note = reason or ""
                    if reason is not None and not v.runnable:
                        note = "; ".join(filter(None, ("(as its target)", own.get(name))))
                    rows.append((f"    check {name}", "yes" if reason is None else "no", note))
        width = max(len(r[0]) for r in rows) if rows else 0
        lines += [f"  {name:<{width}}  {ok:<3}  {why}".rstrip() for name, ok, why in rows]
        return lines


def host_lines(facts: Facts) -> list[str]:
    """The host at a glance: one row per fact."""
    cpu = facts.cpu
    x86 = f"AVX-512 {'yes' if cpu.avx512 else 'no'}, AMX {'yes' if cpu.amx else 'no'}"
    arm = ", ".join(f for f in host.ARM_FEATURES if f in cpu.flags)
    features = arm if facts.platform == "linux/arm64" else x86
    memory = "unknown" if facts.memory_gb is None else f"{facts.memory_gb:.1f} GB"
    engine = facts.engine
    rows = [
        ("machine", f"{facts.machine} ({facts.platform or 'no sparkbuild platform'}), {cpu.cores} cores, {memory} memory"),
        ("CPU", f"{cpu.model or 'unknown model'}: {features}; features {' '.join(cpu.features()) or 'none read'}"),
        ("disk", "; ".join(f"{d.what} {d.path}: {d.free_gb:.0f} GB free" for d in facts.disks)),
        (
            "engine",
            f"Docker {engine.version} ({engine.architecture}) at {engine.address}"
            if engine.reachable
            else f"NOT REACHABLE: {engine.error}",
        ),
        ("BuildKit", _buildkit(engine)),
        *((f"runs {p}", ("yes: " if ok else "NO: ") + how) for p, (ok, how) in facts.platforms.items()),
        ("GPU", _gpus(facts.gpus, engine.runtimes)),
        ("registry", _registry(facts.registry)),
    ]
    width = max(len(name) for name, _ in rows)
    return ["sparkbuild doctor: this host", *(f"  {name:<{width}}  {value}" for name, value in rows)]


def _buildkit(engine: EngineFacts) -> str:
    if engine.cli is None:
        return f"NONE: {engine.cli_error}"
    env = " ".join(f"{k}={v}" for k, v in engine.cli.env)
    return f"{env + ' ' if env else ''}{' '.join(engine.cli.prefix)}"


def _gpus(gpus: host.Gpus, runtimes: tuple[str, ...]) -> str:
    if not gpus.found:
        extra = "; the engine has the nvidia runtime" if "nvidia" in runtimes else ""
        return f"none: {gpus.error}{extra}"
    names = ", ".join(
        f"{g.name} (compute {g.compute_cap}{'' if g.memory_mib is None else f', {g.memory_mib / 1024:.0f} GiB'})"
        for g in gpus.found
    )
    return f"{names}; driver {gpus.driver}, CUDA {gpus.cuda or 'unknown'}"


def _registry(registry: RegistryFacts) -> str:
    if registry.configured:
        state = "answers" if registry.answers else "DOES NOT ANSWER"
        return f"{registry.configured} (SPARKBUILD_REGISTRY): {state}"
    if registry.binary:
        return f"embedded: {registry.binary} (SPARKBUILD_REGISTRY not set)"
    return f"NONE: docker-registry is not installed and SPARKBUILD_REGISTRY is not set; {REGISTRY_HELP}"


def report(opts: Options, *, registry: str | None = None, matrix_optional: bool = False) -> Report:
    """This host's facts and what of the matrix (every target, both lanes) can run here;
    ``matrix_optional``: the host alone where the matrix file is not there."""
    from sparkbuild.plan import plan  # planning loads Jinja2 and the patch engine: after the facts

    facts = gather(opts, registry=registry)
    if matrix_optional and not opts.matrix.exists():
        return Report(facts=facts, matrix=None)
    try:
        m = plan.load_matrix(opts)
    except ConfigError as exc:
        return Report(facts=facts, matrix=str(opts.matrix), matrix_error=str(exc))
    return Report(facts=facts, matrix=str(m.file), verdicts=tuple(judge(t, facts) for t in m.targets))


def require(
    targets: Iterable[Target], opts: Options, *, registry: bool = True, gpu: bool = True, facts: Facts | None = None
) -> Facts:
    """Before any work: each target can run here (built; ``gpu``: served on its GPU; ``registry``:
    published), or this report on stderr and one error naming what to do.

    Raises the error of the first thing missing (an engine that is not there: EngineError; a platform
    this host cannot run: ToolMissingError); returns the facts otherwise."""
    facts = facts or gather(opts)
    verdicts = [judge(t, facts, registry=registry, gpu=gpu) for t in targets]
    blocked = [v for v in verdicts if not v.runnable]
    if not blocked:
        return facts
    print(Report(facts=facts, matrix=str(opts.matrix), verdicts=tuple(verdicts)).text(), file=sys.stderr, flush=True)
    reasons: dict[str, list[str]] = {}
    for v in blocked:
        for b in v.blockers:
            reasons.setdefault(b.reason, []).append(v.target.id)
    first = blocked[0].blockers[0].error
    said = "; ".join(f"{reason} ({', '.join(ids)})" for reason, ids in reasons.items())
    raise first(
        f"{len(blocked)} of {len(verdicts)} target(s) cannot run on this host, nothing was started: {said}. "
        "`sparkbuild doctor` shows what this host can run"
    )
