"""Resolve: pin every git ref of every target to a commit and every base image to a digest.

One ``ls-remote`` per repository answers every ref in it; an abbreviated SHA is expanded in the
local mirror. A ref that names nothing is an error with the nearest existing tags, never a
fallback to a branch. The result is the lock file that plan, build and the lanes read.
"""

from __future__ import annotations

import datetime as dt
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError, PublishError
from sparkbuild.oci import registry
from sparkbuild.plan import lock, matrix, plan
from sparkbuild.upstream import externals, gitrepo
from sparkbuild.util import log

_SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Pin:
    """One pinned ref or image, and how it was pinned."""

    name: str  # "cutlass v4.2.1" or "base cuda-13.0-devel"
    source: str  # repository URL or image name
    ref: str
    value: str  # commit or digest
    how: str  # "ls-remote", "mirror", "matrix", "registry"
    users: tuple[str, ...]
    previous: str | None = None

    @property
    def change(self) -> str:
        if self.how == "matrix":
            return "pinned in the matrix"
        if self.how == "cmake":
            return "pinned by vLLM's CMake file"
        if self.previous is None:
            return "new"
        return "same" if self.previous == self.value else f"moved from {self.previous[:12]}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "ref": self.ref,
            "value": self.value,
            "how": self.how,
            "change": self.change,
            "targets": list(self.users),
        }


@dataclass(frozen=True)
class Result:
    lock: lock.Lock
    pins: tuple[Pin, ...]
    path: Path


