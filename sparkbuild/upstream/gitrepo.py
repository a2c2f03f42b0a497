"""Upstream git repositories, through gitpython: refs from ``ls-remote``, and a local bare mirror.

``ls-remote`` answers "which commit is this tag or branch now" in one round trip without any
objects. The mirror (one bare repository per URL in the cache, fetched incrementally) is for what
needs objects: trees to patch-check, history to bisect, abbreviated SHAs to expand.
"""

from __future__ import annotations

import difflib
import hashlib
import io
import os
import re
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import git
from packaging.version import InvalidVersion, Version

from sparkbuild.errors import ConfigError, SourceError
from sparkbuild.util import cmd, log

_SHA = re.compile(r"^[0-9a-f]{40}$")
_ABBREV = re.compile(r"^[0-9a-f]{7,39}$")
# Never wait for a password prompt in a nightly: fail and say so.
_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true"}


def _git(args: Sequence[str], cwd: Path | None = None) -> str:
    """Run one git command through gitpython, printed first; failures become SourceError."""
    log.info(cmd.show(["git", *args]))
    try:
        out: str = git.Git(cwd).execute(["git", *args], env={**os.environ, **_ENV})
    except git.GitCommandError as exc:
        stderr = str(exc.stderr).strip().removeprefix("stderr: ").strip(" '\n")
        raise SourceError(f"`git {' '.join(args)}` failed: {stderr or exc}") from None
    return out


@dataclass(frozen=True)
class RemoteRefs:
    """The tags (peeled to commits) and branches of one remote, as ``ls-remote`` gives them."""

    url: str
    tags: dict[str, str]
    heads: dict[str, str]

    def commit(self, ref: str) -> str | None:
        """The commit a tag, branch or full SHA names here; None when it names nothing."""
        if _SHA.match(ref):
            return ref
        ref = ref.removeprefix("refs/tags/").removeprefix("refs/heads/")
        return self.tags.get(ref) or self.heads.get(ref)

    def nearest(self, ref: str, count: int = 3) -> list[str]:
        """Existing tags closest to ``ref``: its version neighbours, then similar names."""
        found: list[str] = []
        wanted = _version(ref)
        if wanted is not None:
            versions = sorted((v, t) for t in self.tags if (v := _version(t)) is not None)
            below = [t for v, t in versions if v < wanted][-1:]
            above = [t for v, t in versions if v > wanted][:1]
            found += below + above
        found += difflib.get_close_matches(ref, list(self.tags), n=count, cutoff=0.6)
        return list(dict.fromkeys(found))[:count]

    def versions(self) -> list[tuple[Version, str]]:
        """Tags that are versions (``v0.34.0rc2``), oldest first."""
        return sorted((v, t) for t in self.tags if (v := _version(t)) is not None)


def _version(tag: str) -> Version | None:
    if not re.match(r"^v?\d", tag):
        return None
    try:
        return Version(tag)
    except InvalidVersion:
        return None


def ls_remote(url: str) -> RemoteRefs:
    """Tags and branches of ``url``; an annotated tag gives the commit it points at (``^{}``)."""
    out = _git(["ls-remote", "--tags", "--heads", url])
    tags: dict[str, str] = {}
    heads: dict[str, str] = {}
    peeled: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, name = line.partition("\t")
        if name.startswith("refs/heads/"):
            heads[name.removeprefix("refs/heads/")] = sha
        elif name.endswith("^{}"):
            peeled[name.removeprefix("refs/tags/").removesuffix("^{}")] = sha
        elif name.startswith("refs/tags/"):
            tags[name.removeprefix("refs/tags/")] = sha
    tags.update(peeled)
    return RemoteRefs(url=url, tags=tags, heads=heads)


@dataclass(frozen=True)
class Candidate:
    repo: str
    tag: str
    commit: str
    release: str | None  # the newest release tag it is newer than

    @property
    def version(self) -> str:
        return self.tag.removeprefix("v")

    def to_json(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "tag": self.tag,
            "version": self.version,
            "commit": self.commit,
            "newest_release": self.release,
        }


