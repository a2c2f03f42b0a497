"""The source stage fetches an external project with the submodules vLLM's CMake would, for real:
local git repositories with submodules (one nested), declared the way vLLM's CMake files declare
them, cloned once by CMake's own FetchContent and once by the source stage's ``git-at-commit`` with
the options sparkbuild reads from the same file; the two checkouts must hold the same files.

The first case is vLLM 0.33.0's own ``vllm_flash_attn.cmake`` (its repository and tag pointed at the
local one): it gives no ``GIT_SUBMODULES``, which CMake reads as every submodule, recursively, and
flash-attention's kernels include ``<cute/tensor.hpp>`` from its ``csrc/cutlass`` submodule.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from sparkbuild.upstream import externals
from tests.support import ROOT
from tests.support.git import GIT_ENV, git
from tests.support.trees import TreeFactory

GIT_AT_COMMIT = ROOT / "dockerfiles" / "spark" / "git-at-commit.sh"
FA_FILE = "cmake/external_projects/vllm_flash_attn.cmake"
# Submodules by file:// URL: git refuses that transport for submodules unless told (CVE-2022-39253).
FILE_TRANSPORT = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.file.allow", "GIT_CONFIG_VALUE_0": "always"}


def repo(path: Path, files: dict[str, str], submodules: dict[str, Path] | None = None) -> str:
    """A git repository at ``path`` with ``files`` and ``submodules`` (path -> repository); its commit."""
    path.mkdir(parents=True)
    git("init", "--quiet", "--initial-branch=main", cwd=path)
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    for rel, source in (submodules or {}).items():
        subprocess.run(
            ["git", "-c", "protocol.file.allow=always", "submodule", "--quiet", "add", f"file://{source}", rel],
            cwd=path,
            env={**os.environ, **GIT_ENV},
            check=True,
            capture_output=True,
        )
    git("add", "--all", cwd=path)
    git("commit", "--quiet", "-m", "files", cwd=path)
    return git("rev-parse", "HEAD", cwd=path)


@pytest.fixture(scope="module")
def flash_attention(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A stand-in flash-attention: its cutlass (with a nested submodule) and a ROCm one, as upstream has."""
    root = tmp_path_factory.mktemp("repos")
    repo(root / "deep", {"deep.h": "// nested\n"})
    repo(root / "cutlass", {"include/cute/tensor.hpp": "#pragma once\n"}, {"tools/deep": root / "deep"})
    repo(root / "ck", {"include/ck.hpp": "#pragma once\n"})
    fa_files = {
        "CMakeLists.txt": "cmake_minimum_required(VERSION 3.25)\nproject(fa NONE)\n",
        "csrc/flash_api.cpp": "#include <cute/tensor.hpp>\n",
    }
    commit = repo(
        root / "fa",
        fa_files,
        {"csrc/cutlass": root / "cutlass", "csrc/composable_kernel": root / "ck"},
    )
    return root / "fa", commit


def files(tree: Path) -> set[str]:
    return {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() and ".git" not in p.relative_to(tree).parts}


