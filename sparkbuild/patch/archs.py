"""What vLLM's own CMake makes of an arch list, per kernel list, for one CUDA version.

Reads ``CMakeLists.txt`` and ``cmake/external_projects/*.cmake`` for the branches a CUDA version
takes (only the ``CMAKE_CUDA_COMPILER_VERSION`` terms of an ``if`` decide; any other term counts as
true), collects every ``cuda_archs_loose_intersection(OUT SRC "${CUDA_ARCHS}")`` with its source
list (a literal, or a variable built by ``set``/``list(APPEND)`` on the way), then runs the tree's
own ``cmake/utils.cmake`` with CMake (``cmake -P``): the requested arch list goes through
``extract_unique_cuda_archs_ascending`` and ``cuda_archs_loose_intersection`` exactly as in a
build. The helpers changed across releases (the a/f suffixes, family targets), so they are run,
never re-implemented. Used for the support table's NEEDED column (``cmake-arch-sm121``) and by
its tests; it needs ``cmake`` on PATH, so the container's patch stage never imports it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.errors import ToolMissingError
from sparkbuild.patch import cmake

_GE = re.compile(r"(NOT\s+)?\$?\{?CMAKE_CUDA_COMPILER_VERSION\}?\s+VERSION_GREATER_EQUAL\s+(\d+\.\d+)")
_VAR = re.compile(r"^\$\{(\w+)\}$")
EXTERNALS = "cmake/external_projects"


@dataclass(frozen=True)
class KernelList:
    """One ``cuda_archs_loose_intersection`` a build with the CUDA version runs."""

    var: str
    file: str
    line: int
    items: str  # the source list, ";"-separated

    @property
    def key(self) -> str:
        return f"{self.var}@{self.file}:{self.line}"


def _holds(args: str, cuda: float) -> bool:
    return all((cuda >= float(v)) != bool(neg) for neg, v in _GE.findall(args))


def active_lists(text: str, cuda: float, file: str = "CMakeLists.txt") -> tuple[str, list[KernelList]]:
    """``CUDA_SUPPORTED_ARCHS`` and each kernel list a build with this CUDA version uses."""
    frames: list[tuple[bool, bool]] = []  # (branch active, some branch taken) per open if()
    supported = ""
    variables: dict[str, list[str]] = {}
    lists: list[KernelList] = []
    for c in cmake.commands(text):
        active = all(a for a, _ in frames)
        if c.name == "if":
            cond = _holds(c.args, cuda)
            frames.append((cond, cond))
        elif c.name == "elseif" and frames:
            taken = frames[-1][1]
            cond = not taken and _holds(c.args, cuda)
            frames[-1] = (cond, taken or cond)
        elif c.name == "else" and frames:
            frames[-1] = (not frames[-1][1], True)
        elif c.name == "endif" and frames:
            frames.pop()
        elif not active or not c.args.split():
            continue
        elif c.name == "set" and c.args.split()[0] == "CUDA_SUPPORTED_ARCHS":
            supported = ";".join(c.quoted())
        elif c.name == "set":
            variables[c.args.split()[0]] = c.quoted()
        elif c.name == "list" and c.args.split()[:1] == ["APPEND"] and len(c.args.split()) > 1:
            variables.setdefault(c.args.split()[1], []).extend(c.quoted())
        elif c.name == "cuda_archs_loose_intersection" and '"${CUDA_ARCHS}"' in c.args:
            source = cmake.QUOTED.search(c.args)
            if source is None:
                continue
            named = _VAR.match(source.group(1))
            items = ";".join(variables.get(named.group(1), [])) if named else source.group(1)
            lists.append(KernelList(c.args.split()[0], file, c.line, items))
    return supported, lists


def kernel_lists(tree: Path, cuda: float) -> tuple[str, list[KernelList]]:
    """The supported list and every kernel list of the top CMakeLists.txt and the external projects."""
    supported, lists = active_lists((tree / "CMakeLists.txt").read_text(encoding="utf-8"), cuda)
    for path in sorted((tree / EXTERNALS).glob("*.cmake")) if (tree / EXTERNALS).is_dir() else []:
        rel = path.relative_to(tree).as_posix()
        lists += active_lists(path.read_text(encoding="utf-8"), cuda, rel)[1]
    return supported, lists


_EVAL = """\
cmake_minimum_required(VERSION 3.25)
include("{utils}")
extract_unique_cuda_archs_ascending(CUDA_ARCHS "{gencode}")
cuda_archs_loose_intersection(CUDA_ARCHS "{supported}" "${{CUDA_ARCHS}}")
message("CUDA_ARCHS=${{CUDA_ARCHS}}")
{calls}
"""


def gencode(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST (``12.1a``, ``9.0 12.0+PTX``) as the -gencode flags torch would write."""
    flags = []
    for entry in arch_list.replace(";", " ").split():
        base = entry.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode arch=compute_{base},code=sm_{base}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode arch=compute_{base},code=compute_{base}")
    return " ".join(flags)


def intersect(tree: Path, arch_list: str, supported: str, lists: list[KernelList]) -> dict[str, list[str]]:
    """vLLM's helpers run for TORCH_CUDA_ARCH_LIST=``arch_list``: each list's result, by key."""
    found = shutil.which("cmake")
    if found is None:
        raise ToolMissingError("cmake is not on PATH; it runs vLLM's own arch helpers (pip install cmake, or apt install cmake)")
    calls = "\n".join(
        f'cuda_archs_loose_intersection(OUT "{k.items}" "${{CUDA_ARCHS}}")\nmessage("{k.key}=${{OUT}}")' for k in lists
    )
    with tempfile.TemporaryDirectory(prefix="sparkbuild-archs-") as work:
        script = Path(work) / "eval.cmake"
        text = _EVAL.format(utils=tree / "cmake" / "utils.cmake", gencode=gencode(arch_list), supported=supported, calls=calls)
        script.write_text(text, encoding="utf-8")
        done = subprocess.run([found, "-P", str(script)], capture_output=True, text=True, check=True)
    pairs = (line.split("=", 1) for line in done.stderr.splitlines() if "=" in line)
    return {k: v.split(";") if v else [] for k, v in pairs}


def runs_on(arch: str, device: str) -> bool:
    """Whether code for ``arch`` (``12.0f``, ``12.1a``, ``12.0``) runs on ``device`` (``12.1``):
    an arch-specific target on its own GPU only, a family or plain one on any later minor of its major."""
    m = re.fullmatch(r"(\d+)\.(\d+)([af]?)", arch)
    d = re.fullmatch(r"(\d+)\.(\d+)", device)
    if m is None or d is None or m.group(1) != d.group(1):
        return False
    if m.group(3) == "a":
        return m.group(2) == d.group(2)
    return int(m.group(2)) <= int(d.group(2))


def unrunnable(tree: Path, cuda: float, arch_list: str = "12.1a", device: str = "12.1") -> dict[str, list[str]]:
    """Kernel lists that serve the device's family (they give code for a ``X.0a`` build) but give a
    build for ``arch_list`` no code that runs on ``device``: key -> what they give instead."""
    supported, lists = kernel_lists(tree, cuda)
    major = device.split(".")[0]
    on_family = intersect(tree, f"{major}.0a", supported, lists)
    on_device = intersect(tree, arch_list, supported, lists)
    serving = [k.key for k in lists if any(a.startswith(f"{major}.") for a in on_family.get(k.key, []))]
    return {k: on_device.get(k, []) for k in serving if not any(runs_on(a, device) for a in on_device.get(k, []))}
