"""The release-candidate lane: notice vLLM's newest release candidate, say at once whether the
patch set holds on it, then build, verify and publish it under its version and ``rc`` tags.

What was done is remembered in the cache (``rc/state.json``): a candidate whose commit and
image are unchanged, and whose image is still in the registry, is not checked or built again.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.lanes import doctor, pipeline, resolve
from sparkbuild.lanes.pipeline import Context, TargetRun
from sparkbuild.plan import companions, matrix, plan
from sparkbuild.plan.matrix import GitSource, Target
from sparkbuild.upstream import gitrepo
from sparkbuild.upstream.externals import External

# Where the rc lane's tests and callers have always found them.
from sparkbuild.upstream.gitrepo import Candidate as Candidate
from sparkbuild.upstream.gitrepo import newest_candidate as newest_candidate
from sparkbuild.util import fsutil, log, runlock, yamlsrc


def for_candidate(target: Target, candidate: Candidate, found: tuple[External, ...] | None = None) -> Target:
    """The rc target built from ``candidate`` (see ``matrix.at_commit`` for what each profile does)."""
    source = GitSource(repo=candidate.repo, ref=candidate.tag, commit=candidate.commit)
    return matrix.at_commit(target, source, candidate.version, found)


# --- what was done ---------------------------------------------------------------------------


def state_file(opts: Options) -> Path:
    return opts.cache / "rc" / "state.json"


def _load_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    delete = "delete it to start the rc lane afresh"
    try:
        data = json.loads(yamlsrc.read_text(path, "rc state file", 4 * 1024 * 1024))
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: not JSON ({str(exc)[:120]}); {delete}") from None
    targets = data.get("targets", {}) if isinstance(data, dict) else None
    if not isinstance(targets, dict) or not all(isinstance(t, dict) for t in targets.values()):
        raise ConfigError(f"{path}: not an rc state file (no mapping of targets); {delete}")
    state: dict[str, Any] = data
    return state


def remembered(state: dict[str, Any]) -> pipeline.TargetStage:
    """A stage that stops a target the lane already published for this commit and image."""

    def stage(ctx: Context, run: TargetRun) -> bool:
        done = state.get("targets", {}).get(run.plan.id)
        candidate = run.plan.target.candidate
        if not done or candidate is None or done.get("commit") != candidate.commit:
            return True
        if done.get("content_tag") != run.plan.content_tag or not done.get("digest"):
            return True
        if ctx.registry.digest(run.plan.repository, run.plan.content_tag) != done["digest"]:
            log.info(f"{run.plan.id}: {run.plan.content_tag} is gone from the registry; building it again")
            return True
        log.info(
            f"{run.plan.id}: {candidate.ref} ({(candidate.commit or '')[:12]}) published {done.get('when', '')}; nothing to do"
        )
        run.digest, run.status = done["digest"], pipeline.Status.UP_TO_DATE
        run.patches = tuple(patch.Result(n, s, "remembered") for n, s in done.get("patches", {}).items())
        return False

    return stage


# --- the lane --------------------------------------------------------------------------------


@dataclass
class LaneResult:
    candidate: Candidate | None
    runs: list[TargetRun]
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": None if self.candidate is None else self.candidate.to_json(),
            "dry_run": self.dry_run,
            "targets": [r.row() for r in self.runs],
        }


def lane_stages(state: dict[str, Any], dry_run: bool) -> tuple[pipeline.TargetStage, ...]:
    """The rc lane's stages. The patch check comes first here (the nightly looks for a published
    image first): saying whether the patches hold on a new candidate is this lane's first job; the
    compile's preflight comes next, so a candidate that cannot serve the GPU fails in minutes."""
    if dry_run:
        return (pipeline.check_patches,)
    return (
        remembered(state),
        pipeline.check_patches,
        pipeline.preflight_build,
        pipeline.find_published,
        pipeline.build_image,
        pipeline.predict_startup,
        pipeline.verify_image,
        pipeline.publish_image,
    )


