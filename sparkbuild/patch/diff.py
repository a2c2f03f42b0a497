"""Patches that are unified diffs, applied with ``git apply`` (3-way in a git checkout) on a scratch
copy of the files they touch, so the overlay, not the tree, gets the result."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.patch.overlay import Edit, Outcome, Overlay
from sparkbuild.util import cmd

_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_FAILED = re.compile(r"error: patch failed: (.+):(\d+)")
_NOT_APPLY = re.compile(r"error: (.+): patch does not apply")


@dataclass(frozen=True)
class DiffFile:
    old: str | None
    new: str | None
    hunks: tuple[tuple[int, str], ...]


def parse(text: str) -> tuple[DiffFile, ...]:
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
            old, new, hunks = _path(line[4:]), None, []
        elif line.startswith("+++ "):
            new = _path(line[4:])
        elif m := _HUNK.match(line):
            hunks.append((int(m.group(1)), line.split(" @@")[0] + " @@"))
    flush()
    return tuple(files)


def _path(text: str) -> str | None:
    path = text.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    return path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path


def files_of(diff: Path) -> tuple[str, ...]:
    """The tree files a diff reads or writes."""
    return tuple(sorted({p for f in parse(diff.read_text(encoding="utf-8")) for p in (f.old, f.new) if p is not None}))


def run(diff: Path, overlay: Overlay, is_git: bool) -> Outcome:
    text = diff.read_text(encoding="utf-8")
    files = parse(text)
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
            return _edits(files, work, overlay, "applies cleanly")
        if _git_apply(work, diff, "--check", "--reverse").returncode == 0:
            return Outcome("upstream", "the change is already in the tree (the diff applies in reverse)")
        if is_git and _three_way(work, diff, overlay.root):
            return _edits(files, work, overlay, "applies with a 3-way merge")
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


def _edits(files: tuple[DiffFile, ...], work: Path, overlay: Overlay, detail: str) -> Outcome:
    edits = []
    for f in files:
        path = f.new or f.old
        assert path is not None
        before = overlay.read(path) if overlay.exists(path) else ""
        after = (work / path).read_bytes().decode("utf-8") if (work / path).exists() else ""
        edits.append(Edit(path, before, after))
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