def cmake_checkout(cmake_file: Path, name: str, work: Path, args: Sequence[str] = ()) -> set[str]:
    """What CMake's FetchContent checks out for the declaration in ``cmake_file`` (configured with ``args``)."""
    (work / "top").mkdir(parents=True)
    (work / "top" / "CMakeLists.txt").write_text(
        textwrap.dedent(f"""\
            cmake_minimum_required(VERSION 3.25)
            project(top NONE)
            include(FetchContent)
            set(VLLM_GPU_LANG NONE)
            include({cmake_file})
            """)
    )
    done = subprocess.run(
        [
            shutil.which("cmake") or "cmake",
            "-S",
            work / "top",
            "-B",
            work / "build",
            f"-DFETCHCONTENT_BASE_DIR={work / 'deps'}",
            *args,
        ],
        env={**os.environ, **FILE_TRANSPORT},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return files(work / "deps" / f"{name}-src")


def source_stage_checkout(external: externals.External, work: Path) -> tuple[set[str], str]:
    """What the source stage's git-at-commit fetches for ``external``, and its record."""
    record = work / "sources.txt"
    subprocess.run(
        ["sh", GIT_AT_COMMIT, external.repo, external.ref, work / "src", *external.fetch_args()],
        env={**os.environ, **FILE_TRANSPORT, "SPARKBUILD_SOURCES_RECORD": str(record)},
        capture_output=True,
        text=True,
        check=True,
    )
    return files(work / "src"), record.read_text()


def test_vllms_flash_attention_file_gets_every_submodule_and_the_source_stage_the_one_the_build_uses(
    pristine: TreeFactory, flash_attention: tuple[Path, str], tmp_path: Path
) -> None:
    """CMake would clone ROCm's composable_kernel beside csrc/cutlass (issue 44, item 3); the source
    stage fetches csrc/cutlass alone (``externals.BUILD_USES``), recursively as CMake would."""
    url, commit = f"file://{flash_attention[0]}", flash_attention[1]
    text = (pristine("0.33.0") / FA_FILE).read_text()
    assert "GIT_SUBMODULES" not in text  # vLLM's file names none: CMake takes every one
    tree = tmp_path / "vllm"
    (tree / FA_FILE).parent.mkdir(parents=True)
    upstream = "https://github.com/vllm-project/flash-attention.git"
    tag = next(line.split()[1] for line in text.splitlines() if line.strip().startswith("GIT_TAG"))
    (tree / FA_FILE).write_text(text.replace(upstream, url).replace(tag, commit))
    (external,) = externals.scan(tree)
    assert external.submodules == "all" and external.recursive
    by_cmake = cmake_checkout(tree / FA_FILE, "vllm-flash-attn", tmp_path / "cmake")
    assert {"csrc/cutlass/include/cute/tensor.hpp", "csrc/cutlass/tools/deep/deep.h"} <= by_cmake
    assert "csrc/composable_kernel/include/ck.hpp" in by_cmake
    assert external.fetch_args() == ("--submodules", "csrc/cutlass")
    fetched, record = source_stage_checkout(external, tmp_path / "stage")
    assert fetched == {f for f in by_cmake if not f.startswith("csrc/composable_kernel/")}
    assert "  csrc/cutlass " in record and "  csrc/cutlass/tools/deep " in record  # each submodule's commit recorded
    assert "composable_kernel" not in record


POPULATE = """\
FetchContent_Populate(
  proj
  SUBBUILD_DIR "${{FETCHCONTENT_BASE_DIR}}/proj-subbuild"
  SOURCE_DIR "${{FETCHCONTENT_BASE_DIR}}/proj-src"
  BINARY_DIR "${{FETCHCONTENT_BASE_DIR}}/proj-build"
  GIT_REPOSITORY {url}
  GIT_TAG {commit}
  {option}
  GIT_PROGRESS TRUE
)
"""
DECLARE = """\
FetchContent_Declare(
  proj
  GIT_REPOSITORY {url}
  GIT_TAG {commit}
  {option}
)
FetchContent_MakeAvailable(proj)
"""


@pytest.mark.parametrize(
    ("form", "option", "expected"),
    [
        (POPULATE, 'GIT_SUBMODULES "csrc/cutlass"', ("csrc/cutlass",)),
        (DECLARE, "GIT_SUBMODULES csrc/cutlass\n  GIT_SUBMODULES_RECURSE OFF", ("csrc/cutlass",)),
        (DECLARE, 'GIT_SUBMODULES ""', ()),
        # FetchContent_Populate's direct form loses the empty argument: CMake takes every submodule.
        (POPULATE, 'GIT_SUBMODULES ""', "all"),
    ],
    ids=["listed", "listed-not-recursive", "empty-declared", "empty-populated"],
)
def test_a_listed_or_empty_git_submodules_gets_what_cmake_gets(
    form: str, option: str, expected: externals.Submodules, flash_attention: tuple[Path, str], tmp_path: Path
) -> None:
    """The forms vLLM's other files use (deepgemm.cmake lists two in FetchContent_Populate's direct
    form, flashkda.cmake one in FetchContent_Declare's) and CMP0097's empty value in both."""
    tree = tmp_path / "vllm"
    rel = "cmake/external_projects/proj.cmake"
    (tree / rel).parent.mkdir(parents=True)
    (tree / rel).write_text(
        "if (DEFINED ENV{PROJ_SRC_DIR})\n  set(PROJ_SRC_DIR $ENV{PROJ_SRC_DIR})\nendif()\n"
        + form.format(url=f"file://{flash_attention[0]}", commit=flash_attention[1], option=option)
    )
    (external,) = externals.scan(tree)
    assert external.submodules == expected
    by_cmake = cmake_checkout(tree / rel, "proj", tmp_path / "cmake")
    fetched, _ = source_stage_checkout(external, tmp_path / "stage")
    assert fetched == by_cmake