def rc(opts: Options, *, dry_run: bool = False, table_to_stderr: bool = False) -> LaneResult:
    """Find the newest candidate; patch-check it for every rc target; unless ``dry_run``, build,
    verify and publish it. Raises LaneFailed when a target fails (a conflict included)."""
    m = plan.load_matrix(opts)
    targets = plan.lane_targets(m, opts, "rc")
    repos = sorted({t.vllm.repo or m.upstreams["vllm"] for t in targets})
    if len(repos) != 1:
        raise ConfigError(f"{opts.matrix}: rc targets name different vLLM repositories ({', '.join(repos)}); use one")
    with log.step(f"Looking for a release candidate in {repos[0]}"):
        candidate = newest_candidate(gitrepo.ls_remote(repos[0]))
    if candidate is None:
        print(f"no release candidate newer than the newest release in {repos[0]}; nothing to do", flush=True)
        result = LaneResult(None, [], dry_run)
        # An empty summary, not none: a fanned-out run's merged table says "nothing to do" for it.
        fsutil.write_text(opts.out / "summary.json", "[]\n")
        fsutil.write_text(opts.out / "rc.json", json.dumps(result.to_json(), indent=2) + "\n")
        return result
    log.info(f"candidate: {candidate.tag} ({candidate.commit}), newer than {candidate.release or 'any release'}")
    spark = [t for t in targets if t.profile == "spark"]
    if spark:
        # The candidate's own FlashInfer and CUTLASS against the ones the rc targets build: a drift is
        # a plan error now, not a pip check hours into the compile (sparkbuild.plan.companions).
        named = resolve.companions_at(opts, candidate.repo, candidate.commit, candidate.tag)
        for t in spark:
            companions.require(t, named)
    found = None
    if spark and not dry_run:
        with log.step(f"External projects of vLLM {candidate.tag}"):
            found = resolve.externals_at(opts, candidate.repo, candidate.commit, {}, m.mirrored)
    plans = [plan.plan_target(for_candidate(t, candidate, found), m.patch_folders, opts) for t in targets]
    if not dry_run:
        with log.step("Checking this host"):
            doctor.require([p.target for p in plans], opts)
    runs = [TargetRun(p) for p in plans]
    path = state_file(opts)
    result = LaneResult(candidate, runs, dry_run)
    intro = f"Release candidate {candidate.tag} ({candidate.commit[:12]}), newest release {candidate.release or '-'}\n\n"
    with runlock.run(opts.cache, wait=opts.wait):
        state = _load_state(path)
        stages = lane_stages(state, dry_run)
        try:
            with (
                pipeline.finishing(opts, "rc", runs, table_to_stderr=table_to_stderr, intro=intro),
                pipeline.open_registry(opts) as registry,
                tempfile.TemporaryDirectory(prefix="sparkbuild-rc-") as work,
            ):
                ctx = Context(opts, registry, Path(work), m.patch_folders)
                if not dry_run:
                    pipeline.check_disk(ctx, runs)
                started = datetime.now(UTC)
                pipeline.run_lane(ctx, runs, stages, f" at {candidate.tag}")
                if not dry_run:
                    pipeline.keep(ctx, "rc", runs, started)
        finally:
            # What was published is remembered whatever stopped the lane.
            if not dry_run:
                _remember(path, state, candidate, runs)
            fsutil.write_text(opts.out / "rc.json", json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _remember(path: Path, state: dict[str, Any], candidate: Candidate, runs: list[TargetRun]) -> None:
    done = dict(state.get("targets", {}))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for run in runs:
        if run.status not in pipeline.DONE or run.digest is None:
            continue
        if (
            run.status == pipeline.Status.UP_TO_DATE
            and run.plan.id in done
            and done[run.plan.id].get("commit") == candidate.commit
        ):
            continue
        done[run.plan.id] = {
            "tag": candidate.tag,
            "commit": candidate.commit,
            "content_tag": run.plan.content_tag,
            "digest": run.digest,
            "patches": {r.patch: r.status for r in run.patches or ()},
            "when": when,
        }
    fsutil.write_text(path, json.dumps({"last_candidate": candidate.to_json(), "targets": done}, indent=2) + "\n")
