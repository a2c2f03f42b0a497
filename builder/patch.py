"""The patch stage: what each folder of ``patches/`` does to a source tree, and applying the set.

A patch is ``patches/<name>/patch.yaml`` (what it fixes, why, for which component and versions, how
to tell it is already upstream) plus its change: ``change.diff`` (applied with ``git apply``, 3-way
when the tree is a git checkout) or a named rule from ``patch_rules`` for changes that must follow
patterns rather than lines.

Every patch gets one status per tree: ``applies``, ``upstream`` (the fix is already there),
``not-applicable`` (outside its versions, another component, or the file is not in this layout) or
``conflict`` (with the file and hunk that failed). Patches run in name order on an in-memory overlay
of the tree, each seeing the ones before it; the tree itself is written only when every patch is
``applies``, ``upstream`` or ``not-applicable``. A conflict therefore leaves the tree untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from builder import cmd, fsutil, patch_rules, validate, yamlsrc
from builder.errors import ConfigError, FatalError, PatchError
from builder.patch_rules import Outcome, Overlay

Status = Literal["applies", "upstream", "not-applicable", "conflict"]
STATUSES: tuple[Status, ...] = ("applies", "upstream", "not-applicable", "conflict")
COMPONENTS = ("vllm", "flashinfer", "triton")
META = "patch.yaml"
META_KEYS = ("summary", "why", "component", "versions", "upstream", "change")
UPSTREAM_KEYS = ("fixed_in", "links", "detect")
DETECT_KEYS = ("file", "contains")
CHANGE_KEYS = ("diff", "rule")
RECORD = ".sparkbuild-patches.json"


def digest(patches_dir: Path, name: str) -> str:
    """sha256 over every file of the patch folder (relative path and content), in sorted order."""
    folder = patches_dir / name
    h = hashlib.sha256()
    for path in fsutil.files(folder):
        h.update(f"\0{path.relative_to(folder).as_posix()}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


# --- metadata --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Detect:
    """The fix is upstream when ``file`` contains ``contains``."""

    file: str
    contains: str


@dataclass(frozen=True)
class Patch:
    name: str
    folder: Path
    summary: str
    why: str
    component: str
    versions: SpecifierSet
    fixed_in: str | None
    links: tuple[str, ...]
    detect: tuple[Detect, ...]
    diff: Path | None
    rule: str | None


def load(patches_dir: Path, names: tuple[str, ...] | None = None) -> tuple[Patch, ...]:
    """Every patch folder (or only ``names``), in name order. Every folder is a patch: one without a
    ``patch.yaml`` is an error, not a patch silently left out."""
    if not patches_dir.is_dir():
        raise ConfigError(f"{patches_dir}: no patches folder; pass --patches DIR")
    available = sorted(p.name for p in patches_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    for name in names or ():
        if name not in available:
            raise ConfigError(f"unknown patch '{name}' in {patches_dir}.{validate.suggest(name, available)}")
    return tuple(load_one(patches_dir / name) for name in available if not names or name in names)


def load_one(folder: Path) -> Patch:
    if folder.is_symlink():
        raise ConfigError(f"{folder}: a symlink; a patch is a folder of its patches folder")
    if not (folder / META).is_file():
        problem = "is not a file" if (folder / META).exists() else "is missing"
        raise ConfigError(f"{folder}: its {META} {problem}; every folder of the patches folder is a patch (see README)")
    fsutil.files(folder)  # refuses symlinks out of the folder
    doc = yamlsrc.load(folder / META, META)
    data = validate.mapping(doc, (), doc.data, META_KEYS)
    for key in ("summary", "why", "component", "versions", "upstream", "change"):
        validate.require(doc, (), data, key)
    component = validate.choice(COMPONENTS)(doc, ("component",), data["component"])
    try:
        versions = SpecifierSet(validate.text(doc, ("versions",), data["versions"]))
    except InvalidSpecifier:
        raise doc.fail(("versions",), f"{data['versions']!r} is not a version specifier (for example '>=0.11,<0.19')") from None
    upstream = validate.mapping(doc, ("upstream",), data["upstream"], UPSTREAM_KEYS)
    links = validate.list_of(validate.text)(doc, ("upstream", "links"), validate.require(doc, ("upstream",), upstream, "links"))
    detects = validate.list_of_maps(doc, ("upstream", "detect"), upstream.get("detect") or [])
    detect = tuple(_detect(doc, ("upstream", "detect", i), d) for i, d in enumerate(detects))
    change = validate.mapping(doc, ("change",), data["change"], CHANGE_KEYS)
    if len(change) != 1:
        raise doc.fail(("change",), "give exactly one of 'diff: FILE' or 'rule: NAME'")
    diff = rule = None
    if "diff" in change:
        diff = folder / validate.line(doc, ("change", "diff"), change["diff"])
        if not diff.resolve().is_relative_to(folder.resolve()):
            raise doc.fail(("change", "diff"), f"{diff} is outside the patch folder {folder}")
        if not diff.is_file():
            raise doc.fail(("change", "diff"), f"{diff} does not exist")
    else:
        rule = validate.text(doc, ("change", "rule"), change["rule"])
        if rule not in patch_rules.RULES:
            raise doc.fail(("change", "rule"), f"unknown rule '{rule}'.{validate.suggest(rule, patch_rules.RULES)}")
    fixed_in = upstream.get("fixed_in")
    return Patch(
        name=folder.name,
        folder=folder,
        summary=validate.text(doc, ("summary",), data["summary"]),
        why=validate.text(doc, ("why",), data["why"]).strip(),
        component=component,
        versions=versions,
        fixed_in=None if fixed_in is None else validate.text(doc, ("upstream", "fixed_in"), fixed_in),
        links=links,
        detect=detect,
        diff=diff,
        rule=rule,
    )


_inside_tree = validate.pattern(r"(?!/)(?!.*(?:^|/)\.\.(?:/|$))[^\x00]+", "a path inside the source tree", "CMakeLists.txt")


def _detect(doc: yamlsrc.Located, path: yamlsrc.DocPath, value: Any) -> Detect:
    d = validate.mapping(doc, path, value, DETECT_KEYS)
    return Detect(
        file=_inside_tree(doc, (*path, "file"), validate.require(doc, path, d, "file")),
        contains=validate.text(doc, (*path, "contains"), validate.require(doc, path, d, "contains")),
    )


# --- checking --------------------------------------------------------------------------------


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
    results = []
    for p in patches:
        outcome = _gate(p, parsed, component) or _run(p, overlay, tree)
        if outcome.status == "applies":
            for edit in outcome.edits:
                overlay.write(edit.path, edit.after)
        results.append(Result(p.name, outcome.status, outcome.detail, tuple(e.path for e in outcome.edits)))
    return Report(source=tree, component=component, version=version, results=tuple(results), overlay=overlay)


def _gate(p: Patch, version: Version, component: str) -> Outcome | None:
    if p.component != component:
        return Outcome("not-applicable", f"a {p.component} patch; this is a {component} tree")
    if not p.versions.contains(version, prereleases=True):
        return Outcome("not-applicable", f"{version} is outside {p.versions}")
    return None


def _run(p: Patch, overlay: Overlay, tree: Path) -> Outcome:
    try:
        return _run_one(p, overlay, tree)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"patch {p.name}: a file it reads is not UTF-8 ({exc.reason} at byte {exc.start}); fix {p.folder}"
        ) from None


def _run_one(p: Patch, overlay: Overlay, tree: Path) -> Outcome:
    for d in p.detect:
        if overlay.exists(d.file) and d.contains in overlay.read(d.file):
            return Outcome("upstream", f"{d.file} already has {d.contains!r}")
    if p.rule is not None:
        return patch_rules.RULES[p.rule](overlay, p.folder)
    assert p.diff is not None
    return _run_diff(p.diff, overlay, is_git=(tree / ".git").exists())


# --- unified diffs ---------------------------------------------------------------------------

_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_FAILED = re.compile(r"error: patch failed: (.+):(\d+)")
_NOT_APPLY = re.compile(r"error: (.+): patch does not apply")


@dataclass(frozen=True)
class DiffFile:
    old: str | None
    new: str | None
    hunks: tuple[tuple[int, str], ...]


def parse_diff(text: str) -> tuple[DiffFile, ...]:
    files: list[DiffFile] = []
    old: str | None = None
    new: str | None = None
    hunks: list[tuple[int, str]] = []

    def flush() -> None:
        if old is not None or new is not None:
            files.append(DiffFile(old, new, tuple(hunks)))

    for line in text.splitlines():
        if line.startswith("--- "):
            flush()
            old, new, hunks = _diff_path(line[4:]), None, []
        elif line.startswith("+++ "):
            new = _diff_path(line[4:])
        elif m := _HUNK.match(line):
            hunks.append((int(m.group(1)), line.split(" @@")[0] + " @@"))
    flush()
    return tuple(files)


def _diff_path(text: str) -> str | None:
    path = text.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    return path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path


def _run_diff(diff: Path, overlay: Overlay, is_git: bool) -> Outcome:
    text = diff.read_text(encoding="utf-8")
    files = parse_diff(text)
    missing = [f.old for f in files if f.old is not None and not overlay.exists(f.old)]
    if missing:
        return Outcome("not-applicable", f"{missing[0]} does not exist in this layout")
    with tempfile.TemporaryDirectory(prefix="sparkbuild-patch-") as tmp:
        work = Path(tmp) / "tree"
        for f in files:
            if f.old is not None:
                overlay.materialize(f.old, work)
        if _git_apply(work, diff, "--check").returncode == 0:
            _git_apply(work, diff).check_returncode()
            return _diff_edits(files, work, overlay, "applies cleanly")
        if _git_apply(work, diff, "--check", "--reverse").returncode == 0:
            return Outcome("upstream", "the change is already in the tree (the diff applies in reverse)")
        if is_git and _three_way(work, diff, overlay.root):
            return _diff_edits(files, work, overlay, "applies with a 3-way merge")
        failed = _git_apply(work, diff, "--check", "--verbose")
    return Outcome("conflict", _conflict_detail(failed.stderr, files))


def _git_apply(work: Path, diff: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # A ceiling stops git from finding a repository above the scratch folder and applying there.
    env = {"GIT_CEILING_DIRECTORIES": str(work.parent)}
    work.mkdir(parents=True, exist_ok=True)
    return cmd.run(["git", "apply", *flags, diff.resolve()], cwd=work, env=env, capture=True, check=False)


def _three_way(work: Path, diff: Path, source: Path) -> bool:
    """``git apply --3way`` with the checkout's objects, so the diff's preimage blobs can be found."""
    env = {"GIT_CEILING_DIRECTORIES": str(work.parent)}
    cmd.run(["git", "init", "-q"], cwd=work, env=env, capture=True)
    objects = source / ".git" / "objects"
    if objects.is_dir():
        (work / ".git" / "objects" / "info" / "alternates").write_text(f"{objects.resolve()}\n", encoding="utf-8")
    cmd.run(["git", "add", "-A"], cwd=work, env=env, capture=True)
    applied = cmd.run(["git", "apply", "--3way", diff.resolve()], cwd=work, env=env, capture=True, check=False)
    return applied.returncode == 0


def _diff_edits(files: tuple[DiffFile, ...], work: Path, overlay: Overlay, detail: str) -> Outcome:
    edits = []
    for f in files:
        path = f.new or f.old
        assert path is not None
        before = overlay.read(path) if overlay.exists(path) else ""
        after = (work / path).read_bytes().decode("utf-8") if (work / path).exists() else ""
        edits.append(patch_rules.Edit(path, before, after))
    return Outcome("applies", detail, tuple(edits))


def _conflict_detail(stderr: str, files: tuple[DiffFile, ...]) -> str:
    if m := _FAILED.search(stderr):
        path, line = m.group(1), int(m.group(2))
        for f in files:
            if path in (f.old, f.new):
                for index, (start, header) in enumerate(f.hunks, 1):
                    if start == line:
                        return f"{path}: hunk {index} of {len(f.hunks)} ({header}) does not apply"
        return f"{path}: hunk at line {line} does not apply"
    if m := _NOT_APPLY.search(stderr):
        return f"{m.group(1)}: does not apply"
    return stderr.strip().splitlines()[-1] if stderr.strip() else "git apply failed"


# --- applying --------------------------------------------------------------------------------


def apply(report: Report) -> tuple[str, ...]:
    """Write the overlay to the tree, or nothing if any patch conflicts. Returns the files written."""
    if not report.ok:
        conflicts = "; ".join(f"{r.patch}: {r.detail}" for r in report.results if r.status == "conflict")
        raise PatchError(f"not applied, the tree is untouched. Conflicts: {conflicts}")
    written = report.overlay.commit()
    record = report.source / RECORD
    record.write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return written


# --- output ----------------------------------------------------------------------------------

_MARK = {"applies": "+", "upstream": "=", "not-applicable": "-", "conflict": "!"}


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


def default_dir() -> Path:
    return Path(os.environ.get("SPARKBUILD_PATCHES", Path(__file__).resolve().parent.parent / "patches"))


def main(argv: list[str] | None = None) -> int:
    """``python -m builder.patch check|apply``: the patch stage inside a container's source stage.

    Needs only the standard library, PyYAML, packaging and git (no click, no Docker SDK), so a
    source stage runs it from a copy of these modules. ``sparkbuild patch`` is the same for people.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m builder.patch")
    parser.add_argument("action", choices=("check", "apply"))
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--version", required=True, help="vLLM version of the tree")
    parser.add_argument("--patches", type=Path, default=default_dir())
    parser.add_argument("--patch", dest="names", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        report = check(args.source, load(args.patches, tuple(args.names) or None), args.version)
        print(table(report), flush=True)
        if args.action == "apply":
            print(f"patched {len(apply(report))} file(s); record in {args.source / RECORD}", flush=True)
        elif not report.ok:
            raise PatchError("a patch conflicts with this tree (see above)")
    except FatalError as exc:  # a conflict and a broken patch folder alike: one line, its exit code
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
