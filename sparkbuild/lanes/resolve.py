"""Resolve: pin every git ref of every target to a commit and every base image to a digest, and
upstream's vLLM wheel of each Spark release target that may build from it.

One ``ls-remote`` per repository answers every ref in it; an abbreviated SHA is expanded in the
local mirror. A ref that names nothing is an error with the nearest existing tags, never a
fallback to a branch. The wheels come from the package index (``sparkbuild.lanes.upstream_wheel``:
downloaded, checked by sha256, judged by check-binary for each target's GPU). The result is the
lock file that plan, build and the lanes read; ``wheels_only`` pins the wheels alone and keeps every
other pin of the lock (a machine that reaches the package index but not GitHub).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError, PublishError
from sparkbuild.lanes import upstream_wheel
from sparkbuild.oci import registry
from sparkbuild.plan import companions, lock, matrix, plan
from sparkbuild.upstream import externals, gitrepo, sources
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


def resolve(opts: Options, *, wheels_only: bool = False) -> Result:
    """Pin everything the matrix names (``wheels_only``: upstream's wheels alone, every other pin of
    the lock kept); write the lock file; return what was pinned."""
    path = opts.lock or lock.default_path(opts.matrix)
    previous = lock.read(path) if path.is_file() else lock.Lock()
    m = matrix.load(opts.matrix)  # without the old lock: every ref is asked again
    wheels, wheel_pins = _pin_wheels(opts, m, previous)
    if wheels_only:
        new = dataclasses.replace(previous, file=None, wheels=wheels, resolved_at=_now())
        new.write(path)
        log.info(f"wrote {path}: {len(wheels)} upstream wheel(s); every other pin as it was")
        return Result(lock=new, pins=tuple(wheel_pins), path=path)
    git_pins = _pin_git(opts, m.targets, previous)
    found, external_pins = _pin_externals(opts, m, git_pins, previous)
    pins = [*git_pins, *external_pins, *_pin_images(m, previous), *wheel_pins]
    new = lock.Lock(
        git=_nested((p.source, p.ref, p.value) for p in pins if p.how in ("ls-remote", "mirror")),
        images={p.source: p.value for p in pins if p.how == "registry"},
        resolved_at=_now(),
        externals=found,
        wheels=wheels,
    )
    new.write(path)
    log.info(f"wrote {path}: {len(new.git)} repositories, {len(new.images)} images")
    return Result(lock=new, pins=tuple(pins), path=path)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def companions_at(opts: Options, repo: str, commit: str, version: str) -> companions.Named:
    """The FlashInfer and CUTLASS vLLM ``commit`` names (its requirements and CMakeLists.txt)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = gitrepo.Mirror(opts.cache, repo).extract(commit, externals.COMPANION_FILES, Path(tmp))
        return companions.Named(
            vllm=version, flashinfer=externals.flashinfer_requirement(tree), cutlass=externals.cutlass_revision(tree)
        )


def _pin_externals(
    opts: Options, m: matrix.Matrix, git_pins: list[Pin], previous: lock.Lock
) -> tuple[dict[str, list[dict[str, Any]]], list[Pin]]:
    vllm = {(p.source, p.ref): p.value for p in git_pins if p.name.startswith("vllm ")}
    found: dict[str, list[dict[str, Any]]] = {}
    pins: list[Pin] = []
    remotes: dict[str, gitrepo.RemoteRefs] = {}
    named: dict[str, companions.Named] = {}
    for t in m.targets:
        if t.profile != "spark" or t.vllm.kind not in ("version", "ref"):
            continue
        git = t.vllm.git()
        commit = vllm[(git.repo, git.ref)]
        if commit not in named:
            named[commit] = companions_at(opts, git.repo, commit, git.ref)
        companions.require(t, named[commit])
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


# --- upstream's wheels ------------------------------------------------------------------------


def wheel_targets(m: matrix.Matrix) -> dict[tuple[str, str], list[matrix.Target]]:
    """(vLLM version, platform) -> the Spark targets that may build from upstream's wheel of it."""
    found: dict[tuple[str, str], list[matrix.Target]] = {}
    for t in m.targets:
        if t.profile == "spark" and t.vllm.kind == "version" and t.vllm_from != "source":
            found.setdefault((t.vllm.version, t.platform), []).append(t)
    return found


def _pin_wheels(opts: Options, m: matrix.Matrix, previous: lock.Lock) -> tuple[dict[str, dict[str, Any]], list[Pin]]:
    wheels: dict[str, dict[str, Any]] = {}
    pins: list[Pin] = []
    for (version, platform), targets in wheel_targets(m).items():
        base = targets[0].runtime_base
        gpus = tuple(dict.fromkeys(t.gpu for t in targets))
        if base.python is None or base.glibc is None:
            # Which wheel installs there is not known: these targets compile, and their plans say why.
            why = f"the runtime base {base.name} says no python: or glibc: (bases: in the matrix), which choose the wheel"
            found = lock.WheelPin(version=version, platform=platform, index=sources.simple_index(), missing=why)
        else:
            with log.step(f"Upstream's vLLM {version} wheel for {platform}"):
                found = upstream_wheel.pin(version, platform, gpus, python=base.python, glibc=base.glibc, cache=opts.cache)
        wheels[lock.wheel_key(version, platform)] = found.to_json()
        before = previous.wheel(version, platform)
        users = tuple(t.id for t in targets)
        if found.missing is not None:
            log.warning(found.missing)
            pins.append(Pin(f"vllm {version} wheel {platform}", found.index, version, "none", "index", users, None))
            continue
        assert found.sha256 is not None and found.filename is not None
        was = before.sha256 if before is not None else None
        pins.append(Pin(f"vllm {version} wheel {platform}", found.url or "", found.filename, found.sha256, "index", users, was))
        for gpu, verdict in found.check_binary.items():
            log.info(f"{found.filename}: check-binary for GPU {gpu}: {'passes' if verdict.ok else 'FAILS'} ({verdict.text()})")
    return wheels, pins


def table(result: Result) -> str:
    header = ("pinned", "ref", "commit / digest", "how", "change")
    rows = [
        (p.name, p.ref, p.value[:19] if p.value.startswith("sha256:") else p.value[:12], p.how, p.change) for p in result.pins
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (header, *rows)]
    for key in sorted(result.lock.wheels):
        found = lock.WheelPin.from_json(result.lock.wheels[key])
        if found.missing is not None:
            lines.append(f"{key}: no wheel: {found.missing}")
            continue
        for gpu, verdict in sorted(found.check_binary.items()):
            said = "passes" if verdict.ok else "FAILS"
            lines.append(f"{found.filename}: check-binary for GPU {gpu} {said} ({verdict.text()})")
        lines.append(f"{found.filename}: requires {found.torch or 'no torch'}, links CUDA {found.cuda or 'none'}")
    return "\n".join([*lines, f"lock: {result.path}"])
