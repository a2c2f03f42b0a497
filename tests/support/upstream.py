"""A real upstream for the lanes: vLLM's 0.32.0 and 0.33.0 sdists as commits of one git repository,
then release candidates made on top, served over the git protocol on loopback (``git daemon``).

History (oldest first)::

    v0.32.0 (annotated tag)  the 0.32.0 sdist
    v0.33.0                  the 0.33.0 sdist
    bump                     a harmless change
    break                    nvfp4_utils.cuh: the e2m1x2 asm replaced by intrinsics (e2m1-software conflicts)
    docs                     a harmless change; tagged v0.34.0rc1
    revert                   `git revert` of break; tagged v0.34.0rc2 by ``add_rc2()`` (the rc test does)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sparkbuild.config.options import Options
from sparkbuild.upstream import externals, sources
from tests.support import ROOT, cli
from tests.support.git import git, git_daemon

HEADER = "csrc/quantization/fp4/nvfp4_utils.cuh"


def replace_tree(repo: Path, source: Path) -> None:
    for child in repo.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    shutil.copytree(source, repo, dirs_exist_ok=True)


def commit(repo: Path, message: str) -> str:
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", message, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo)


def without_e2m1_asm(text: str) -> str:
    """Upstream moving the FP4 conversion to intrinsics: no e2m1x2 asm is left in the header."""
    return re.sub(r"asm volatile\((?:(?!\)\);).)*?e2m1x2.*?\)\);", "val = __nv_cvt_float8_to_fp4x8(array);", text, flags=re.S)


@dataclass
class Upstream:
    url: str
    repo: Path
    shas: dict[str, str] = field(default_factory=dict)

    def add_rc2(self) -> str:
        if "revert" not in self.shas:
            git("revert", "--no-edit", self.shas["break"], cwd=self.repo)
            self.shas["revert"] = git("rev-parse", "HEAD", cwd=self.repo)
            git("tag", "v0.34.0rc2", cwd=self.repo)
        return self.shas["revert"]


def sparkbuild(*args: str, cache: Path, out: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"SPARKBUILD_CACHE": str(cache), "SPARKBUILD_OUT": str(out or cache / "out"), "SPARKBUILD_REGISTRY": ""}
    return cli.run(*args, env=env)


def spark_matrix(path: Path, upstream: Upstream, vllm: str, image: str) -> Path:
    path.write_text(
        f"patches_dir: {ROOT / 'patches'}\n"
        + (ROOT / "matrix.yaml").read_text().split("bases:")[0]
        + textwrap.dedent(f"""\
        bases:
          cuda-devel: {{image: {image}}}
        upstreams:
          vllm: {upstream.url}/vllm
          cutlass: {upstream.url}/cutlass
        mirrors:
          "https://github.com/": {upstream.url}/github/
        targets:
          - profile: spark
            id: resolve-test
            vllm: {vllm}
            cutlass: {{ref: v4.7.1}}
            triton: {{ref: releases/v0.33, repo: {upstream.url}/vllm}}
            cuda: "13.0"
            torch: "2.14.0+cu130"
            base: cuda-devel
            runtime_base: cuda-devel
            patches: [cmake-arch-sm121]
            check: alphabet
        """)
    )
    return path


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    root = tmp_path_factory.mktemp("upstream")
    cache = Options.from_env().cache
    repo = root / "vllm"
    repo.mkdir()
    git("init", "--quiet", "--initial-branch=main", cwd=repo)
    shas: dict[str, str] = {}
    replace_tree(repo, sources.vllm_sdist("0.32.0", cache))
    shas["v0.32.0"] = commit(repo, "Release v0.32.0")
    git("tag", "--annotate", "-m", "vLLM v0.32.0", "v0.32.0", cwd=repo)
    replace_tree(repo, sources.vllm_sdist("0.33.0", cache))
    shas["v0.33.0"] = commit(repo, "Release v0.33.0")
    git("tag", "v0.33.0", cwd=repo)
    with (repo / "README.md").open("a") as readme:
        readme.write("\n<!-- 0.34 development -->\n")
    shas["bump"] = commit(repo, "[Misc] Start 0.34 development")
    header = repo / HEADER
    header.write_text(without_e2m1_asm(header.read_text()))
    shas["break"] = commit(repo, "[Kernel] Convert to FP4 with cuda_fp4.h intrinsics")
    (repo / "docs").mkdir(exist_ok=True)
    (repo / "docs" / "rc.md").write_text("# 0.34 release candidates\n")
    shas["docs"] = commit(repo, "[Doc] Release candidate notes")
    git("tag", "v0.34.0rc1", cwd=repo)
    # A branch that is not main, and a stand-in for CUTLASS (not reachable here; resolve only asks refs).
    git("branch", "releases/v0.33", shas["v0.33.0"], cwd=repo)
    cutlass = root / "cutlass"
    (cutlass / "include").mkdir(parents=True)
    (cutlass / "include" / "cutlass.h").write_text("#pragma once\n")
    git("init", "--quiet", "--initial-branch=main", cwd=cutlass)
    shas["cutlass"] = commit(cutlass, "CUTLASS 4.7.1 stand-in")
    git("tag", "v4.7.1", cwd=cutlass)  # the CUTLASS_REVISION of vLLM 0.32.0 and 0.33.0
    shas |= external_stand_ins(root / "github", ("0.32.0", "0.33.0"), cache)
    with git_daemon(root) as url:
        yield Upstream(url=url, repo=repo, shas=shas)


def external_stand_ins(folder: Path, versions: tuple[str, ...], cache: Path) -> dict[str, str]:
    """A repository for each project the releases' CMake files clone from GitHub, at the path its URL
    has below https://github.com/ (served through the matrix's mirrors:), its tag ref tagged."""
    made: dict[str, str] = {}
    for version in versions:
        for e in externals.scan(sources.vllm_sdist(version, cache)):
            repo = folder / e.repo.removeprefix("https://github.com/")
            if not (repo / ".git").is_dir():
                repo.mkdir(parents=True)
                (repo / "README").write_text(f"stand-in for {e.repo}\n")
                git("init", "--quiet", "--initial-branch=main", cwd=repo)
                made[e.repo] = commit(repo, f"{e.name} stand-in")
            if not re.fullmatch(r"[0-9a-f]{40}", e.ref):
                git("tag", "--force", e.ref, cwd=repo)
                made[f"{e.repo}@{e.ref}"] = made[e.repo]
    return made