def newest_candidate(refs: RemoteRefs) -> Candidate | None:
    """The newest ``vX.Y.ZrcN`` newer than the newest release, by ``packaging.version`` order."""
    versions = refs.versions()
    releases = [(v, t) for v, t in versions if not v.is_prerelease and not v.is_devrelease]
    newest = releases[-1] if releases else None
    rcs = [
        (v, t)
        for v, t in versions
        if v.pre is not None and v.pre[0] == "rc" and not v.is_devrelease and (newest is None or v > newest[0])
    ]
    if not rcs:
        return None
    tag = rcs[-1][1]
    return Candidate(repo=refs.url, tag=tag, commit=refs.tags[tag], release=newest[1] if newest else None)


def resolve_ref(refs: RemoteRefs, ref: str, what: str, mirror: Mirror | None = None) -> str:
    """The commit of ``ref``; an abbreviated SHA is expanded in the mirror. Never falls back."""
    commit = refs.commit(ref)
    if commit is None and _ABBREV.match(ref) and mirror is not None:
        mirror.fetch()
        commit = mirror.rev_parse(ref)
    if commit is None:
        near = refs.nearest(ref)
        hint = f" Nearest existing tags: {', '.join(near)}." if near else " It has no tags."
        raise ConfigError(f"{what}: '{ref}' is not a tag or branch of {refs.url}.{hint} Fix the ref in the matrix.")
    return commit


class Mirror:
    """A bare mirror of one remote in the cache; each ``fetch`` brings only what is new."""

    def __init__(self, cache: Path, url: str) -> None:
        self.url = url
        slug = re.sub(r"[^A-Za-z0-9]+", "-", url.split("://")[-1]).strip("-")[-40:]
        self.path = cache / "git" / f"{slug}-{hashlib.sha256(url.encode()).hexdigest()[:8]}.git"
        self._fetched = False

    def fetch(self) -> None:
        """Create the mirror on first use, then fetch branches and tags (once per run)."""
        if self._fetched:
            return
        if not (self.path / "HEAD").is_file():
            # Made aside and renamed: a half-made mirror is never taken for one.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}."))
            git.Repo.init(fresh, bare=True)
            try:
                fresh.rename(self.path)
            except OSError:  # another run made it first
                shutil.rmtree(fresh, ignore_errors=True)
        _git(
            ["fetch", "--prune", "--force", "--tags", self.url, "+refs/heads/*:refs/heads/*"],
            cwd=self.path,
        )
        self._fetched = True

    def has(self, commit: str) -> bool:
        try:
            git.Git(self.path).execute(["git", "cat-file", "-e", f"{commit}^{{commit}}"])
        except git.GitCommandError:
            return False
        return True

    def ensure(self, commit: str) -> None:
        if not self.has(commit):
            self.fetch()
        if not self.has(commit):
            raise SourceError(f"{self.url} has no commit {commit} (fetched into {self.path})")

    def rev_parse(self, ref: str) -> str | None:
        try:
            return _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=self.path) or None
        except SourceError:
            return None

    def commits_between(self, good: str, bad: str) -> list[str]:
        """Commits after ``good`` up to and including ``bad``, oldest first, on the path between them."""
        out = _git(["rev-list", "--reverse", "--ancestry-path", f"{good}..{bad}"], cwd=self.path)
        return out.split()

    def is_ancestor(self, old: str, new: str) -> bool:
        result = subprocess.run(["git", "merge-base", "--is-ancestor", old, new], cwd=self.path, check=False)
        return result.returncode == 0

    def subject(self, commit: str) -> str:
        return _git(["show", "--no-patch", "--format=%s", commit], cwd=self.path)

    def version_at(self, commit: str) -> str | None:
        """The version of the newest version tag reachable from ``commit`` (``git describe``)."""
        try:
            tag = _git(["describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", commit], cwd=self.path)
        except SourceError:
            return None
        v = _version(tag)
        return None if v is None else str(v)

    def extract(self, commit: str, paths: Sequence[str], dest: Path) -> Path:
        """The files under ``paths`` at ``commit`` (``git archive``), unpacked into ``dest``; paths the
        commit lacks are skipped."""
        self.ensure(commit)
        present = [p for p in paths if self._has_path(commit, p)]
        dest.mkdir(parents=True, exist_ok=True)
        if not present:
            return dest
        args = ["git", "archive", "--format=tar", commit, "--", *present]
        log.info(cmd.show(args))
        done = subprocess.run(args, cwd=self.path, capture_output=True, check=False)
        if done.returncode != 0:
            raise SourceError(f"`git archive {commit} {' '.join(present)}` in {self.path} failed: {done.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
            tar.extractall(dest, filter="data")
        return dest

    def _has_path(self, commit: str, path: str) -> bool:
        done = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=self.path, capture_output=True, check=False)
        return done.returncode == 0

    def checkout(self, commit: str, dest: Path) -> Path:
        """The tree of ``commit`` at ``dest``: a worktree of the mirror. Moving an existing one to
        another commit rewrites only the files that differ, so bisect steps take milliseconds."""
        self.ensure(commit)
        if (dest / ".git").is_file():
            _git(["checkout", "--quiet", "--detach", "--force", commit], cwd=dest)
            _git(["clean", "-qfdx"], cwd=dest)
        else:
            _git(["worktree", "prune"], cwd=self.path)  # worktrees of earlier runs are gone with their folders
            dest.parent.mkdir(parents=True, exist_ok=True)
            _git(["worktree", "add", "--quiet", "--detach", "--force", str(dest), commit], cwd=self.path)
        return dest


