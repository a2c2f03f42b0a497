"""Local git remotes for a rehearsal on a machine that cannot reach GitHub (CI, this sandbox).

Each source of a Spark target comes from where a machine with only PyPI can get it:

- vLLM and FlashInfer: their PyPI sdists at the target's versions, real sources;
- CUTLASS: a stand-in with the CUTLASS headers FlashInfer's sdist bundles and a CMakeLists.txt of
  its own (headers only, as vLLM uses CUTLASS);
- the kernel projects vLLM's CMake clones (vllm-flash-attn, FlashMLA, DeepGEMM, ...): stand-ins
  holding the files vLLM's CMake files name, so the configure runs; their units are stand-ins. Each
  submodule their CMake file lists is a real submodule (of the CUTLASS stand-in), so the source stage
  fetches it as it would the real one; vllm-flash-attn's stand-in is flash-attention in miniature
  (``FA_CMAKE``): a ``csrc/cutlass`` submodule its CMake file requires, a unit for this GPU as FA2
  has (8.0+PTX) and one built only for another GPU as FA3 (9.0a), through vLLM's own arch functions.

Every stand-in carries a ``.sparkbuild-stub`` file; preflight names each one in its report. Each
repository holds one commit made deterministically from its files, so a second rehearsal reuses
every stage. The repositories are served by ``git daemon`` on loopback while the rehearsal runs, named ``git://sparkbuild-offline/...``
in the plan and reached through the build's ``git-insteadof`` secret (``TargetPlan.git_insteadof``).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from sparkbuild.errors import ConfigError
from sparkbuild.plan.matrix import GitSource, Target
from sparkbuild.upstream import externals, gitrepo, sources
from sparkbuild.util import log

STUB_MARK = ".sparkbuild-stub"
# The name the plan gives the local repositories; the daemon's real address is a BuildKit secret
# (git-insteadof), so its port changes neither a stage's hash nor a step's cache key.
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


FA_NAME = "vllm-flash-attn"
FA_CMAKE = """\
# sparkbuild's stand-in for vllm-project/flash-attention (an offline rehearsal): what vLLM's
# configure meets in the real project, in miniature. Every FA unit includes <cute/tensor.hpp> from
# the csrc/cutlass submodule; FA2's units are built for "8.0+PTX" (PTX the driver compiles on SM12x),
# FA3's for "9.0a" only (no code target at all for a 12.1a list). vLLM's own arch functions.
cmake_minimum_required(VERSION 3.26)
project(vllm_flash_attn LANGUAGES CXX CUDA)
if(NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cutlass/include/cute/tensor.hpp)
  message(FATAL_ERROR "vllm-flash-attn: csrc/cutlass/include/cute/tensor.hpp is missing: the csrc/cutlass "
    "submodule was not fetched, and every FA unit includes <cute/tensor.hpp>")
