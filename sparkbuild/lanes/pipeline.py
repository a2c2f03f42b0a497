"""The nightly: plan, then for each target a tuple of small stages, then a summary.

Each target stage takes the run context and the target's record and returns whether the target
goes on to the next stage. A target whose content tag is already in the registry stops after the
first stage: nothing is built; each check of the target that never ran on the published image (a
check added since) runs on it now; then its readable tags move.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.errors import FatalError, LaneFailed, PatchError, RegistryUnavailableError
from sparkbuild.lanes import disk, doctor, summary
from sparkbuild.oci import referrers
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry, embedded
from sparkbuild.plan import plan
from sparkbuild.plan.matrix import Check, GitSource, Target
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.publish import attest, publish
from sparkbuild.upstream import kernelpath
from sparkbuild.util import fsutil, host, log, runlock
from sparkbuild.verify import layout

# The stages that build, verify and judge speed are imported where a target reaches them: a nightly
# with nothing to build loads none of them (tests/test_startup.py).
if TYPE_CHECKING:
    from sparkbuild.build import build, closure, preflight
    from sparkbuild.verify import benchmark, regression, startup, verify


class Status(StrEnum):
    """Where a target is, or how it ended (``summary.json``'s ``status``)."""

    PENDING = "pending"
    CHECKING_PATCHES = "checking patches"
    PREFLIGHT = "preflight"
    BUILDING = "building"
    PREDICTING = "predicting start-up"
    VERIFYING = "verifying"
    PUBLISHING = "publishing"
    PUBLISHED = "published"
    # Published by digest, slower than its baseline (readable tags held where the check says so).
    REGRESSED = "regressed"
    UP_TO_DATE = "up to date"
    # Published before; the checks its target gained since then ran on it now and passed.
    CHECKED = "checked"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    NOT_RUN = "not run"


DONE = (Status.PUBLISHED, Status.UP_TO_DATE, Status.CHECKED, Status.REGRESSED)


@dataclass(frozen=True, kw_only=True)
class Speed:
    """One benchmarked check's speed, judged: the gate's answer against the check's baseline, and
    the table and plot a person reads."""

    check: Check
    measured: benchmark.Benchmark
    baseline: benchmark.Benchmark | None
    gate: regression.Gate
    table: str
    plot: Path

    def to_json(self) -> dict[str, object]:
        from sparkbuild.verify import regression

        return {
            "check": self.check.name,
            "verdict": self.gate.verdict,
            "baseline_of": self.gate.baseline_of,
            "baseline_target": self.gate.baseline_target,
            "table": self.table,
            "plot": str(self.plot),
            # What the report plots night by night: the figures measured, and each beside its baseline.
            "measured": regression.headline_figures(self.measured),
            "changes": [c.to_json() for c in self.gate.changes],
        }


@dataclass
class TargetRun:
    """What happened to one target; filled in stage by stage."""

    plan: TargetPlan
    status: Status = Status.PENDING
    # The stage a failed or interrupted target was in.
    failed_at: Status | None = None
    image: str | None = None
    digest: str | None = None
    # The first check's result, and every check's (verify_all's answer).
    result: verify.VerifyResult | None = None
    verified: verify.Verified | None = None
    stages: tuple[build.StageOutcome, ...] = ()
    # The patch check on the target's vLLM source; None where nothing was checked.
    patches: tuple[patch.Result, ...] | None = None
    # The compile's preflight (Spark): the runtime's dependency closure for the image's platform,
    # vLLM's configure audited, the patched units compiled.
    closure: closure.Closure | None = None
    preflight: preflight.Report | None = None
    error: str | None = None
    seconds: float = 0.0
    # How the published digest is signed (sparkbuild/publish/sign.py); None until published.
    signature: str | None = None
    # When its stages began (the provenance's startedOn).
    started: datetime | None = None
    # Each benchmarked check's speed against its baseline, by check.
    speeds: dict[str, Speed] = dataclasses.field(default_factory=dict)
    # The checks the target gained since its image was published, run on that image (find_published).
    new_checks: tuple[str, ...] = ()
    # vLLM's own start-up of each check, predicted in the built image with its GPU faked (Spark
    # targets), and where the servers then chose otherwise (the prediction was wrong).
    startup: startup.Startup | None = None
    mispredicted: tuple[str, ...] = ()
    # The checks whose speed gate held the readable tags back (the image is published by digest only).
    held: tuple[str, ...] = ()

    @property
    def speed_verdict(self) -> regression.Verdict | None:
        """What the checks' verdicts add up to (regressed where any regressed); None: none measured."""
        if not self.speeds:
            return None
        from sparkbuild.verify import regression

        return regression.overall([s.gate.verdict for s in self.speeds.values()])

    def verify_text(self) -> str:
        if self.verified is not None and self.new_checks:
            return f"on the published image: {verified_cell(self.verified, named=True)}"
        if self.verified is not None:
            return verified_cell(self.verified)
        if self.result is not None:
            return verify_cell(self.result)
        return "(verified when first published)" if self.status == Status.UP_TO_DATE else "-"

    def row(self) -> dict[str, object]:
        source = source_of(self.plan.target)
        return {
            "target": self.plan.id,
            # Built and verified for this platform; emulated where it is not this host's own.
            "platform": {"name": self.plan.target.platform, "emulated": host.emulated(self.plan.target.platform)},
            "vllm": self.plan.target.version,
            "commit": source[0].commit if source else None,
            "patches": None if self.patches is None else {r.patch: r.status for r in self.patches},
            "tag": f"{self.plan.repository}:{self.plan.content_tag}",
            "tags": list(self.plan.tags),
            "digest": self.digest,
            "signature": self.signature,
            "status": self.status.value,
            "held": list(self.held),
            "failed_at": None if self.failed_at is None else self.failed_at.value,
            "closure": None if self.closure is None else {"verdict": self.closure.verdict, "cell": self.closure.cell()},
            "preflight": None if self.preflight is None else self.preflight.summary(),
            "verify": self.verify_text(),
            "checks": None if self.verified is None else checks_json(self.verified),
            "speed": None
            if not self.speeds
            else {"verdict": self.speed_verdict, "checks": [s.to_json() for s in self.speeds.values()]},
            "seconds": round(self.seconds, 1),
            "stages": [s.to_json() for s in self.stages],
            "startup": None if self.startup is None else {**self.startup.to_json(), "mispredicted": list(self.mispredicted)},
            "error": self.error,
        }


@dataclass
class Context:
    opts: Options
    registry: Registry
    # Where source trees are checked out for patch checks during this run (removed after it).
    work: Path
    patch_folders: dict[str, Path]

    @cached_property
    def engine(self) -> Engine:
        # Connect only when a stage needs it: a no-op nightly talks to the registry alone.
        return Engine()

    def tree(self, source: GitSource) -> Path:
        """The source tree at ``source.commit``: one worktree of the mirror per repository, moved
        from commit to commit (a new worktree costs seconds, moving it milliseconds)."""
        assert source.commit is not None
        # Imported here for start-up: gitpython takes a few hundred ms to import, and only a target
        # built from a git source needs it (tests/test_startup.py).
        from sparkbuild.upstream import gitrepo

        mirror = gitrepo.Mirror(self.opts.cache, source.repo)
        return mirror.checkout(source.commit, self.work / "trees" / mirror.path.stem)


def source_of(target: Target) -> tuple[GitSource, str] | None:
    """The vLLM git source a target is built from, and its version; None for a PyPI wheel."""
    if target.candidate is not None:
        return target.candidate, target.candidate.version
    if target.vllm.kind in ("version", "ref"):
        return target.vllm.git(), target.vllm.version
    return None


def check_patches(ctx: Context, run: TargetRun) -> bool:
    """Say what each patch does to this vLLM commit before anything is built; a conflict stops here."""
    source = source_of(run.plan.target)
    if source is None or not run.plan.target.patches or source[0].commit is None:
        return True
    run.status = Status.CHECKING_PATCHES
    git, version = source
    report = patch.check(ctx.tree(git), patch.load(ctx.patch_folders, run.plan.target.patches), version)
    run.patches = report.results
    log.info(patch.table(report))
    if not report.ok:
        conflicts = "; ".join(f"{r.patch}: {r.detail}" for r in report.results if r.status == "conflict")
        raise PatchError(
            f"{git.ref} ({git.commit[:12] if git.commit else '?'}): {conflicts}. "
            f"`sparkbuild bisect --good <last good tag> --bad {git.ref}` names the commit that broke it"
        )
    return True


TargetStage = Callable[[Context, TargetRun], bool]


def find_published(ctx: Context, run: TargetRun) -> bool:
    """A target whose content tag is published builds nothing. Each of its checks with no verify
    result attached to the published image (a check the target gained since: checks are not in the
    content hash) runs on that image first; then what is missing is attached and the tags move."""
    digest = ctx.registry.digest(run.plan.repository, run.plan.content_tag)
    if digest is None:
        return True
    # One published before sparkbuild attached documents gets them now (the engine only if the SBOM
    # is missing): they describe the image, whatever its gained checks say next.
    attest.attach(lambda: ctx.engine, ctx.registry, run.plan, digest, evidence(ctx, run))
    new = unchecked(ctx.registry, run.plan, digest)
    if new:
        names = ", ".join(c.name for c in new)
        log.info(f"{run.plan.id}: {run.plan.content_tag} is published ({digest}); check(s) {names} never ran on it: running them")
        check_published(ctx, run, digest, new)
        attest.attach(lambda: ctx.engine, ctx.registry, run.plan, digest, evidence(ctx, run))  # their results
    else:
        log.info(f"{run.plan.id}: {run.plan.content_tag} is already published ({digest}); nothing to build")
    attach_baselines(ctx, run, digest)
    published = publish.move_tags(ctx.registry, run.plan, digest, signer=ctx.opts.signer)
    run.digest, run.signature = digest, published.signature
    run.status = Status.CHECKED if new else Status.UP_TO_DATE
    if new:
        regressed(run, held=False)
    return False


def unchecked(registry: Registry, p: TargetPlan, digest: str) -> tuple[Check, ...]:
    """The target's checks with no verify result attached to ``digest`` (a result that says the
    check was skipped on its host counts: it is that check's result on that image)."""
    listed = referrers.listed(registry, p.repository, digest)
    have = {a.annotations.get(attest.CHECK, p.target.check.name) for a in listed if a.kind == "verify"}
    return tuple(c for c in p.target.checks if c.name not in have)


def check_published(ctx: Context, run: TargetRun, digest: str, checks: tuple[Check, ...]) -> None:
    """Run ``checks`` on the published image (pulled by digest where the engine lacks it), their
    results beside the target's others; judge the speed of those with ``bench``."""
    from sparkbuild.verify import multinode, verify

    run.status = Status.VERIFYING
    run.new_checks = tuple(c.name for c in checks)
    target = run.plan.target
    image = attest.published_in_engine(ctx.engine, f"{ctx.registry.host}/{run.plan.repository}", digest, target.platform)
    run.image = image
    first = ctx.opts.out / run.plan.id / "verify.json"
    gpus = target.profile == "spark"
    run.verified = verify.verify_all(
        ctx.engine,
        image,
        checks,
        first,
        cache=ctx.opts.cache,
        gpus=gpus,
        layout=tuple(c.name for c in target.checks),
        peers=multinode.peers_of(ctx.opts),
    )
    run.result = run.verified.first
    run.verified.require()
    judge_all(ctx, run)


def preflight_build(ctx: Context, run: TargetRun) -> bool:
    """Before the long compile: the runtime's dependency closure for the image's platform
    (``sparkbuild.build.closure``), vLLM's own configure for the target's arch list, every unit's code audited
    for the GPU, and the patched units compiled and checked (``sparkbuild.build.preflight``). A failure stops
    the target here, naming the wheel or the units; a vLLM stage built earlier needs none."""
    from sparkbuild.build import build, closure

    stage = build.preflighted_stage(run.plan)
    if stage is None or build.is_present(ctx.engine, ctx.registry, stage):
        return True
    run.status = Status.PREFLIGHT
    source = source_of(run.plan.target)
    if source is not None and source[0].commit is not None:
        run.closure = closure.check(run.plan.target, ctx.tree(source[0]), ctx.opts)
        closure.log_closure(run.closure)
        closure.require(run.closure)
    run.preflight = build.run_preflight(ctx.engine, run.plan, ctx.opts)
    run.preflight.require()
    return True


def build_image(ctx: Context, run: TargetRun) -> bool:
    from sparkbuild.build import build

    run.status = Status.BUILDING
    result = build.build(ctx.engine, run.plan, ctx.opts, ctx.registry, check_first=False)
    run.image, run.stages = result.image, result.stages
    return True


def predict_startup(ctx: Context, run: TargetRun) -> bool:
    """A Spark image's start-up, predicted before any server runs: vLLM's own code for each check in
    the built image, a GB10 faked, judged by the kernel-path gate (sparkbuild.verify.startup). A check
    whose prediction fails fails the target here, before verify serves it and before any push. The
    local profile serves on this machine's own platform at once: verify is the prediction's test there."""
    from sparkbuild.verify import startup

    target = run.plan.target
    if target.profile != "spark" or run.image is None:
        return True
    run.status = Status.PREDICTING
    run.startup = startup.on_gb10(ctx.engine, run.image, target, target.checks, ctx.opts.cache)
    run.startup.require()
    return True


def verify_image(ctx: Context, run: TargetRun) -> bool:
    from sparkbuild.verify import multinode, startup, verify

    assert run.image is not None
    run.status = Status.VERIFYING
    target = run.plan.target
    gpus = target.profile == "spark"
    first = ctx.opts.out / run.plan.id / "verify.json"
    run.verified = verify.verify_all(
        ctx.engine, run.image, target.checks, first, cache=ctx.opts.cache, gpus=gpus, peers=multinode.peers_of(ctx.opts)
    )
    run.result = run.verified.first
    if run.startup is not None:
        run.mispredicted = tuple(startup.mispredicted(run.startup, run.verified.results))
        for line in run.mispredicted:
            log.warning(line)
    run.verified.require()
    judge_all(ctx, run)
    return True


def judge_all(ctx: Context, run: TargetRun) -> None:
    """The speed of each check that measured it, against that check's baseline."""
    assert run.verified is not None
    for check in run.plan.target.benchmarked:
        result = run.verified.results.get(check.name)
        if result is not None and result.benchmark is not None:
            run.speeds[check.name] = judge_speed(ctx, run, check, result.benchmark, run.verified.folders[check.name])


def judge_speed(ctx: Context, run: TargetRun, check: Check, measured: benchmark.Benchmark, folder: Path) -> Speed:
    """Compare a check's speed with its baseline (the target's last-good image's, else its
    lineage's); write the gate's answer (speed.json), the table and the plot beside its verify.json."""
    from sparkbuild.publish import baseline
    from sparkbuild.verify import benchreport, regression

    found = baseline.read(ctx.registry, run.plan, check.name)
    was = found.benchmark if found else None
    gate = regression.compare(
        measured,
        was,
        threshold_pct=check.bench_threshold_pct,
        baseline_of=found.image if found else None,
        baseline_target=found.target if found else None,
    )
    table = benchreport.table(measured, was, gate, check.model)
    plot = benchreport.plot(measured, was, folder, title=f"{run.plan.id} ({check.name}): vllm bench serve")
    fsutil.write_text(folder / "speed.json", json.dumps(gate.to_json(), indent=2) + "\n")
    log.info(f"{check.name}:\n{table}\nplot: {plot}")
    return Speed(check=check, measured=measured, baseline=was, gate=gate, table=table, plot=plot)


def publish_image(ctx: Context, run: TargetRun) -> bool:
    assert run.image is not None
    run.status = Status.PUBLISHING
    slower = [s for s in run.speeds.values() if s.gate.verdict == "regressed"]
    run.held = tuple(s.check.name for s in slower if s.check.bench_hold_tags)
    hold = bool(run.held)
    # Held: pushed by digest with its documents, no readable tag and not last-good.
    held_plan = dataclasses.replace(run.plan, tags=()) if hold else run.plan
    published = publish.push(
        ctx.engine, ctx.registry, held_plan, run.image, verified=not hold, evidence=evidence(ctx, run), signer=ctx.opts.signer
    )
    run.digest, run.status, run.signature = published.digest, Status.PUBLISHED, published.signature
    attach_baselines(ctx, run, published.digest)
    regressed(run, held=hold)
    return True


def attach_baselines(ctx: Context, run: TargetRun, digest: str) -> None:
    """Each benchmarked check's next baseline, attached to the published image (moved figure by
    figure: ``regression.next_baseline``)."""
    if not run.speeds:
        return
    from sparkbuild.publish import baseline
    from sparkbuild.verify import regression

    for speed in run.speeds.values():
        following = regression.next_baseline(speed.measured, speed.baseline, speed.gate)
        baseline.attach(ctx.registry, run.plan, digest, speed.check.name, following, referrers.created_now())


def regressed(run: TargetRun, *, held: bool) -> None:
    """A target with a check slower than its baseline: ``regressed``, each such check named."""
    slower = [s for s in run.speeds.values() if s.gate.verdict == "regressed"]
    if not slower:
        return
    run.status = Status.REGRESSED
    why = "; ".join(f"check {s.check.name} against {s.gate.baseline_of}: {s.gate.reason()}" for s in slower)
    kept = f"; readable tags not moved ({', '.join(run.plan.tags)})" if held else ""
    run.error = f"speed regressed: {why}{kept}"
    log.error(f"{run.plan.id}: {run.error}")


def evidence(ctx: Context, run: TargetRun) -> attest.Evidence:
    """What the documents are made from; the verify results are of ``run.image`` (the local build,
    or the published image a new check ran on)."""
    return attest.Evidence.of(ctx.opts, run.plan, run.image or run.plan.local_ref, run.started)


TARGET_STAGES: tuple[TargetStage, ...] = (
    find_published,
    check_patches,
    preflight_build,
    build_image,
    predict_startup,
    verify_image,
    publish_image,
)


@contextmanager
def open_registry(opts: Options) -> Iterator[Registry]:
    if opts.registry is None:
        with embedded(opts.cache / "registry", opts.registry_limits) as registry:
            yield registry
        return
    registry = Registry.parse(opts.registry, opts.registry_limits, opts.token_realms)
    if not registry.ping():
        raise RegistryUnavailableError(
            f"registry {registry.host} does not answer at {registry.base_url}/; "
            "start it, or unset SPARKBUILD_REGISTRY to use an embedded one"
        )
    yield registry


def run_target(ctx: Context, run: TargetRun, stages: tuple[TargetStage, ...] = TARGET_STAGES) -> None:
    """Run ``stages`` on one target. Any failure in them, expected or not, is this target's: it is
    recorded (with its traceback, for a surprise, in ``<out>/<target>/error.log``) and the lane goes
    on. Only Ctrl-C stops the lane."""
    start = time.monotonic()
    run.started = datetime.now(UTC)
    try:
        for stage in stages:
            if not stage(ctx, run):
                break
    except FatalError as exc:
        _failed(ctx, run, str(exc), str(exc))
    except KeyboardInterrupt:
        run.failed_at, run.status, run.error = run.status, Status.INTERRUPTED, "interrupted (Ctrl-C or SIGTERM)"
        raise
    except Exception as exc:  # a surprise (a docker API error, a bad answer): still only this target's
        where = ctx.opts.out / run.plan.id / "error.log"
        _failed(ctx, run, f"unexpected {type(exc).__name__}: {exc} (traceback in {where})", traceback.format_exc())
    finally:
        run.seconds = time.monotonic() - start


def _failed(ctx: Context, run: TargetRun, message: str, details: str) -> None:
    run.failed_at, run.status, run.error = run.status, Status.FAILED, message
    log.error(f"{run.plan.id}: {message}")
    fsutil.write_text(ctx.opts.out / run.plan.id / "error.log", f"{run.plan.id} failed while {run.failed_at}:\n{details}\n")


def run_lane(ctx: Context, runs: list[TargetRun], stages: tuple[TargetStage, ...], at: str = "") -> None:
    """Every target in turn; one's failure never stops the others."""
    for i, run in enumerate(runs, 1):
        with log.step(f"[{i}/{len(runs)}] {run.plan.id}{at}"):
            run_target(ctx, run, stages)


def check_disk(ctx: Context, runs: list[TargetRun]) -> None:
    """Before any work: disk for what is not published yet (Docker's data root, the cache, the
    embedded registry's storage)."""
    todo = [r.plan for r in runs if ctx.registry.digest(r.plan.repository, r.plan.content_tag) is None]
    root = disk.engine_root(ctx.engine.client.info()) if todo else None
    storage = ctx.opts.cache / "registry" / "storage" if ctx.opts.registry is None else None
    engine = ctx.engine if todo else None
    disk.check(
        disk.needs(
            todo,
            ctx.opts.cache,
            engine_root=root,
            in_engine=lambda ref: engine is not None and engine.image_exists(ref),
            registry_storage=storage,
        )
    )


@contextmanager
def finishing(opts: Options, lane: str, runs: list[TargetRun], *, table_to_stderr: bool, intro: str = "") -> Iterator[None]:
    """Whatever ends the lane (its end, a failure before the targets, Ctrl-C), the summary table and
    ``summary.json`` are written, with each target that did not run saying why."""
    start = time.monotonic()
    try:
        yield
    except BaseException as exc:
        why = "interrupted (Ctrl-C or SIGTERM)" if isinstance(exc, KeyboardInterrupt) else f"the lane stopped: {exc}"
        for run in runs:
            if run.status not in (*DONE, Status.FAILED, Status.INTERRUPTED):
                run.failed_at, run.status, run.error = run.status, Status.NOT_RUN, why
        with contextlib.suppress(LaneFailed):
            report(opts, lane, runs, time.monotonic() - start, table_to_stderr=table_to_stderr, intro=intro)
        raise
    report(opts, lane, runs, time.monotonic() - start, table_to_stderr=table_to_stderr, intro=intro)


def nightly(opts: Options, *, table_to_stderr: bool = False) -> list[TargetRun]:
    """Plan, build, verify and publish every selected target; raise if any failed.

    The summary table goes to stdout, or to stderr when stdout is kept for JSON.
    """
    with log.step("Planning"):
        m = plan.load_matrix(opts)
        plans = plan.plan_lane(m, opts)
    with log.step("Checking this host"):
        doctor.require([p.target for p in plans], opts)
    runs = [TargetRun(p) for p in plans]
    with (
        runlock.run(opts.cache, wait=opts.wait),
        finishing(opts, "nightly", runs, table_to_stderr=table_to_stderr),
        open_registry(opts) as registry,
        tempfile.TemporaryDirectory(prefix="sparkbuild-") as work,
    ):
        ctx = Context(opts, registry, Path(work), m.patch_folders)
        check_disk(ctx, runs)
        started = datetime.now(UTC)
        run_lane(ctx, runs, TARGET_STAGES)
        keep(ctx, "nightly", runs, started)
    return runs


def keep(ctx: Context, lane: str, runs: list[TargetRun], started: datetime) -> None:
    """The run kept in the registry beside its images, one record per repository
    (``sparkbuild.publish.runrecord``); then the report site (``<out>/report``) written from the
    registry, every night of those repositories in it."""
    from sparkbuild.publish import runrecord
    from sparkbuild.report import site

    repositories = list(dict.fromkeys(r.plan.repository for r in runs))
    with log.step("Recording the run and writing the report"):
        for repository in repositories:
            rows = [r.row() for r in runs if r.plan.repository == repository]
            runrecord.push(ctx.registry, repository, lane=lane, night=ctx.opts.date, started=started, rows=rows, out=ctx.opts.out)
        site.make(ctx.registry, repositories, ctx.opts.out / "report", ctx.opts.cache)


def report(opts: Options, lane: str, runs: list[TargetRun], elapsed: float, *, table_to_stderr: bool, intro: str = "") -> None:
    """Print the summary table, add it to the GitHub step summary, write summary.json; raise if any failed."""
    text = summary_table(runs)
    stream = sys.stderr if table_to_stderr else sys.stdout
    print(f"{intro}{text}\n\n{len(runs)} target(s) in {log.format_seconds(elapsed)}", file=stream, flush=True)
    log.step_summary(f"## sparkbuild {lane}\n\n{intro}{text}")
    fsutil.write_text(opts.out / "summary.json", json.dumps([r.row() for r in runs], indent=2) + "\n")
    failed = [r for r in runs if r.error]
    if failed:
        raise LaneFailed(f"{lane}: {len(failed)} of {len(runs)} target(s) failed: {', '.join(r.plan.id for r in failed)}")


def verify_cell(result: verify.VerifyResult) -> str:
    good = sum(a.ok for a in result.answers)
    text = f"{good}/{len(result.answers)} answers"
    if result.cluster is not None:  # served by a cluster of the image (multi_node)
        text += f" from {result.cluster['nodes']} nodes"
    if result.numbers:  # the answers' logprobs held to the model's recorded reference
        moved = sum(len(n.violations) for n in result.numbers)
        text += ", logprobs as recorded" if not moved else f", logprobs MOVED at {moved} position(s)"
    first = result.benchmark.levels[0] if result.benchmark and result.benchmark.levels else None
    if first is not None:
        f = first.figures
        text += f", {first.scenario} c={first.concurrency}: TTFT {f.ttft_ms_p50:.0f} ms, {f.tokens_per_s:.0f} tok/s"
    if result.kernels:  # the kernel path, and whether its patterns were unverified for this vLLM
        text += f", {kernelpath.text(result.kernels)}"
    return text + kinds_text(result)


def kinds_text(result: verify.VerifyResult) -> str:
    """The check kinds run (docs/check-kinds.md): ", kinds ok (arithmetic, burn_in)", or the failed ones."""
    failed = [k.kind for k in result.kinds if not k.ok]
    if failed:
        return f", kinds FAILED: {', '.join(failed)}"
    return f", kinds ok ({', '.join(k.kind for k in result.kinds)})" if result.kinds else ""


def verified_cell(verified: verify.Verified, *, named: bool = False) -> str:
    """Each check as ``verify_cell`` shows it (its first figure where it measured its speed); one
    check alone reads as its cell, unless ``named``."""
    parts = []
    for name in verified.checks:
        found = verified.results.get(name)
        text = "FAILED" if found is None else verify_cell(found)
        if found is not None and name in verified.failures:
            text = f"FAILED ({text})"
        if name in verified.skipped:
            text = "SKIPPED on this host"
        parts.append(text if len(verified.checks) == 1 and not named else f"{name}: {text}")
    return "; ".join(parts)


def checks_json(verified: verify.Verified) -> list[dict[str, object]]:
    """Each check's verdict for summary.json: ok, skipped (with why), or the failure's first line
    and the server's log to read."""
    rows: list[dict[str, object]] = []
    for name in verified.checks:
        failed = name in verified.failures
        folder = verified.folders.get(name)
        rows.append(
            {
                "check": name,
                "ok": name in verified.results and not failed,
                "skipped": verified.skipped.get(name),
                "error": str(verified.failures[name]).splitlines()[0] if failed else None,
                "log": str(folder / layout.SERVER_LOG) if failed and folder is not None else None,
                "kernels": [
                    {"kind": k.kind, "backends": [b for b, _ in k.found], "ok": k.ok}
                    for k in (verified.results[name].kernels if name in verified.results else ())
                ],
            }
        )
    return rows


def patch_cell(results: tuple[patch.Result, ...] | None) -> str:
    return summary.patch_cell(None if results is None else {r.patch: r.status for r in results})


def summary_table(runs: list[TargetRun]) -> str:
    """A Markdown table a person reads at a glance (and GitHub renders); ``summary`` draws it from
    the rows of summary.json, so a fanned-out lane's merged table looks the same."""
    rows = [r.row() for r in runs]
    return "\n\n".join(filter(None, (summary.table(rows), summary.check_notes(rows), summary.speeds(rows))))
