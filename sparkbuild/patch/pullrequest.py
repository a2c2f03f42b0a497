"""Upstream pull requests as patches: ``change: {pr: ...}`` in patch.yaml.

A PR patch names the repository and the PR's number, the commit its change is taken from
(``base``) and, optionally, the PR commit to take (``head``; default: the PR's head now), the
sha256 of that change (``git diff base head``, limited to ``paths`` where given) and optional path
filters. It is fetched with git on the machine that runs sparkbuild (the runner): the PR's ref
(``refs/pull/N/head``, which proves the number), the pinned commits, then the diff, checked against
the pinned sha256 (a mismatch is exit 10 and nothing is kept). What the merge needs is cached by
that sha256 under ``$SPARKBUILD_CACHE/upstream-prs/``: each changed file as it is at ``base`` and
at ``head``, the diff, and a manifest, so a second use reads the cache and reaches no network. A
build's context carries the same files in the patch's folder (``fetched/``), so the source stage
never fetches.

Applying is a three-way merge per file (``git merge-file``: the tree's file, the PR's base, the PR's
head): the PR's change lands wherever the tree has moved around it. The status comes from content
like every patch: ``upstream`` when merging changes nothing (the release holds the change), a
conflict names the file and the first conflicting line ("no longer applies", exit 9).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.errors import SourceError
from sparkbuild.patch.overlay import Edit, Outcome, Overlay
from sparkbuild.util import cmd

CACHE = "upstream-prs"
FETCHED = "fetched"  # the folder a build context gives a PR patch: what fetch() cached
MANIFEST = "pr.json"


@dataclass(frozen=True)
class PullRequest:
    repo: str  # a git URL
    number: int
    base: str  # 40 hex digits
    head: str | None  # 40 hex digits, or None: the PR's head when fetched
    sha256: str  # of the diff base..head, limited to paths
    paths: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"PR #{self.number} of {self.repo}"


def cache_root() -> Path:
    """sparkbuild's cache (``Options.from_env``'s), without importing what Options imports."""
    if os.environ.get("SPARKBUILD_CACHE"):
        return Path(os.environ["SPARKBUILD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparkbuild"


def data(folder: Path, pr: PullRequest) -> Path:
    """Where the PR's files are: the patch folder's ``fetched/`` (a build context), else the cache,
    fetched there first if missing."""
    if (folder / FETCHED / MANIFEST).is_file():
        return folder / FETCHED
    return fetch(pr, cache_root())


def files(folder: Path, pr: PullRequest) -> tuple[str, ...]:
    """The tree files the PR changes (fetched if need be)."""
    manifest = json.loads((data(folder, pr) / MANIFEST).read_text(encoding="utf-8"))
    return tuple(f["path"] for f in manifest["files"])


# --- fetching, on the runner ---------------------------------------------------------------------


def _git(repo: Path, *args: str, check: bool = True) -> str:
    done = cmd.run(["git", "-C", str(repo), *args], capture=True, check=False)
    if check and done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["git failed"])[-1]
        raise SourceError(f"git {' '.join(args[:3])}: {last}")
    return done.stdout


def fetch(pr: PullRequest, cache: Path) -> Path:
    """The PR's change in the cache (fetched once, checked against its sha256); its folder."""
    dest = cache / CACHE / pr.sha256
    if (dest / MANIFEST).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        repo = Path(tmp) / "git"
        cmd.run(["git", "init", "--quiet", str(repo)], capture=True)
        try:
            pr_head = _fetch_commit(repo, pr.repo, f"refs/pull/{pr.number}/head")
        except SourceError as exc:
            raise SourceError(f"{pr.label}: cannot fetch its head (refs/pull/{pr.number}/head): {exc}") from None
        head = pr.head or pr_head
        if head != pr_head:
            _fetch_commit(repo, pr.repo, head, why=f"the pinned head of {pr.label} (its head is now {pr_head[:12]})")
        _fetch_commit(repo, pr.repo, pr.base, why=f"the base of {pr.label}")
        pathspec = ["--", *pr.paths] if pr.paths else []
        diff = _git(repo, "diff", "--no-color", "--no-ext-diff", "--full-index", "--no-renames", pr.base, head, *pathspec)
        if not diff:
            raise SourceError(f"{pr.label}: {pr.base[:12]}..{head[:12]} changes none of {', '.join(pr.paths) or 'its files'}")
        got = hashlib.sha256(diff.encode("utf-8")).hexdigest()
        if got != pr.sha256:
            raise SourceError(
                f"{pr.label}: the diff of {pr.base[:12]}..{head[:12]}{' in ' + ', '.join(pr.paths) if pr.paths else ''} "
                f"has sha256 {got}, the patch pins {pr.sha256}. The PR changed, or the pin is wrong: read the PR, then "
                "pin what `sparkbuild patch pr` prints. Nothing was kept or built"
            )
        work = Path(tmp) / "out"
        changed = _save(repo, pr.base, head, pathspec, work)
        (work / "change.diff").write_text(diff, encoding="utf-8")
        manifest = {"repo": pr.repo, "number": pr.number, "base": pr.base, "head": head, "sha256": got, "files": changed}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if not dest.exists():
            work.replace(dest)
    return dest


