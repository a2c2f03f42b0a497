"""Resolve: pin every git ref of every target to a commit and every base image to a digest.

One ``ls-remote`` per repository answers every ref in it; an abbreviated SHA is expanded in the
local mirror. A ref that names nothing is an error with the nearest existing tags, never a
fallback to a branch. The result is the lock file that plan, build and the lanes read.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import gitrepo, lock, log, matrix, plan, registry
from builder.errors import ConfigError, PublishError
from builder.options import Options


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
    pins = [*_pin_git(opts, m.targets, previous), *_pin_images(m, previous)]
    new = lock.Lock(
        git=_nested((p.source, p.ref, p.value) for p in pins if p.how in ("ls-remote", "mirror")),
        images={p.source: p.value for p in pins if p.how == "registry"},
        resolved_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
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
