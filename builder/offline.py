"""Local git remotes for a rehearsal on a machine that cannot reach GitHub (CI, this sandbox).

Each source of a Spark target comes from where a machine with only PyPI can get it:

- vLLM and FlashInfer: their PyPI sdists at the target's versions, real sources;
- CUTLASS: a stand-in with the CUTLASS headers FlashInfer's sdist bundles and a CMakeLists.txt of
  its own (headers only, as vLLM uses CUTLASS);
- the kernel projects vLLM's CMake clones (vllm-flash-attn, FlashMLA, DeepGEMM, ...): stand-ins
  holding the files vLLM's CMake files name, so the configure runs; their units are stand-ins.

Every stand-in carries a ``.sparkbuild-stub`` file; preflight names each one in its report. Each
repository holds one commit made deterministically from its files, so a second rehearsal reuses
every stage. The repositories are served by ``git daemon`` on loopback while the rehearsal runs, named ``git://sparkbuild-offline/...``
in the plan and reached through ``SPARKBUILD_GIT_INSTEADOF``.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from builder import externals, gitrepo, log, sources
from builder.errors import ConfigError
from builder.matrix import GitSource, Target

STUB_MARK = ".sparkbuild-stub"
# The name the plan gives the local repositories; the daemon's real address is a build argument
# (SPARKBUILD_GIT_INSTEADOF), so its port never changes a stage's hash.
URL = "git://sparkbuild-offline"
STUB_NOTE = "A stand-in made by sparkbuild for an offline rehearsal: the real source is on GitHub.\n"
CUTLASS_CMAKE = """\
# sparkbuild's stand-in for CUTLASS's CMakeLists.txt: vLLM uses CUTLASS as headers only
# (CUTLASS_ENABLE_HEADERS_ONLY), through these variables.
cmake_minimum_required(VERSION 3.19)
project(CUTLASS LANGUAGES CXX)
set(CUTLASS_DIR ${CMAKE_CURRENT_SOURCE_DIR} CACHE PATH "" FORCE)
set(CUTLASS_INCLUDE_DIR ${CMAKE_CURRENT_SOURCE_DIR}/include CACHE PATH "" FORCE)
set(CUTLASS_TOOLS_UTIL_INCLUDE_DIR ${CMAKE_CURRENT_SOURCE_DIR}/tools/util/include CACHE PATH "" FORCE)
"""


@dataclass(frozen=True, kw_only=True)
class Local:
    """One local repository: its name under the served root, commit, and where its files came from."""

    name: str
    commit: str
    origin: str
    stub: bool


@dataclass(frozen=True, kw_only=True)
class Sources:
    root: Path
    vllm: Local
    cutlass: Local
    flashinfer: Local | None
    externals: tuple[tuple[externals.External, Local], ...]

    def all(self) -> tuple[Local, ...]:
        extra = (self.flashinfer,) if self.flashinfer else ()
        return (self.vllm, self.cutlass, *extra, *(local for _, local in self.externals))

    def apply(self, target: Target, url: str = URL) -> Target:
        """``target`` with every git source pointed at these repositories (named below ``url``)."""

        def git(source: GitSource | None, local: Local | None) -> GitSource | None:
            if source is None or local is None:
                return source
            return replace(source, repo=f"{url}/{local.name}", commit=local.commit)

        vllm = replace(target.vllm, repo=f"{url}/{self.vllm.name}", commit=self.vllm.commit)
        pinned = tuple(replace(e, repo=f"{url}/{local.name}", commit=local.commit) for e, local in self.externals)
        return replace(
            target,
            vllm=vllm,
            cutlass=git(target.cutlass, self.cutlass),
            flashinfer=git(target.flashinfer, self.flashinfer),
            externals=pinned,
        )


def prepare(target: Target, cache: Path) -> Sources:
    """Make (or find) the local repositories of ``target``'s sources under ``cache/offline``."""
    if target.vllm.kind != "version":
        raise ConfigError(
            f"{target.where}: an offline rehearsal builds vLLM from its PyPI sdist, so the target needs "
            f"'vllm: {{version: X.Y.Z}}' (it has {target.vllm.kind} {target.vllm.spec})"
        )
    root = cache / "offline"
    tree = sources.vllm_sdist(target.vllm.version, cache)
    vllm = _commit(tree, root, f"vllm-{target.vllm.version}", f"PyPI sdist vllm-{target.vllm.version}", stub=False)
    flashinfer = cutlass_headers = None
    if target.flashinfer is not None:
        fi_tree = sources.project_sdist("flashinfer-python", target.flashinfer.version, cache, "flashinfer")
        # FlashInfer's build reads its version from version.txt, which its git repository has and its
        # sdist leaves out (the version is in PKG-INFO): put it back, as the tag has it.
        (fi_tree / "version.txt").write_text(f"{sources.tree_version(fi_tree)}\n", encoding="utf-8")
        origin = f"PyPI sdist flashinfer_python-{target.flashinfer.version} (+ version.txt)"
        flashinfer = _commit(fi_tree, root, f"flashinfer-{target.flashinfer.version}", origin, stub=False)
        cutlass_headers = fi_tree / "3rdparty" / "cutlass"
    cutlass = _cutlass(root, cutlass_headers, cache)
    found = tuple((e, _external_stub(tree, e, root)) for e in externals.scan(tree))
    return Sources(root=root, vllm=vllm, cutlass=cutlass, flashinfer=flashinfer, externals=found)


