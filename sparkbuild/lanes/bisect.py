"""Bisect: the first upstream vLLM commit at which a stage fails.

The same search as ``git bisect``, over ``git rev-list --ancestry-path GOOD..BAD`` in the local
mirror: ``patch`` (default, seconds per step) checks the patch set on each tree; ``build`` and
``verify`` run one target's pipeline on the commit (the patch check comes first in both).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError, FatalError
from sparkbuild.lanes import pipeline
from sparkbuild.plan import matrix, plan
from sparkbuild.plan.matrix import GitSource, Matrix, Target
from sparkbuild.upstream import gitrepo
from sparkbuild.util import log

Stage = Literal["patch", "build", "verify"]
STAGES: tuple[Stage, ...] = ("patch", "build", "verify")


@dataclass(frozen=True)
class Step:
    commit: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"commit": self.commit, "ok": self.ok, "detail": self.detail}


@dataclass
class Result:
    repo: str
    good: str
    bad: str
    stage: Stage
    first_bad: str | None = None
    subject: str = ""
    detail: str = ""
    candidates: int = 0
    steps: list[Step] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "good": self.good,
            "bad": self.bad,
            "stage": self.stage,
            "first_bad": self.first_bad,
            "subject": self.subject,
            "detail": self.detail,
            "commits_in_range": self.candidates,
            "steps": [s.to_json() for s in self.steps],
        }

    def text(self) -> str:
        lines = [f"  {'ok ' if s.ok else 'BAD'} {s.commit[:12]}  {s.detail}" for s in self.steps]
        head = f"{self.first_bad} is the first commit where `{self.stage}` fails" if self.first_bad else "no failing commit"
        return "\n".join(
            [
                f"bisect {self.good}..{self.bad} in {self.repo} ({self.candidates} commits, {len(self.steps)} tested)",
                *lines,
                "",
                head,
                f"    {self.subject}" if self.subject else "",
                f"    {self.detail}" if self.detail else "",
            ]
        ).rstrip()


Probe = Callable[[str], tuple[bool, str]]


def search(commits: list[str], probe: Probe, steps: list[Step]) -> str:
    """The first commit of ``commits`` (oldest first; the last one fails, the one before the
    first passes) at which ``probe`` fails, in about log2(len) probes."""
    lo, hi = -1, len(commits) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, detail = probe(commits[mid])
        steps.append(Step(commits[mid], ok, detail))
        if ok:
            lo = mid
        else:
            hi = mid
    return commits[hi]


def bisect(opts: Options, good: str, bad: str, stage: Stage = "patch", patch_names: tuple[str, ...] = ()) -> Result:
    m = plan.load_matrix(opts)
    target = _target(m, opts) if stage != "patch" or opts.only else None
    repo = (target.vllm.repo if target else None) or m.upstreams["vllm"]
    mirror = gitrepo.Mirror(opts.cache, repo)
    with log.step(f"Fetching {repo} into {mirror.path}"):
        mirror.fetch()
    good_sha, bad_sha = _commit(mirror, good, "--good"), _commit(mirror, bad, "--bad")
    if not mirror.is_ancestor(good_sha, bad_sha):
        raise ConfigError(f"--good {good} ({good_sha[:12]}) is not an ancestor of --bad {bad} ({bad_sha[:12]})")
    commits = mirror.commits_between(good_sha, bad_sha)
    result = Result(repo=repo, good=good, bad=bad, stage=stage, candidates=len(commits))
    names = patch_names or (target.patches if target else ())
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sparkbuild-bisect-")))
        # One registry for every probe; the patch stage needs none.
        ctx = (
            None
            if stage == "patch"
            else pipeline.Context(opts, stack.enter_context(pipeline.open_registry(opts)), work, m.patch_folders)
        )
        probe = _probe(opts, m, mirror, stage, target, names, work, ctx)
        for name, sha, want in (("--bad", bad_sha, False), ("--good", good_sha, True)):
            ok, detail = probe(sha)
            result.steps.append(Step(sha, ok, detail))
            if ok != want:
                raise ConfigError(
                    f"{name} {bad if want is False else good} ({sha[:12]}) {'passes' if ok else 'fails'} `{stage}`: {detail}; "
                    f"bisect needs a good commit that passes and a bad one that fails"
                )
        first = search(commits, probe, result.steps)
    result.first_bad, result.subject = first, mirror.subject(first)
    result.detail = next(s.detail for s in result.steps if s.commit == first)
    return result


def _commit(mirror: gitrepo.Mirror, ref: str, option: str) -> str:
    sha = mirror.rev_parse(ref)
    if sha is None:
        raise ConfigError(f"{option} {ref}: no such tag, branch or commit in {mirror.url}")
    return sha


def _target(m: Matrix, opts: Options) -> Target:
    chosen = plan.select(m.targets, opts.only, opts.profile)
    if len(chosen) != 1:
        raise ConfigError(f"bisect builds one target: narrow --only to one of {', '.join(t.id for t in chosen)}")
    return chosen[0]


def _probe(
    opts: Options,
    m: Matrix,
    mirror: gitrepo.Mirror,
    stage: Stage,
    target: Target | None,
    names: tuple[str, ...],
    work: Path,
    ctx: pipeline.Context | None,
) -> Probe:
    patches = patch.load(m.patch_folders, names or None)
    cache: dict[str, tuple[bool, str]] = {}

    def version(commit: str) -> str:
        found = mirror.version_at(commit)
        if found is None:
            raise ConfigError(f"{mirror.url}: no version tag (vX.Y.Z) is reachable from {commit[:12]}; give an older --good")
        return found

    def check(commit: str) -> tuple[bool, str]:
        tree = mirror.checkout(commit, work / "tree")
        report = patch.check(tree, patches, version(commit))
        log.info(patch.table(report))
        return report.ok, pipeline.patch_cell(report.results)

    def run(commit: str) -> tuple[bool, str]:
        assert target is not None and ctx is not None
        at = matrix.at_commit(target, GitSource(repo=mirror.url, ref=commit, commit=commit), version(commit))
        p = plan.plan_target(at, m.patch_folders, opts)
        stages = (pipeline.check_patches, pipeline.build_image) + ((pipeline.verify_image,) if stage == "verify" else ())
        r = pipeline.TargetRun(p)
        pipeline.run_target(ctx, r, stages)
        return r.error is None, r.error or f"{stage} passed ({p.content_tag})"

    def probe(commit: str) -> tuple[bool, str]:
        if commit not in cache:
            try:
                cache[commit] = check(commit) if stage == "patch" else run(commit)
            except FatalError as exc:
                if isinstance(exc, ConfigError):
                    raise
                cache[commit] = (False, str(exc))
        return cache[commit]

    return probe
