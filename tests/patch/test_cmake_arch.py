"""cmake-arch-sm121 on real sdists: what the patched files say, and what vLLM's own CMake helpers make of them.

Every release from 0.10.0, patched with the whole set (as a build does), is read; the CMake
evaluation runs once per distinct (CMakeLists.txt, cmake/utils.cmake) content, found by hash.
It runs the real ``cmake/utils.cmake`` of each tree with CMake (``cmake -P``): the requested arch
list goes through ``extract_unique_cuda_archs_ascending`` and ``cuda_archs_loose_intersection``
exactly as in a build, once for CUDA 12.9 and once for CUDA 13.0.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.patch import cmake
from sparkbuild.patch.rules import cmake_arch_sm121
from tests.support.trees import RELEASES, TreeFactory, variants

# Archs whose code runs on sm_121: its own cubins, plain or family 12.0 (same major, binary
# compatible). An arch-specific 12.0a cubin does not load there.
RUNS_ON_SM121 = {"12.1a", "12.1", "12.1f", "12.0f", "12.0"}


def cmake_files(tree: Path) -> list[Path]:
    return [tree / "CMakeLists.txt", *sorted((tree / "cmake").rglob("*.cmake"))]


def arch_lists(path: Path) -> list[tuple[int, list[str]]]:
    """(line, items) of every quoted list in the arch commands of a file."""
    found = []
    for c in cmake.commands(path.read_text()):
        if c.name in ("cuda_archs_loose_intersection", "list", "set"):
            items = [i for q in re.findall(r'"([^"]*)"', c.args) for i in q.split(";")]
            found.append((c.line, items))
    return found


@pytest.mark.parametrize("version", RELEASES)
def test_every_list_with_120a_has_121a(version: str, patched: TreeFactory) -> None:
    for path in cmake_files(patched(version)):
        for line, items in arch_lists(path):
            if "12.0a" in items:
                assert "12.1a" in items, f"{path}:{line}: {items}"


@pytest.mark.parametrize("version", RELEASES)
def test_supported_archs_have_121_where_family_targets_do_not_cover_it(version: str, patched: TreeFactory) -> None:
    text = (patched(version) / "CMakeLists.txt").read_text()
    branches = [c for c in cmake.commands(text) if c.name == "set" and "CUDA_SUPPORTED_ARCHS" in c.args]
    assert branches
    for c in branches:
        items = re.findall(r'"([^"]*)"', c.args)[0].split(";")
        if "12.0" in items and (c.cuda_min is None or c.cuda_min < cmake_arch_sm121.FAMILY_CUDA):
            assert "12.1" in items, f"line {c.line}: {items}"


@pytest.mark.parametrize("version", RELEASES)
def test_utils_regexes_keep_the_arch_suffix(version: str, patched: TreeFactory) -> None:
    utils = (patched(version) / "cmake" / "utils.cmake").read_text()
    assert "\\([0-9]+\\)\\([0-9][af]?\\)" in utils
    assert "compute_\\([0-9]+[af]?\\)" in utils
    assert "compute_\\([0-9]+a?\\)" not in utils


def test_flashkda_gets_121a_on_cuda_12_9_in_0_33(pristine: TreeFactory, patched: TreeFactory) -> None:
    before = (pristine("0.33.0") / "cmake/external_projects/flashkda.cmake").read_text()
    after = (patched("0.33.0") / "cmake/external_projects/flashkda.cmake").read_text()
    assert '"10.0a" "10.3a" "12.0a")' in before
    assert '"10.0a" "10.3a" "12.0a;12.1a")' in after


def test_upstream_version_is_left_byte_for_byte(pristine: TreeFactory, patched: TreeFactory) -> None:
    for path in cmake_files(pristine("0.19.0")):
        rel = path.relative_to(pristine("0.19.0"))
        assert (patched("0.19.0") / rel).read_bytes() == path.read_bytes(), rel


# --- the real helpers, run by CMake ---------------------------------------------------------

_GE = re.compile(r"(NOT\s+)?\$?\{?CMAKE_CUDA_COMPILER_VERSION\}?\s+VERSION_GREATER_EQUAL\s+(\d+\.\d+)")


def _holds(args: str, cuda: float) -> bool:
    """Only the CUDA-version terms decide; any other term is taken as true."""
    return all((cuda >= float(v)) != bool(neg) for neg, v in _GE.findall(args))


def active_lists(text: str, cuda: float) -> tuple[str, dict[str, str]]:
    """CUDA_SUPPORTED_ARCHS and each kernel list that a build with this CUDA version uses."""
    frames: list[tuple[bool, bool]] = []  # (branch active, some branch taken) per open if()
    supported, lists = "", {}
    for c in cmake.commands(text):
        parent = all(active for active, _ in frames)
        if c.name == "if":
            cond = _holds(c.args, cuda)
            frames.append((cond, cond))
        elif c.name == "elseif":
            taken = frames[-1][1]
            cond = not taken and _holds(c.args, cuda)
            frames[-1] = (cond, taken or cond)
        elif c.name == "else":
            frames[-1] = (not frames[-1][1], True)
        elif c.name == "endif":
            frames.pop()
        elif parent and c.name == "set" and c.args.split()[0] == "CUDA_SUPPORTED_ARCHS":
            supported = re.findall(r'"([^"]*)"', c.args)[0]
        elif parent and c.name == "cuda_archs_loose_intersection" and '"${CUDA_ARCHS}"' in c.args:
            var, quoted = c.args.split()[0], re.findall(r'"([^"]*)"', c.args)[0]
            lists[f"{var}@{c.line}"] = quoted
    return supported, lists


EVAL = """\
cmake_minimum_required(VERSION 3.25)
include("{utils}")
extract_unique_cuda_archs_ascending(CUDA_ARCHS "-gencode arch=compute_{sm},code=sm_{sm}")
cuda_archs_loose_intersection(CUDA_ARCHS "{supported}" "${{CUDA_ARCHS}}")
message("CUDA_ARCHS=${{CUDA_ARCHS}}")
{calls}
"""


def intersect(tree: Path, sm: str, supported: str, lists: dict[str, str]) -> dict[str, list[str]]:
    """Run vLLM's helpers for TORCH_CUDA_ARCH_LIST=<sm> and return each list's result."""
    calls = "\n".join(
        f'cuda_archs_loose_intersection(OUT "{items}" "${{CUDA_ARCHS}}")\nmessage("{key}=${{OUT}}")'
        for key, items in lists.items()
    )
    with tempfile.TemporaryDirectory(prefix="sparkbuild-eval-") as work:
        script = Path(work) / "eval.cmake"
        script.write_text(EVAL.format(utils=tree / "cmake" / "utils.cmake", sm=sm, supported=supported, calls=calls))
        done = subprocess.run([shutil.which("cmake") or "cmake", "-P", script], capture_output=True, text=True, check=True)
    return {k: v.split(";") if v else [] for k, v in (line.split("=", 1) for line in done.stderr.splitlines() if "=" in line)}


def unrunnable(tree: Path, cuda: float) -> dict[str, list[str]]:
    """Kernel lists that serve sm_120 but would give sm_121 no code it can run."""
    supported, lists = active_lists((tree / "CMakeLists.txt").read_text(), cuda)
    on_120 = intersect(tree, "120a", supported, lists)
    on_121 = intersect(tree, "121a", supported, lists)
    serves_120 = [k for k in lists if any(a.startswith("12.") for a in on_120[k])]
    assert serves_120, "no SM12x kernel list found; the reader missed the CMake layout"
    return {k: on_121[k] for k in serves_120 if not RUNS_ON_SM121 & set(on_121[k])}


def distinct_cmake(patched: TreeFactory, versions: tuple[str, ...]) -> dict[str, Path]:
    """One patched tree per distinct (CMakeLists.txt, cmake/utils.cmake) content, by hash."""
    found: dict[str, Path] = {}
    for version in versions:
        tree = patched(version)
        key = hashlib.sha256((tree / "CMakeLists.txt").read_bytes() + (tree / "cmake/utils.cmake").read_bytes()).hexdigest()[:12]
        found.setdefault(key, tree)
    return found


@pytest.mark.parametrize("cuda", [12.9, 13.0])
def test_every_patched_variant_gives_sm121_runnable_code(cuda: float, patched: TreeFactory) -> None:
    """For each distinct CMake variant of every release, vLLM's helpers give every SM12x kernel list
    code that runs on sm_121."""
    found = distinct_cmake(patched, RELEASES)
    assert len(found) > 10
    failures = {f"{key} ({tree.name})": bad for key, tree in found.items() if (bad := unrunnable(tree, cuda))}
    assert failures == {}


@pytest.mark.parametrize("version", ["0.10.0", "0.11.0", "0.16.0"])
def test_unpatched_lists_give_only_sm120a_on_cuda_12_9(version: str, pristine: TreeFactory) -> None:
    """The bug the patch fixes, reproduced with the same helpers: SM12x kernels become sm_120a only
    (0.10.0 has no SM12x FP4 kernels yet; its scaled-mm ones break the same way)."""
    broken = unrunnable(pristine(version), 12.9)
    kind = "SCALED_MM_ARCHS" if version == "0.10.0" else "FP4_ARCHS"
    assert any(k.startswith(kind) for k in broken), broken
    assert all(archs == ["12.0a"] for archs in broken.values()), broken


QUTLASS = "cmake/external_projects/qutlass.cmake"
PICK = """\
cmake_minimum_required(VERSION 3.25)
set(QUTLASS_ARCHS "{archs}")
{block}
message("QUTLASS_TARGET_CC=${{QUTLASS_TARGET_CC}}")
"""


def qutlass_target(tree: Path, cuda: float) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """The archs qutlass.cmake intersects for TORCH_CUDA_ARCH_LIST=12.1a, and its own code pick run on them."""
    supported, _ = active_lists((tree / "CMakeLists.txt").read_text(), cuda)
    text = (tree / QUTLASS).read_text()
    _, lists = active_lists(text, cuda)
    (items,) = lists.values()
    archs = intersect(tree, "121a", supported, {"QUTLASS": items})["QUTLASS"]
    start = text.index("if(QUTLASS_ARCHS MATCHES")
    block = text[start : text.index("endif()", start) + len("endif()")]
    with tempfile.TemporaryDirectory(prefix="sparkbuild-qutlass-") as work:
        script = Path(work) / "qutlass.cmake"
        script.write_text(PICK.format(archs=";".join(archs), block=block))
        done = subprocess.run([shutil.which("cmake") or "cmake", "-P", script], capture_output=True, text=True, check=False)
    return archs, done


@pytest.mark.parametrize("cuda", [12.9, 13.0])
def test_every_qutlass_variant_builds_sm121_code(cuda: float, sweep: dict[str, patch.Report], patched: TreeFactory) -> None:
    """Each distinct qutlass.cmake the rule changes (0.11.1 - 0.18.1), run through its own arch pick."""
    found = variants(sweep, "qutlass.cmake")
    assert len(found) == 2
    for v in found:
        archs, done = qutlass_target(patched(v.version), cuda)
        # Up to 0.13.0 qutlass.cmake has one list for every CUDA, so CUDA 13 (no 12.1) keeps sm_120a (README).
        one_list = "VERSION_GREATER_EQUAL 13" not in (patched(v.version) / QUTLASS).read_text()
        want = (["12.0a"] if one_list else ["12.0f"]) if cuda >= 13 else ["12.1a"]
        assert archs == want, v
        assert done.returncode == 0 and "QUTLASS_TARGET_CC=120" in done.stderr, (v, done.stderr)


@pytest.mark.parametrize("version", ["0.12.0", "0.16.0"])
def test_qutlass_list_without_its_match_stops_the_configure(version: str, patched: TreeFactory, tree_copy: TreeFactory) -> None:
    """12.1a in the list without the widened MATCHES is a FATAL_ERROR: why the rule changes both."""
    tree = tree_copy(version)
    qutlass = tree / QUTLASS
    qutlass.write_text(qutlass.read_text().replace('"12.0a;', '"12.0a;12.1a;'))
    for rel in ("CMakeLists.txt", "cmake/utils.cmake"):
        (tree / rel).write_text((patched(version) / rel).read_text())
    archs, done = qutlass_target(tree, 12.9)
    assert archs == ["12.1a"]
    assert done.returncode != 0 and "[QUTLASS] internal error parsing CUDA_ARCHS='12.1a'" in done.stderr, done.stderr
