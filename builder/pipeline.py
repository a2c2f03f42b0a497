"""The nightly: plan, then for each target a tuple of small stages, then a summary.

Each target stage takes the run context and the target's record and returns whether the target
goes on to the next stage. A target whose content tag is already in the registry stops after the
first stage: its readable tags move, nothing is built.
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

from builder import (
    attest,
    baseline,
    benchmark,
    benchreport,
    build,
    closure,
    disk,
    doctor,
    fsutil,
    gitrepo,
    kernelpath,
    log,
    patch,
    plan,
    preflight,
    publish,
    referrers,
    regression,
    runlock,
    summary,
    verify,
)
from builder.engine import Engine
from builder.errors import FatalError, LaneFailed, PatchError, RegistryUnavailableError
from builder.matrix import GitSource, Target
from builder.options import Options
from builder.plan import TargetPlan
from builder.registry import Registry, embedded


class Status(StrEnum):
    """Where a target is, or how it ended (``summary.json``'s ``status``)."""

    PENDING = "pending"
    CHECKING_PATCHES = "checking patches"
    PREFLIGHT = "preflight"
    BUILDING = "building"
    VERIFYING = "verifying"
    PUBLISHING = "publishing"
    PUBLISHED = "published"
    # Published by digest, slower than its baseline (readable tags held where the check says so).
    REGRESSED = "regressed"
    UP_TO_DATE = "up to date"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    NOT_RUN = "not run"


DONE = (Status.PUBLISHED, Status.UP_TO_DATE, Status.REGRESSED)


@dataclass
class TargetRun:
    """What happened to one target; filled in stage by stage."""

    plan: TargetPlan
    status: Status = Status.PENDING
    # The stage a failed or interrupted target was in.
    failed_at: Status | None = None
    image: str | None = None
    digest: str | None = None
    # The benchmarked (first) check's result, and every check's (verify_all's answer).
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
    # How the published digest is signed (builder/sign.py); None until published.
    signature: str | None = None
    # When its stages began (the provenance's startedOn).
    started: datetime | None = None
    # The regression gate's answer on this image's speed, and what it was compared with.
    gate: regression.Gate | None = None
    baseline: benchmark.Benchmark | None = None
    # The benchmark as a person reads it: a plain-text table and a plot.
    speed_table: str | None = None
    plot: Path | None = None

    def verify_text(self) -> str:
        if self.verified is not None:
            return verified_cell(self.verified)
        if self.result is not None:
            return verify_cell(self.result)
        return "(verified when first published)" if self.status == Status.UP_TO_DATE else "-"

    def row(self) -> dict[str, object]:
        source = source_of(self.plan.target)
        return {
            "target": self.plan.id,
            "vllm": self.plan.target.version,
            "commit": source[0].commit if source else None,
            "patches": None if self.patches is None else {r.patch: r.status for r in self.patches},
            "tag": f"{self.plan.repository}:{self.plan.content_tag}",
            "tags": list(self.plan.tags),
            "digest": self.digest,
            "signature": self.signature,
            "status": self.status.value,
            "failed_at": None if self.failed_at is None else self.failed_at.value,
            "closure": None if self.closure is None else {"verdict": self.closure.verdict, "cell": self.closure.cell()},
            "preflight": None if self.preflight is None else self.preflight.summary(),
            "verify": self.verify_text(),
            "checks": None if self.verified is None else checks_json(self.verified),
            "speed": None
            if self.gate is None
            else {
                "verdict": self.gate.verdict,
                "baseline_of": self.gate.baseline_of,
                "table": self.speed_table,
                "plot": str(self.plot),
            },
            "seconds": round(self.seconds, 1),
            "stages": [s.to_json() for s in self.stages],
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
    digest = ctx.registry.digest(run.plan.repository, run.plan.content_tag)
    if digest is None:
        return True
    log.info(f"{run.plan.id}: {run.plan.content_tag} is already published ({digest}); nothing to build")
    # One published before sparkbuild attached documents gets them now (the engine only if the SBOM is missing).
    attest.attach(lambda: ctx.engine, ctx.registry, run.plan, digest, evidence(ctx, run))
    published = publish.move_tags(ctx.registry, run.plan, digest, signer=ctx.opts.signer)
    run.digest, run.status, run.signature = digest, Status.UP_TO_DATE, published.signature
    return False


def preflight_build(ctx: Context, run: TargetRun) -> bool:
    """Before the long compile: the runtime's dependency closure for the image's platform
    (``builder.closure``), vLLM's own configure for the target's arch list, every unit's code audited
    for the GPU, and the patched units compiled and checked (``builder.preflight``). A failure stops
    the target here, naming the wheel or the units; a vLLM stage built earlier needs none."""
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
    run.status = Status.BUILDING
    result = build.build(ctx.engine, run.plan, ctx.opts, ctx.registry, check_first=False)
    run.image, run.stages = result.image, result.stages
    return True


def verify_image(ctx: Context, run: TargetRun) -> bool:
    assert run.image is not None
    run.status = Status.VERIFYING
    target = run.plan.target
    gpus = target.profile == "spark"
    first = ctx.opts.out / run.plan.id / "verify.json"
    run.verified = verify.verify_all(ctx.engine, run.image, target.checks, first, cache=ctx.opts.cache, gpus=gpus)
    run.result = run.verified.first
    run.verified.require()
    if run.result is not None and run.result.benchmark is not None:
        judge_speed(ctx, run, run.result.benchmark)
    return True


def judge_speed(ctx: Context, run: TargetRun, measured: benchmark.Benchmark) -> None:
    """Compare the image's speed with the baseline of the target's last published image; write the
    gate's answer, the table and the plot beside verify.json."""
    found = baseline.read(ctx.registry, run.plan)
    run.baseline = found.benchmark if found else None
    check = run.plan.target.check
    run.gate = regression.compare(
        measured, run.baseline, threshold_pct=check.bench_threshold_pct, baseline_of=found.image if found else None
    )
    folder = ctx.opts.out / run.plan.id
    run.speed_table = benchreport.table(measured, run.baseline, run.gate, check.model)
    run.plot = benchreport.plot(measured, run.baseline, folder, title=f"{run.plan.id} ({check.name}): vllm bench serve")
    fsutil.write_text(folder / "speed.json", json.dumps(run.gate.to_json(), indent=2) + "\n")
    log.info(f"{run.speed_table}\nplot: {run.plot}")


def publish_image(ctx: Context, run: TargetRun) -> bool:
    assert run.image is not None
    run.status = Status.PUBLISHING
    regressed = run.gate is not None and run.gate.verdict == "regressed"
    hold = regressed and run.plan.target.check.bench_hold_tags
    # Held: pushed by digest with its documents, no readable tag and not last-good.
    held_plan = dataclasses.replace(run.plan, tags=()) if hold else run.plan
    published = publish.push(
        ctx.engine, ctx.registry, held_plan, run.image, verified=not hold, evidence=evidence(ctx, run), signer=ctx.opts.signer
    )
    run.digest, run.status, run.signature = published.digest, Status.PUBLISHED, published.signature
    if run.gate is not None and run.result is not None and run.result.benchmark is not None:
        following = regression.next_baseline(run.result.benchmark, run.baseline, run.gate)
        baseline.attach(ctx.registry, run.plan, published.digest, following, referrers.created_now())
    if regressed:
        assert run.gate is not None
        run.status = Status.REGRESSED
        held = f"; readable tags not moved ({', '.join(run.plan.tags)})" if hold else ""
        run.error = f"speed regressed against {run.gate.baseline_of}: {run.gate.reason()}{held}"
        log.error(f"{run.plan.id}: {run.error}")
    return True


def evidence(ctx: Context, run: TargetRun) -> attest.Evidence:
    return attest.Evidence.of(ctx.opts, run.plan, build.local_ref(run.plan), run.started)


TARGET_STAGES: tuple[TargetStage, ...] = (
    find_published,
    check_patches,
    preflight_build,
    build_image,
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
        run_lane(ctx, runs, TARGET_STAGES)
    return runs


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


def verified_cell(verified: verify.Verified) -> str:
    """The first check as ``verify_cell`` shows it, then each further check's answers and kernels;
    a target with one check reads as before."""
    parts = []
    for name in verified.checks:
        found = verified.results.get(name)
        text = "FAILED" if found is None else verify_cell(found) if name == verified.checks[0] else _answers(found)
        if found is not None and name in verified.failures:
            text = f"FAILED ({text})"
        if name in verified.skipped:
            text = "SKIPPED on this host"
        parts.append(text if len(verified.checks) == 1 else f"{name}: {text}")
    return "; ".join(parts)


def _answers(result: verify.VerifyResult) -> str:
    text = f"{sum(a.ok for a in result.answers)}/{len(result.answers)} answers"
    if result.numbers:
        moved = sum(len(n.violations) for n in result.numbers)
        text += ", logprobs as recorded" if not moved else f", logprobs MOVED at {moved} position(s)"
    if result.kernels:
        text += f", {kernelpath.text(result.kernels)}"
    return text + kinds_text(result)


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
                "log": str(folder / verify.SERVER_LOG) if failed and folder is not None else None,
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
