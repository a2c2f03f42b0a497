"""The compile gets flash-attention's tree the way a clone arrives, with vLLM 0.33.0's own
``vllm_flash_attn.cmake`` and CMake: configured as the vLLM stage hands the tree over
(``externals.handoff``), then FA4's Python component installed as the wheel's build installs it.

Handed over through ``VLLM_FLASH_ATTN_SRC_DIR``, vLLM's file installs ``vllm/vllm_flash_attn/cute``
as a link into the source tree (for editing FA in place), which the build container's /src does not
outlive, with FA's own ``flash_attn.cute`` imports. Through FetchContent's override it copies the
files and rewrites the imports, as for a clone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from sparkbuild.upstream import externals
from tests.support.trees import TreeFactory
from tests.upstream.test_externals_submodules import FA_FILE, cmake_checkout, repo

CUTE = "flash_attn/cute/interface.py"


def test_fa4s_python_files_are_installed_as_files_with_vllms_imports(pristine: TreeFactory, tmp_path: Path) -> None:
    fa_files = {
        "CMakeLists.txt": "cmake_minimum_required(VERSION 3.25)\nproject(fa NONE)\n",
        CUTE: "from flash_attn.cute.utils import x\n",
    }
    fa = tmp_path / "externals" / "vllm-flash-attn"
    commit = repo(fa, fa_files)
    text = (pristine("0.33.0") / FA_FILE).read_text()
    tree = tmp_path / "vllm"
    (tree / FA_FILE).parent.mkdir(parents=True)
    tag = next(line.split()[1] for line in text.splitlines() if line.strip().startswith("GIT_TAG"))
    (tree / FA_FILE).write_text(text.replace(tag, commit))
    (external,) = externals.scan(tree)
    assert external.handoff == "fetchcontent"
    # The vLLM stage's handoff, its paths moved from /src/externals to this test's folder.
    env, args = externals.handoff((external,))
    assert env == {}  # not VLLM_FLASH_ATTN_SRC_DIR
    local = [a.replace("/src/externals", str(tmp_path / "externals")) for a in args]
    cmake_checkout(tree / FA_FILE, "vllm-flash-attn", tmp_path / "cmake", ["-DFETCHCONTENT_FULLY_DISCONNECTED=ON", *local])
    out = tmp_path / "install"
    subprocess.run(
        ["cmake", "--install", tmp_path / "cmake" / "build", "--component", "_vllm_fa4_cutedsl_C", "--prefix", out],
        check=True,
        capture_output=True,
        text=True,
    )
    installed = out / "vllm" / "vllm_flash_attn" / "cute" / "interface.py"
    assert not installed.is_symlink() and not installed.parent.is_symlink()
    assert installed.read_text() == "from vllm.vllm_flash_attn.cute.utils import x\n"
