"""The kernel sources vLLM's CMake would clone from GitHub during the compile, read from its CMake files.

vLLM declares each one (vllm-flash-attn, FlashMLA, DeepGEMM, qutlass, triton_kernels, ...) in
``cmake/external_projects/<name>.cmake`` as a ``FetchContent`` git source, and lets a
``<NAME>_SRC_DIR`` variable hand CMake a local tree instead. sparkbuild reads the repository and
ref per vLLM version, pins the ref with ``resolve``, fetches each at its commit in the source
stage and points the variable at it: the compile then needs no network, every source is in the
record and the content hash. CUTLASS is not listed here: the matrix pins it (``cutlass:``).

Pure: reads files of a source tree, nothing else. Runs inside the source stage too (stdlib only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# Which submodules CMake initializes for a git source, as ``FetchContent`` reads ``GIT_SUBMODULES``:
# no option at all means every submodule ("all"), recursively; otherwise the paths listed. An
# explicit empty value means none in ``FetchContent_Declare`` (policy CMP0097) but every one in
# ``FetchContent_Populate``'s direct form, which drops the empty argument (CMake 3.25 and 4.4 alike;
# tests/upstream/test_externals_submodules.py runs both against CMake).
Submodules = Literal["all"] | tuple[str, ...]

# Where CMake's default ("all", recursively) fetches more than a CUDA build of vLLM reads: the submodules
# the build uses, per project. The source stage fetches these alone; a path the project no longer has
# fails its `git submodule update` naming it, and one the build needs but is not listed fails the
# configure or the compile naming the missing file. The evidence, per project:
# - vllm-flash-attn: its CMakeLists.txt includes csrc/cutlass/include and no other submodule (its own
#   setup.py initializes csrc/cutlass alone); csrc/composable_kernel and third_party/aiter are ROCm's.
BUILD_USES: dict[str, tuple[str, ...]] = {"vllm-flash-attn": ("csrc/cutlass",)}

FOLDER = "cmake/external_projects"
_ENV_RE = re.compile(r"DEFINED\s+ENV\{(\w+)\}")
_DECLARE_RE = re.compile(r"FetchContent_(Declare|Populate)\s*\(\s*([\w-]+)(.*?)\)", re.DOTALL)
_SET_RE = re.compile(r"^\s*set\(\s*(\w+)\s+\"?([^\s\")]+)\"?\s*\)", re.MULTILINE)
_VAR_RE = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True, kw_only=True)
class External:
    """One external project as a vLLM version declares it."""

    name: str
    # The variable (environment or CMake) that hands CMake a local tree instead of a clone.
    env: str | None
    repo: str
    ref: str
    # Where in the checkout the variable must point (``SOURCE_SUBDIR``, e.g. triton_kernels).
    subdir: str
    submodules: Submodules
    # GIT_SUBMODULES_RECURSE: CMake updates submodules with --recursive unless it is set false.
    recursive: bool
    file: str
    # How the compile gets the tree (see ``handoff``): "env", the file's *_SRC_DIR variable, or
    # "fetchcontent", CMake's FETCHCONTENT_SOURCE_DIR_<NAME>, where the *_SRC_DIR branch differs
    # from a clone's (vllm_flash_attn.cmake links FA4's Python files into the source tree there).
    handoff: Literal["env", "fetchcontent"] = "env"
    # The commit ``ref`` names; set by ``resolve`` (a full SHA in the CMake file pins itself).
    commit: str | None = None

    @property
    def path(self) -> str:
        """Where the source stage checks it out, and the variable's value (below it for SOURCE_SUBDIR)."""
        return f"/src/externals/{self.name}" + (f"/{self.subdir}" if self.subdir else "")

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "env": self.env,
            "repo": self.repo,
            "ref": self.ref,
            "commit": self.commit,
            "subdir": self.subdir,
            "submodules": self.submodules if self.submodules == "all" else list(self.submodules),
            "recursive": self.recursive,
            "file": self.file,
            "handoff": self.handoff,
        }

    @property
    def fetched(self) -> Submodules:
        """The submodules the source stage fetches: CMake's, except where CMake would take every one
        and the build uses fewer (``BUILD_USES``)."""
        if self.submodules == "all" and self.name in BUILD_USES:
            return BUILD_USES[self.name]
        return self.submodules

    def fetch_args(self) -> tuple[str, ...]:
        """The source stage's ``git-at-commit`` options that fetch the submodules the build uses."""
        fetched = self.fetched
        if fetched == ():
            return ()
        paths = () if fetched == "all" else fetched
        return ("--submodules", *(() if self.recursive else ("--no-recursive",)), *paths)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> External:
        def text(key: str) -> str:
            value = data.get(key)
            if not isinstance(value, str):
                raise ScanError(f"external project entry {data!r}: '{key}' is not a string")
            return value

        env, commit = data.get("env"), data.get("commit")
        return cls(
            name=text("name"),
            env=env if isinstance(env, str) else None,
            repo=text("repo"),
            ref=text("ref"),
            commit=commit if isinstance(commit, str) else None,
            subdir=text("subdir") if data.get("subdir") else "",
            submodules=_submodules_json(data.get("submodules"), data),
            recursive=data.get("recursive", True) is not False,
            file=text("file"),
            handoff="fetchcontent" if data.get("handoff") == "fetchcontent" else "env",
        )