# --- local repositories, served on loopback --------------------------------------------------------

# Fixed authorship and dates: the same tree always gives the same commit, so stages built from a
# local repository are reused from one run to the next.
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "sparkbuild",
    "GIT_AUTHOR_EMAIL": "sparkbuild@localhost.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "sparkbuild",
    "GIT_COMMITTER_EMAIL": "sparkbuild@localhost.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}


def commit_tree(
    tree: Path, repo: Path, message: str, tag: str | None = None, gitlinks: dict[str, tuple[str, str]] | None = None
) -> str:
    """A bare repository at ``repo`` whose one commit holds ``tree`` (tagged ``tag``); returns the commit.

    ``gitlinks``: submodules (path -> (URL, commit)), recorded as git records them (a ``.gitmodules``
    entry and a commit in the tree), so a checkout's ``git submodule update`` fetches them.
    Deterministic: the same files give the same commit on every machine. Made aside and renamed, so
    an interrupted run never leaves a half-made repository where a finished one is expected.
    """
    if (repo / "HEAD").is_file():
        try:
            existing = _git(["log", "-1", "--format=%H %s", "HEAD"], cwd=repo)
        except SourceError:
            existing = ""
        commit, _, subject = existing.partition(" ")
        if subject == message:
            return commit
    partial = repo.with_name(repo.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    _git(["init", "--quiet", "--bare", str(partial)])
    # The tree's own .gitignore applies, as in the upstream repository; sparkbuild's stamp stays out.
    (partial / "info").mkdir(exist_ok=True)
    (partial / "info" / "exclude").write_text(".sparkbuild-unpacked\n", encoding="utf-8")
    env = {**os.environ, **_ENV, **FIXED_IDENTITY, "GIT_DIR": str(partial), "GIT_WORK_TREE": str(tree)}
    links = sorted((gitlinks or {}).items())
    if links:
        sections = [f'[submodule "{path}"]\n\tpath = {path}\n\turl = {url}\n' for path, (url, _) in links]
        (tree / ".gitmodules").write_text("".join(sections), encoding="utf-8")
    steps = [["add", "--all"]]
    steps += [["update-index", "--add", "--cacheinfo", f"160000,{commit},{path}"] for path, (_, commit) in links]
    for args in [*steps, ["commit", "--quiet", "-m", message]]:
        log.info(cmd.show(["git", *args]))
        done = subprocess.run(["git", *args], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SourceError(f"`git {' '.join(args)}` of {tree} into {partial} failed: {done.stderr.strip()}")
    commit = _git(["rev-parse", "HEAD"], cwd=partial)
    if tag:
        _git(["tag", tag, commit], cwd=partial)
    shutil.rmtree(repo, ignore_errors=True)
    partial.rename(repo)
    return commit


@contextmanager
def daemon(root: Path) -> Iterator[str]:
    """Serve every repository under ``root`` over the git protocol on 127.0.0.1; yields ``git://HOST:PORT``.

    Loopback only, read only, and stopped on the way out whatever happens.
    """
    root.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    args = ["git", "daemon", "--export-all", "--reuseaddr", f"--base-path={root}", "--listen=127.0.0.1", f"--port={port}"]
    args.append(str(root))
    log.info(cmd.show(args))
    proc = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise SourceError(f"git daemon exited (code {proc.returncode}) before it listened on 127.0.0.1:{port}")
            time.sleep(0.1)
        yield f"git://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()
