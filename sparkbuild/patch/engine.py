"""Checking a patch set on a tree, and applying it all or nothing.

Patches run in name order on an in-memory overlay of the tree, each seeing the ones before it;
the tree is written only when no patch conflicts. Applying records what was done in
``.sparkbuild-patches.json``; applying again changes nothing, the record included: a patch that
reads ``applied`` keeps the entry of the apply that made its change.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from sparkbuild.errors import ConfigError, PatchError
from sparkbuild.patch import diff, pullrequest, rules
from sparkbuild.patch.meta import Patch
from sparkbuild.patch.overlay import STATUSES, Outcome, Overlay, Status
from sparkbuild.util import fsutil

RECORD = ".sparkbuild-patches.json"


@dataclass(frozen=True)
class Result:
    patch: str
    status: Status
    detail: str
    files: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"patch": self.patch, "status": self.status, "detail": self.detail, "files": list(self.files)}


@dataclass(frozen=True)
class Report:
    source: Path
    component: str
    version: str
    results: tuple[Result, ...]
    overlay: Overlay = field(repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return all(r.status != "conflict" for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "component": self.component,
            "version": self.version,
            "ok": self.ok,
            "results": [r.to_json() for r in self.results],
        }


def check(tree: Path, patches: tuple[Patch, ...], version: str, component: str = "vllm") -> Report:
    """Run every patch on an overlay of ``tree``; the tree is only read."""
    if not tree.is_dir():
        raise ConfigError(f"--source {tree}: no such folder")
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise ConfigError(f"{version!r} is not a version; pass --as-version X.Y.Z") from None
    overlay = Overlay(tree)
    recorded = _recorded(tree)
    results = []
    for p in patches:
        outcome = _gate(p, parsed, component) or _run(p, overlay, tree, recorded)
        if outcome.status == "applies":
            for edit in outcome.edits:
                overlay.write(edit.path, edit.after)
        # The files that hold the change: those it writes, or those that already have it (applied).
        files = tuple(e.path for e in outcome.edits) or outcome.files
        results.append(Result(p.name, outcome.status, outcome.detail, files))
    return Report(source=tree, component=component, version=version, results=tuple(results), overlay=overlay)


def _gate(p: Patch, version: Version, component: str) -> Outcome | None:
    if p.component != component:
        return Outcome("not-applicable", f"a {p.component} patch; this is a {component} tree")
    if not p.versions.contains(version, prereleases=True):
        why = f": {p.range_why}" if p.range_why else ""
        return Outcome("not-applicable", f"{version} is outside {p.versions}{why}")
    return None


def _run(p: Patch, overlay: Overlay, tree: Path, recorded: dict[str, dict[str, Any]]) -> Outcome:
    try:
        return _run_one(p, overlay, tree, recorded)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"patch {p.name}: a file it reads is not UTF-8 ({exc.reason} at byte {exc.start}); fix {p.folder}"
        ) from None


def _run_one(p: Patch, overlay: Overlay, tree: Path, recorded: dict[str, dict[str, Any]]) -> Outcome:
    for d in p.detect:
        if overlay.exists(d.file) and d.contains in overlay.read(d.file):
            return Outcome("upstream", f"{d.file} already has {d.contains!r}")
    if p.rule is not None:
        rule = rules.load(p.rule)
        return _declared(rule, p, rule.run(overlay, p.folder))
    if p.pr is not None:
        outcome = pullrequest.run(p.pr, overlay, p.folder)
        files = pullrequest.files(p.folder, p.pr)
    else:
        assert p.diff is not None
        outcome = diff.run(p.diff, overlay, is_git=(tree / ".git").exists())
        files = diff.files_of(p.diff)
    # A diff (or a PR) cannot tell its own result from upstream's; the record of an earlier apply can.
    if outcome.status == "upstream" and recorded.get(p.name, {}).get("status") == "applies":
        return Outcome("applied", f"the change is in the tree, and {RECORD} says sparkbuild applied it", files=files)
    return outcome


def _declared(rule: rules.RuleModule, p: Patch, outcome: Outcome) -> Outcome:
    """``outcome``, unless the rule edited a file outside the globs its module declares in WRITES:
    a plan decides what a patch needs (a source build or upstream's wheel) from that declaration."""
    allowed = re.compile("|".join(f"(?:{fsutil.glob_regex(g)})" for g in rule.writes) or "(?!)")
    outside = [e.path for e in outcome.edits if not allowed.fullmatch(e.path)]
    if outside:
        raise PatchError(
            f"patch {p.name}: rule {rule.name} changed {', '.join(outside)}, outside the files its module declares "
            f"in WRITES ({', '.join(rule.writes) or 'none'}); add them there (a bug in the rule, not in the tree)"
        )
    return outcome


def _recorded(tree: Path) -> dict[str, dict[str, Any]]:
    """The entries of an earlier apply's record, by patch."""
    path = tree / RECORD
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {r["patch"]: r for r in data["results"]}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PatchError(f"{path}: not a sparkbuild patch record ({exc}); delete it, or check the tree out again") from None


def apply(report: Report) -> tuple[str, ...]:
    """Write the overlay to the tree, or nothing if any patch conflicts. Returns the files written.

    The record keeps, for a patch that reads ``applied``, the entry of the apply that changed the
    tree, so a second apply writes nothing at all.
    """
    if not report.ok:
        conflicts = "; ".join(f"{r.patch}: {r.detail}" for r in report.results if r.status == "conflict")
        raise PatchError(f"not applied, the tree is untouched. Conflicts: {conflicts}")
    written = report.overlay.commit()
    path = report.source / RECORD
    old = _recorded(report.source)
    entries = dict(old)
    for r in report.results:
        if not (r.status == "applied" and r.patch in old):
            entries[r.patch] = r.to_json()
    results = [entries[name] for name in sorted(entries)]
    record = {**report.to_json(), "ok": all(e["status"] != "conflict" for e in results), "results": results}
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return written


_MARK = {"applies": "+", "applied": "*", "upstream": "=", "not-applicable": "-", "conflict": "!"}


def table(report: Report) -> str:
    width = max([len(r.patch) for r in report.results] + [5])
    lines = [
        f"{report.component} {report.version}  {report.source}",
        f"  {'patch'.ljust(width)}  {'status'.ljust(14)}  detail",
    ]
    for r in report.results:
        lines.append(f"{_MARK[r.status]} {r.patch.ljust(width)}  {r.status.ljust(14)}  {r.detail}")
    counts = {s: sum(r.status == s for r in report.results) for s in STATUSES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines.append(f"  {summary or 'no patches'}")
    return "\n".join(lines)