def handoff(found: tuple[External, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
    """How the vLLM stage hands each tree to the compile: environment variables, and CMake arguments
    (the source stage checks each one out at ``External.path``)."""
    env = {e.env: e.path for e in found if e.handoff == "env" and e.env}
    # FetchContent's override is the checkout's root; the declaration's SOURCE_SUBDIR still applies.
    args = tuple(
        f"-DFETCHCONTENT_SOURCE_DIR_{e.name.upper()}=/src/externals/{e.name}" for e in found if e.handoff == "fetchcontent"
    )
    return env, args


def _submodules_json(value: object, data: dict[str, object]) -> Submodules:
    if value == "all" or isinstance(value, bool):
        # A lock written before the paths were kept holds a bool (whether GIT_SUBMODULES was
        # given); every submodule is a superset of what CMake fetched in either case.
        return "all"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(str(v) for v in value)
    raise ScanError(f"external project entry {data!r}: 'submodules' is neither \"all\" nor a list of paths")


class ScanError(Exception):
    """A CMake file declares a git source sparkbuild cannot read; names the file and what is missing."""


def scan(tree: Path) -> tuple[External, ...]:
    """Every git source that ``tree``'s ``cmake/external_projects/*.cmake`` declares, by file name."""
    folder = tree / FOLDER
    found: list[External] = []
    for path in sorted(folder.glob("*.cmake")) if folder.is_dir() else []:
        external = _read(path, f"{FOLDER}/{path.name}")
        if external is not None:
            found.append(external)
    return tuple(found)


def _read(path: Path, relative: str) -> External | None:
    text = _strip_comments(path.read_text(encoding="utf-8", errors="replace"))
    for match in _DECLARE_RE.finditer(text):
        body = match.group(3)
        repo = _option(body, "GIT_REPOSITORY")
        if repo is None:
            continue  # the branch that uses a local SOURCE_DIR
        before = text[: match.start()]
        ref = _option(body, "GIT_TAG")
        if ref is None:
            raise ScanError(f"{relative}: {match.group(2)} has GIT_REPOSITORY but no GIT_TAG")
        envs = [e for e in _ENV_RE.findall(text) if e.endswith("SRC_DIR")]
        return External(
            name=match.group(2),
            env=envs[0] if envs else None,
            repo=_expand(repo, before, relative),
            ref=_expand(ref, before, relative),
            subdir=_expand(_option(body, "SOURCE_SUBDIR") or "", before, relative),
            submodules=_submodules(body, declared=match.group(1) == "Declare"),
            recursive=(_option(body, "GIT_SUBMODULES_RECURSE") or "ON").upper() not in _CMAKE_FALSE,
            file=relative,
            # Declared (so FetchContent honours its override) and a local tree is installed as a
            # link into it, which the wheel cannot carry: hand the tree over as a clone.
            handoff="fetchcontent" if match.group(1) == "Declare" and "CREATE_LINK" in text else "env",
        )
    return None


_TOKEN_RE = re.compile(r'"([^"]*)"|([^\s"()]+)')
_KEYWORD_RE = re.compile(r"^[A-Z][A-Z0-9_]+$")
_CMAKE_FALSE = {"0", "OFF", "NO", "FALSE", "N", "IGNORE", "NOTFOUND", ""}


def _submodules(body: str, *, declared: bool) -> Submodules:
    """What ``GIT_SUBMODULES`` asks of CMake (see ``Submodules``): the values after the keyword,
    up to the next option keyword (CMake's keywords are upper case; submodule paths are not)."""
    tokens = [(quoted, bare) for quoted, bare in _TOKEN_RE.findall(body)]
    words = [bare or quoted for quoted, bare in tokens]
    if "GIT_SUBMODULES" not in words:
        return "all"
    values = []
    for quoted, bare in tokens[words.index("GIT_SUBMODULES") + 1 :]:
        if bare and _KEYWORD_RE.match(bare):
            break
        values.append(bare or quoted)
    listed = tuple(v for v in values if v)
    return listed if listed or declared else "all"


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] if not line.lstrip().startswith("#") else "" for line in text.splitlines())


def _option(body: str, key: str) -> str | None:
    match = re.search(rf"\b{key}\s+\"?([^\s\")]+)\"?", body)
    return match.group(1) if match else None


def _expand(value: str, before: str, relative: str) -> str:
    """``${VAR}`` replaced by the last ``set(VAR value)`` above its use in the same file.

    vLLM sets each such variable once per target device branch, and the CUDA branch comes last
    (ROCm's ``if`` first); a value that stays unexpanded is an error, not a guess.
    """
    for _ in range(5):
        names = _VAR_RE.findall(value)
        if not names:
            return value
        for name in names:
            sets = [m.group(2) for m in _SET_RE.finditer(before) if m.group(1) == name]
            if not sets:
                raise ScanError(f"{relative}: cannot tell the value of ${{{name}}} (no set({name} ...) above its use)")
            value = value.replace(f"${{{name}}}", sets[-1])
    raise ScanError(f"{relative}: {value!r} does not expand to a plain value")


def cutlass_revision(tree: Path) -> str | None:
    """The CUTLASS tag vLLM's CMakeLists.txt asks for (``CUTLASS_REVISION``), if it names one."""
    cmake = tree / "CMakeLists.txt"
    if not cmake.is_file():
        return None
    match = re.search(r"set\(\s*CUTLASS_REVISION\s+\"([^\"]+)\"", cmake.read_text(encoding="utf-8", errors="replace"))
    return match.group(1) if match else None


# The files that name vLLM's FlashInfer and CUTLASS (sparkbuild.plan.companions checks a target against them).
COMPANION_FILES = ("requirements/cuda.txt", "CMakeLists.txt")


def flashinfer_requirement(tree: Path) -> str | None:
    """The FlashInfer version vLLM's ``requirements/cuda.txt`` pins (``flashinfer-python==X``), if it pins one."""
    path = tree / "requirements" / "cuda.txt"
    if not path.is_file():
        return None
    match = re.search(r"^flashinfer-python\s*==\s*([^\s;#]+)", path.read_text(encoding="utf-8", errors="replace"), re.MULTILINE)
    return match.group(1) if match else None
