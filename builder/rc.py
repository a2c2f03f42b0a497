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
from pathlib import Path
from typing import Any

from builder import gitrepo, log, matrix, patch, pipeline, plan
from builder.errors import ConfigError

# Where the rc lane's tests and callers have always found them.
from builder.gitrepo import Candidate as Candidate
from builder.gitrepo import newest_candidate as newest_candidate
from builder.matrix import GitSource, Target
from builder.options import Options
from builder.pipeline import Context, TargetRun


def for_candidate(target: Target, candidate: Candidate) -> Target:
    """The rc target built from ``candidate`` (see ``matrix.at_commit`` for what each profile does)."""
    return matrix.at_commit(target, GitSource(repo=candidate.repo, ref=candidate.tag, commit=candidate.commit), candidate.version)


# --- what was done ---------------------------------------------------------------------------


def state_file(opts: Options) -> Path:
    return opts.cache / "rc" / "state.json"


def _load_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc}); delete it to start the rc lane afresh") from None
    return data


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
        run.digest, run.status = done["digest"], "up to date"
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


def rc(opts: Options, *, dry_run: bool = False, table_to_stderr: bool = False) -> LaneResult:
    """Find the newest candidate; patch-check it for every rc target; unless ``dry_run``, build,
    verify and publish it. Raises LaneFailed when a target fails (a conflict included)."""
    start = time.monotonic()
    m = plan.load_matrix(opts)
    targets = plan.lane_targets(m, opts, "rc")
    repos = sorted({t.vllm.repo or m.upstreams["vllm"] for t in targets})
    if len(repos) != 1:
        raise ConfigError(f"{opts.matrix}: rc targets name different vLLM repositories ({', '.join(repos)}); use one")
    with log.step(f"Looking for a release candidate in {repos[0]}"):
        candidate = newest_candidate(gitrepo.ls_remote(repos[0]))
    if candidate is None:
        print(f"no release candidate newer than the newest release in {repos[0]}; nothing to do", flush=True)
        return LaneResult(None, [], dry_run)
    log.info(f"candidate: {candidate.tag} ({candidate.commit}), newer than {candidate.release or 'any release'}")
    plans = [plan.plan_target(for_candidate(t, candidate), m.patches_dir, opts) for t in targets]
    runs = [TargetRun(p) for p in plans]
    path = state_file(opts)
    state = _load_state(path)
    # The patch check comes first here (the nightly looks for a published image first): saying
    # whether the patches hold on a new candidate is this lane's first job.
    full = (
        remembered(state),
        pipeline.check_patches,
        pipeline.find_published,
        pipeline.build_image,
        pipeline.verify_image,
        pipeline.publish_image,
    )
    stages: tuple[pipeline.TargetStage, ...] = (pipeline.check_patches,) if dry_run else full
    with pipeline.open_registry(opts) as registry, tempfile.TemporaryDirectory(prefix="sparkbuild-rc-") as work:
        ctx = Context(opts, registry, Path(work), m.patches_dir)
        for i, run in enumerate(runs, 1):
            with log.step(f"[{i}/{len(runs)}] {run.plan.id} at {candidate.tag}"):
                pipeline.run_target(ctx, run, stages)
    if not dry_run:
        _remember(path, state, candidate, runs)
    result = LaneResult(candidate, runs, dry_run)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "rc.json").write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    intro = f"Release candidate {candidate.tag} ({candidate.commit[:12]}), newest release {candidate.release or '-'}\n\n"
    pipeline.report(opts, "rc", runs, time.monotonic() - start, table_to_stderr=table_to_stderr, intro=intro)
    return result


def _remember(path: Path, state: dict[str, Any], candidate: Candidate, runs: list[TargetRun]) -> None:
    done = dict(state.get("targets", {}))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for run in runs:
        if run.status not in ("published", "up to date") or run.digest is None:
            continue
        if run.status == "up to date" and run.plan.id in done and done[run.plan.id].get("commit") == candidate.commit:
            continue
        done[run.plan.id] = {
            "tag": candidate.tag,
            "commit": candidate.commit,
            "content_tag": run.plan.content_tag,
            "digest": run.digest,
            "patches": {r.patch: r.status for r in run.patches or ()},
            "when": when,
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"last_candidate": candidate.to_json(), "targets": done}, indent=2) + "\n", encoding="utf-8")