def _commit(tree: Path, root: Path, name: str, origin: str, *, stub: bool) -> Local:
    commit = gitrepo.commit_tree(tree, root / f"{name}.git", f"{origin}{' (stand-in)' if stub else ''}")
    return Local(name=f"{name}.git", commit=commit, origin=origin, stub=stub)


def _cutlass(root: Path, headers: Path | None, cache: Path) -> Local:
    if headers is None or not (headers / "include" / "cutlass").is_dir():
        raise ConfigError(
            "an offline rehearsal takes CUTLASS's headers from FlashInfer's sdist; give the target 'flashinfer: {ref: vX.Y.Z}'"
        )
    version = _cutlass_version(headers)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        stand_in = Path(tmp) / "cutlass"
        shutil.copytree(headers, stand_in, symlinks=True)
        (stand_in / "CMakeLists.txt").write_text(CUTLASS_CMAKE, encoding="utf-8")
        (stand_in / STUB_MARK).write_text(STUB_NOTE, encoding="utf-8")
        return _commit(stand_in, root, f"cutlass-{version}", f"CUTLASS {version} headers from FlashInfer's sdist", stub=True)


def _cutlass_version(headers: Path) -> str:
    text = (headers / "include" / "cutlass" / "version.h").read_text(encoding="utf-8", errors="replace")
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "0" for m in parts)


def _external_stub(tree: Path, external: externals.External, root: Path) -> Local:
    """A stand-in for one external project: every path vLLM's CMake file names below its source dir."""
    cmake = (tree / external.file).read_text(encoding="utf-8", errors="replace")
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        stub = Path(tmp) / external.name
        stub.mkdir()
        (stub / "CMakeLists.txt").write_text(
            f"cmake_minimum_required(VERSION 3.19)\nproject({external.name.replace('-', '_')}_stub LANGUAGES NONE)\n",
            encoding="utf-8",
        )
        (stub / STUB_MARK).write_text(STUB_NOTE, encoding="utf-8")
        for rel in re.findall(r"\$\{" + re.escape(external.name) + r"_SOURCE_DIR\}/([\w./+-]+)", cmake):
            path = stub / rel.rstrip("/")
            if "." in path.name:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                path.mkdir(parents=True, exist_ok=True)
                (path / ".keep").touch()
        if external.subdir:
            (stub / external.subdir).mkdir(parents=True, exist_ok=True)
            (stub / external.subdir / "__init__.py").touch()
        origin = f"stand-in for {external.repo} ({external.ref})"
        return _commit(stub, root, f"{external.name}-stub", origin, stub=True)


def describe(found: Sources) -> str:
    lines = ["offline sources (local git remotes):"]
    for local in found.all():
        lines.append(f"  {'STAND-IN ' if local.stub else ''}{local.name} {local.commit[:12]}  {local.origin}")
    return "\n".join(lines)


def log_sources(found: Sources) -> None:
    log.info(describe(found))