def _fetch_commit(repo: Path, url: str, ref: str, why: str = "") -> str:
    done = cmd.run(["git", "-C", str(repo), "fetch", "--quiet", "--no-tags", "--depth", "1", url, ref], capture=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["git fetch failed"])[-1]
        raise SourceError(f"cannot fetch {why or ref} from {url}: {last}")
    return _git(repo, "rev-parse", "FETCH_HEAD").strip()


def _save(repo: Path, base: str, head: str, pathspec: list[str], work: Path) -> list[dict[str, str]]:
    """Each changed file as it is at base and at head, under work/base and work/head."""
    changed = []
    for line in _git(repo, "diff", "--name-status", "--no-renames", base, head, *pathspec).splitlines():
        status, path = line.split("\t", 1)
        for side, commit in (("base", base), ("head", head)):
            if (side, status) in (("base", "A"), ("head", "D")):
                continue
            target = work / side / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_git(repo, "show", f"{commit}:{path}"), encoding="utf-8")
        changed.append({"path": path, "status": status})
    return changed


def pin(repo: str, number: int, base: str, head: str | None, paths: tuple[str, ...]) -> dict[str, object]:
    """The ``change: {pr: ...}`` of patch.yaml for this PR as it is now (fetched, sha256 computed)."""
    with tempfile.TemporaryDirectory(prefix="sparkbuild-pr-") as tmp:
        git = Path(tmp) / "git"
        cmd.run(["git", "init", "--quiet", str(git)], capture=True)
        pr_head = _fetch_commit(git, repo, f"refs/pull/{number}/head")
        chosen = head or pr_head
        if chosen != pr_head:
            _fetch_commit(git, repo, chosen)
        _fetch_commit(git, repo, base)
        pathspec = ["--", *paths] if paths else []
        diff = _git(git, "diff", "--no-color", "--no-ext-diff", "--full-index", "--no-renames", base, chosen, *pathspec)
    spec: dict[str, object] = {"repo": repo, "number": number, "base": base, "head": chosen}
    spec["sha256"] = hashlib.sha256(diff.encode("utf-8")).hexdigest()
    if paths:
        spec["paths"] = list(paths)
    return {"change": {"pr": spec}}


# --- applying: a three-way merge per file ----------------------------------------------------------


def run(pr: PullRequest, overlay: Overlay, folder: Path) -> Outcome:
    where = data(folder, pr)
    manifest = json.loads((where / MANIFEST).read_text(encoding="utf-8"))
    edits: list[Edit] = []
    conflicts: list[str] = []
    for f in manifest["files"]:
        path, status = f["path"], f["status"]
        base = _side(where, "base", path)
        head = _side(where, "head", path)
        current = overlay.read(path) if overlay.exists(path) else None
        if status == "A":
            if current is None:
                edits.append(Edit(path, "", head or ""))
            elif current != head:
                conflicts.append(f"{path}: the PR adds it, and this tree has another file there")
        elif status == "D":
            if current is not None:
                conflicts.append(f"{path}: the PR deletes it; a patch does not delete files (leave the path out with paths:)")
        elif current is None:
            conflicts.append(f"{path}: the PR changes it, and this tree has no such file (moved or renamed?)")
        else:
            merged, regions, first = merge(current, base or "", head or "")
            if regions:
                conflicts.append(f"{path}: {regions} conflicting region(s), the first at line {first}")
            elif merged != current:
                edits.append(Edit(path, current, merged))
    if conflicts:
        return Outcome("conflict", f"{pr.label} no longer applies: {'; '.join(conflicts)}")
    if edits:
        return Outcome("applies", f"{pr.label}: {', '.join(e.path for e in edits)} by a 3-way merge", tuple(edits))
    return Outcome("upstream", f"the change of {pr.label} is in the tree (merging it changes nothing)")


def _side(where: Path, side: str, path: str) -> str | None:
    file = where / side / path
    return file.read_text(encoding="utf-8") if file.is_file() else None


_CONFLICT = re.compile(r"^<{7} ", re.MULTILINE)


def merge(current: str, base: str, head: str) -> tuple[str, int, int]:
    """``git merge-file`` of the PR's base -> head change into ``current``: the result, the number
    of conflicting regions and the line of the first (0 when none)."""
    with tempfile.TemporaryDirectory(prefix="sparkbuild-merge-") as tmp:
        names: dict[str, Path] = {}
        for name, text in (("tree", current), ("base", base), ("pr", head)):
            names[name] = Path(tmp) / name
            names[name].write_bytes(text.encode("utf-8"))
        labels = ["-L", "tree", "-L", "base", "-L", "pr"]
        args: list[str | Path] = ["git", "merge-file", "-p", *labels, names["tree"], names["base"], names["pr"]]
        done = cmd.run(args, capture=True, check=False)
    if done.returncode < 0 or done.returncode > 127:
        raise SourceError(f"git merge-file failed: {done.stderr.strip()}")
    found = _CONFLICT.search(done.stdout)
    first = done.stdout[: found.start()].count("\n") + 1 if found else 0
    return done.stdout, done.returncode, first


def materialized(folder: Path, pr: PullRequest) -> list[tuple[str, bytes]]:
    """(path inside the patch folder, content) of what a build context adds to a PR patch: the
    fetched files, under ``fetched/``."""
    where = data(folder, pr)
    return [(f"{FETCHED}/{p.relative_to(where).as_posix()}", p.read_bytes()) for p in sorted(where.rglob("*")) if p.is_file()]