def git_refs(targets: tuple[matrix.Target, ...]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(component, repo, ref) -> the commit the matrix gives (or None) and the targets using it."""
    refs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for t in targets:
        sources = {"vllm": t.vllm.git() if t.vllm.kind in ("version", "ref") else None}
        sources |= {"flashinfer": t.flashinfer, "triton": t.triton, "cutlass": t.cutlass}
        for component, src in sources.items():
            if src is None:
                continue
            entry = refs.setdefault((component, src.repo, src.ref), {"commit": src.commit, "users": []})
            entry["users"].append(t.id)
    return refs


def resolve(opts: Options) -> Result:
    """Pin everything the matrix names; write the lock file; return what was pinned."""
    path = opts.lock or lock.default_path(opts.matrix)
    previous = lock.read(path) if path.is_file() else lock.Lock()
    m = matrix.load(opts.matrix)  # without the old lock: every ref is asked again
    git_pins = _pin_git(opts, m.targets, previous)
    found, external_pins = _pin_externals(opts, m, git_pins, previous)
    pins = [*git_pins, *external_pins, *_pin_images(m, previous)]
    new = lock.Lock(
        git=_nested((p.source, p.ref, p.value) for p in pins if p.how in ("ls-remote", "mirror")),
        images={p.source: p.value for p in pins if p.how == "registry"},
        resolved_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        externals=found,
    )
    new.write(path)
    log.info(f"wrote {path}: {len(new.git)} repositories, {len(new.images)} images")
    return Result(lock=new, pins=tuple(pins), path=path)


def _nested(items: Any) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for repo, ref, commit in items:
        out.setdefault(repo, {})[ref] = commit
    return out


def _pin_git(opts: Options, targets: tuple[matrix.Target, ...], previous: lock.Lock) -> list[Pin]:
    pins: list[Pin] = []
    remotes: dict[str, gitrepo.RemoteRefs] = {}
    for (component, repo, ref), entry in git_refs(targets).items():
        if repo not in remotes:
            with log.step(f"ls-remote {repo}"):
                remotes[repo] = gitrepo.ls_remote(repo)
        refs = remotes[repo]
        users = tuple(entry["users"])
        what = f"{', '.join(users)}: {component}"
        if entry["commit"] is not None:
            # The matrix pins it; still say when its ref is gone or has moved on.
            current = gitrepo.resolve_ref(refs, ref, what)
            if current != entry["commit"]:
                log.warning(f"{what}: the matrix pins {ref} to {entry['commit'][:12]}; {repo} has it at {current[:12]} now")
            pins.append(Pin(f"{component} {ref}", repo, ref, entry["commit"], "matrix", users))
            continue
        how = "ls-remote" if refs.commit(ref) else "mirror"
        commit = gitrepo.resolve_ref(refs, ref, what, gitrepo.Mirror(opts.cache, repo))
        pins.append(Pin(f"{component} {ref}", repo, ref, commit, how, users, previous.commit(repo, ref)))
    return pins


# --- the external projects vLLM's CMake clones --------------------------------------------------------

CMAKE_PATHS = (externals.FOLDER, "CMakeLists.txt")


def externals_at(
    opts: Options, repo: str, commit: str, remotes: dict[str, gitrepo.RemoteRefs], mirrored: Callable[[str], str] = str
) -> tuple[externals.External, ...]:
    """The external projects vLLM ``commit`` declares, each pinned: a full SHA in its CMake file
    pins itself; a tag or branch is asked of its repository (``ls-remote``), never guessed. Each
    repository goes through ``mirrored`` (the matrix's ``mirrors:``), which the source stage then fetches."""
    mirror = gitrepo.Mirror(opts.cache, repo)
    with tempfile.TemporaryDirectory() as tmp:
        tree = mirror.extract(commit, CMAKE_PATHS, Path(tmp))
        try:
            declared = externals.scan(tree)
        except externals.ScanError as exc:
            raise ConfigError(f"vLLM {commit[:12]}: {exc}") from None
    pinned = []
    for e in (replace(d, repo=mirrored(d.repo)) for d in declared):
        if e.env is None:
            raise ConfigError(
                f"vLLM {commit[:12]}: {e.file} clones {e.repo} with no *_SRC_DIR variable to hand it a local tree; "
                "the compile would need GitHub. Report it upstream, or add a patch that adds the variable"
            )
        if _SHA.match(e.ref):
            pinned.append(replace(e, commit=e.ref))
            continue
        if e.repo not in remotes:
            remotes[e.repo] = gitrepo.ls_remote(e.repo)
        pinned.append(replace(e, commit=gitrepo.resolve_ref(remotes[e.repo], e.ref, f"{e.file} of vLLM {commit[:12]}")))
    return tuple(pinned)


def _pin_externals(
    opts: Options, m: matrix.Matrix, git_pins: list[Pin], previous: lock.Lock
) -> tuple[dict[str, list[dict[str, Any]]], list[Pin]]:
    vllm = {(p.source, p.ref): p.value for p in git_pins if p.name.startswith("vllm ")}
    found: dict[str, list[dict[str, Any]]] = {}
    pins: list[Pin] = []
    remotes: dict[str, gitrepo.RemoteRefs] = {}
    for t in m.targets:
        if t.profile != "spark" or t.vllm.kind not in ("version", "ref"):
            continue
        git = t.vllm.git()
        commit = vllm[(git.repo, git.ref)]
        key = lock.externals_key(git.repo, commit)
        if key in found:
            continue
        with log.step(f"External projects of vLLM {git.ref} ({commit[:12]})"):
            pinned = externals_at(opts, git.repo, commit, remotes, m.mirrored)
        found[key] = [e.to_json() for e in pinned]
        before = {e.name: e.commit for e in previous.externals_of(git.repo, commit) or ()}
        for e in pinned:
            assert e.commit is not None
            how = "cmake" if e.commit == e.ref else "ls-remote"
            pins.append(Pin(f"{e.name} {e.ref}", e.repo, e.ref, e.commit, how, (t.id,), before.get(e.name)))
    return found, pins


def _pin_images(m: matrix.Matrix, previous: lock.Lock) -> list[Pin]:
    pins: list[Pin] = []
    for image in m.unpinned_images:
        name = next(n for n, b in m.bases.items() if b.image == image)
        users = tuple(t.id for t in m.targets if any(b.image == image for b in plan.bases(t).values()))
        try:
            digest = registry.image_digest(image)
        except PublishError as exc:
            raise ConfigError(f"{m.file}: bases: {exc}") from None
        pins.append(Pin(f"base {name}", image, image.rpartition(":")[2], digest, "registry", users, previous.digest(image)))
    return pins


def table(result: Result) -> str:
    header = ("pinned", "ref", "commit / digest", "how", "change")
    rows = [
        (p.name, p.ref, p.value[:19] if p.value.startswith("sha256:") else p.value[:12], p.how, p.change) for p in result.pins
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (header, *rows)]
    return "\n".join([*lines, f"lock: {result.path}"])