endif()
cuda_archs_loose_intersection(FA2_ARCHS "8.0+PTX" "${CUDA_ARCHS}")
cuda_archs_loose_intersection(FA3_ARCHS "9.0a;" "${CUDA_ARCHS}")
message(STATUS "FA2_ARCHS: ${FA2_ARCHS}")
message(STATUS "FA3_ARCHS: ${FA3_ARCHS}")
set_gencode_flags_for_srcs(SRCS csrc/flash_attn/src/flash_fwd_stub.cu CUDA_ARCHS "${FA2_ARCHS}")
set_gencode_flags_for_srcs(SRCS hopper/instantiations/flash_fwd_stub_sm90.cu CUDA_ARCHS "${FA3_ARCHS}")
add_library(_vllm_fa2_C OBJECT csrc/flash_attn/src/flash_fwd_stub.cu)
add_library(_vllm_fa3_C OBJECT hopper/instantiations/flash_fwd_stub_sm90.cu)
# FA's targets take their archs per file only (its ARCHITECTURES "").
set_target_properties(_vllm_fa2_C _vllm_fa3_C PROPERTIES CUDA_ARCHITECTURES OFF)
target_include_directories(_vllm_fa2_C PRIVATE csrc/cutlass/include)
target_include_directories(_vllm_fa3_C PRIVATE csrc/cutlass/include)
"""
FA_ROCM_SUBMODULES = ("csrc/composable_kernel", "third_party/aiter")
FA_UNIT = "#include <cute/tensor.hpp>\n__global__ void sparkbuild_stand_in() {}\n"
FA_UNITS = ("csrc/flash_attn/src/flash_fwd_stub.cu", "hopper/instantiations/flash_fwd_stub_sm90.cu")


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
    found = tuple((e, _external_stub(tree, e, root, cutlass)) for e in externals.scan(tree))
    return Sources(root=root, vllm=vllm, cutlass=cutlass, flashinfer=flashinfer, externals=found)


def _commit(
    tree: Path, root: Path, name: str, origin: str, *, stub: bool, gitlinks: dict[str, tuple[str, str]] | None = None
) -> Local:
    # A stand-in's repository is named by its content: a stand-in sparkbuild changes is a new
    # repository, and runs of different sparkbuild versions sharing the cache never rewrite each
    # other's (a rewritten repository no longer has the commit a running build fetches).
    if stub:
        name = f"{name}-{_digest(tree, gitlinks)}"
    message = f"{origin} (stand-in)" if stub else origin
    commit = gitrepo.commit_tree(tree, root / f"{name}.git", message, gitlinks=gitlinks)
    return Local(name=f"{name}.git", commit=commit, origin=origin, stub=stub)


def _digest(tree: Path, gitlinks: dict[str, tuple[str, str]] | None) -> str:
    h = hashlib.sha256(repr(sorted((gitlinks or {}).items())).encode())
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


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


def _external_stub(tree: Path, external: externals.External, root: Path, cutlass: Local) -> Local:
    """A stand-in for one external project: every path vLLM's CMake file names below its source dir;
    each submodule the file lists is a stand-in repository of its own, linked as a real submodule
    (the paths named below it are in it); flash-attention's is FA in miniature (``FA_CMAKE``)."""
    cmake = (tree / external.file).read_text(encoding="utf-8", errors="replace")
    named = [r.rstrip("/") for r in re.findall(r"\$\{" + re.escape(external.name) + r"_SOURCE_DIR\}/([\w./+-]+)", cmake)]
    listed = () if external.submodules == "all" else external.submodules
    gitlinks: dict[str, tuple[str, str]] = {}
    for sub in listed:
        inside = [r.removeprefix(sub + "/") for r in named if r.startswith(sub + "/")]
        name, origin = f"{external.name}-{sub.replace('/', '-')}", f"stand-in for {external.name}'s submodule {sub}"
        local = _stub_repo(root, name, origin, inside)
        gitlinks[sub] = (f"{URL}/{local.name}", local.commit)
    project = external.name.replace("-", "_")
    files = {"CMakeLists.txt": f"cmake_minimum_required(VERSION 3.19)\nproject({project}_stub LANGUAGES NONE)\n"}
    if external.name == FA_NAME:
        gitlinks["csrc/cutlass"] = (f"{URL}/{cutlass.name}", cutlass.commit)
        # ROCm's submodules, as flash-attention's .gitmodules lists them: no CUDA build reads them.
        for sub in FA_ROCM_SUBMODULES:
            local = _stub_repo(
                root, f"{external.name}-{sub.replace('/', '-')}", f"stand-in for {external.name}'s ROCm submodule {sub}", []
            )
            gitlinks[sub] = (f"{URL}/{local.name}", local.commit)
        files = {"CMakeLists.txt": FA_CMAKE, **dict.fromkeys(FA_UNITS, FA_UNIT)}
    outside = [r for r in named if not any(r == g or r.startswith(g + "/") for g in gitlinks)]
    if external.subdir:
        files[f"{external.subdir}/__init__.py"] = ""
    origin = f"stand-in for {external.repo} ({external.ref})"
    return _stub_repo(root, f"{external.name}-stub", origin, outside, files, gitlinks)


def _stub_repo(
    root: Path,
    name: str,
    origin: str,
    paths: list[str],
    files: dict[str, str] | None = None,
    gitlinks: dict[str, tuple[str, str]] | None = None,
) -> Local:
    """A marked stand-in repository: ``files``, and each of ``paths`` (a file where its name has a
    dot, else a folder) empty."""
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        stub = Path(tmp) / name
        stub.mkdir()
        (stub / STUB_MARK).write_text(STUB_NOTE, encoding="utf-8")
        for rel, text in (files or {}).items():
            (stub / rel).parent.mkdir(parents=True, exist_ok=True)
            (stub / rel).write_text(text, encoding="utf-8")
        for rel in paths:
            path = stub / rel
            if "." in path.name:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                path.mkdir(parents=True, exist_ok=True)
                (path / ".keep").touch()
        return _commit(stub, root, name, origin, stub=True, gitlinks=gitlinks)


def swapped(found: Sources, target: Target) -> list[str]:
    """The sources the rehearsal swaps for stand-ins, one line each (for the report's swap list)."""
    lines = []
    if target.cutlass is not None:
        lines.append(f"source cutlass: {target.cutlass.ref} -> {found.cutlass.origin} (headers only)")
    for external, local in found.externals:
        lines.append(f"source {external.name}: {external.repo} {external.ref[:12]} -> {local.origin}")
    return lines


def describe(found: Sources) -> str:
    lines = ["offline sources (local git remotes):"]
    for local in found.all():
        lines.append(f"  {'STAND-IN ' if local.stub else ''}{local.name} {local.commit[:12]}  {local.origin}")
    return "\n".join(lines)


def log_sources(found: Sources) -> None:
    log.info(describe(found))
