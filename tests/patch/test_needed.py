"""Whether each patch is still needed, on every release's real sdist, for the Spark build (12.1a)
with CUDA 12.9 and 13.0 (issue 31, item 4); the shipped matrix is held to it.

cmake-arch-sm121's need is what vLLM's own CMake helpers (run by cmake) make of each unpatched
release; e2m1-software's is the arch list; flashinfer-sinks-sm12x is not needed where upstream has
its change; mxfp4-cutlass-sm12x where vLLM's selection never offers gpt-oss's layers its kernel;
mxfp4-moe-flashinfer-sm12x where that selection gives gpt-oss Marlin on SM12x; nvfp4-moe-b12x-auto
wherever that backend exists and automatic selection skips it. The releases each is needed on are
pinned here, with the evidence docs/patches-needed.md cites.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.patch import cli as patch_cli
from sparkbuild.patch import need, releases
from sparkbuild.plan import matrix
from tests.support import ROOT
from tests.support.trees import PATCHES, RELEASES, THROUGH, TreeFactory

BUILDS = tuple(need.Build(c) for c in need.SPARK_CUDA)
# Needed where they apply, but opt-in: none has run on an SM12x GPU yet (README, "Patches"), so a
# shipped target may leave them out where they are needed, never list them where they are not
# (mxfp4-moe-flashinfer-sm12x: the gpt-oss target lists it, the main 0.33.0 image does not).
OPT_IN = {"flashinfer-sinks-sm12x", "mxfp4-cutlass-sm12x", "mxfp4-moe-flashinfer-sm12x"}
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py"
EXPERTS = "vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py"
# Needed where vLLM is compiled (it changes setup.py alone): a release target may take upstream's
# wheel, compiled already, and leave it out; the rc lane's target always compiles, so it lists it.
COMPILE_ONLY = {"fa3-hopper-only"}


@pytest.fixture(scope="module")
def rows(every_tree: dict[str, Path]) -> list[releases.Row]:
    jobs = [releases.Job(v, every_tree[v], "sdist", BUILDS) for v in RELEASES]
    return releases.sweep(patch.folders((PATCHES,)), None, jobs)


def spans(rows: list[releases.Row], name: str) -> dict[str, list[tuple[str, str]]]:
    return {b.cuda: runs for b, runs in releases.needed_spans(rows)[name].items()}


def why(rows: list[releases.Row], version: str, name: str, cuda: str) -> need.Need:
    (row,) = [r for r in rows if r.version == version]
    i = [r.patch for r in row.results].index(name)
    return row.needs[i][[b.cuda for b in row.builds].index(cuda)]


def test_cmake_arch_is_needed_where_vllms_own_helpers_leave_sm121_without_code(rows: list[releases.Row]) -> None:
    """CUDA 12.9: the SM12x lists are 12.0a-only up to 0.18.1; 0.19.0 fixed them (PRs #37725,
    #38126); flashkda.cmake (0.27.0 on) has 12.0a without 12.1a on its CUDA 12.9 branch. CUDA 13.0:
    family targets (12.0f) cover sm_121 from 0.11.1 except qutlass.cmake's 12.0a, until 0.19.0."""
    assert spans(rows, "cmake-arch-sm121") == {
        "12.9": [("0.10.0", "0.18.1"), ("0.27.0", "0.33.0")],
        "13.0": [("0.10.0", "0.18.1")],
    }
    assert why(rows, "0.33.0", "cmake-arch-sm121", "12.9").why == (
        "unpatched, with CUDA 12.9: FLASH_KDA_ARCHS@cmake/external_projects/flashkda.cmake:35 gives nothing"
    )
    assert "code that runs on sm_121 with CUDA 13.0" in why(rows, "0.33.0", "cmake-arch-sm121", "13.0").why
    for version in ("0.11.1", "0.16.0", "0.18.1"):
        said = why(rows, version, "cmake-arch-sm121", "13.0").why
        assert said.startswith("unpatched, with CUDA 13.0: QUTLASS_ARCHS@cmake/external_projects/qutlass.cmake:"), said
        assert said.count(" gives ") == 1, said
    assert "FP4_ARCHS@CMakeLists.txt:" in why(rows, "0.16.0", "cmake-arch-sm121", "12.9").why


def test_e2m1_is_needed_only_for_plain_or_ptx_targets(rows: list[releases.Row], pristine: TreeFactory) -> None:
    assert spans(rows, "e2m1-software") == {"12.9": [], "13.0": []}
    (p,) = patch.load(PATCHES, ("e2m1-software",))
    tree = pristine("0.33.0")
    for arch_list, needed in (("12.1a", False), ("12.0f", False), ("12.1", True), ("12.0+PTX", True), ("9.0 10.0", True)):
        assert need.judge(p, "applies", "", tree, need.Build("13.0", arch_list)).needed is needed, arch_list


def test_flashinfer_sinks_are_needed_until_upstream_has_them(rows: list[releases.Row], pristine: TreeFactory) -> None:
    """0.28.0 serves sinks on SM12x itself: XQA decode and the sink prefill wrapper (PRs #49718, #52148),
    with FlashInfer 0.6.16.post3 pinned (sinks on SM12x from FlashInfer 0.6.16)."""
    assert spans(rows, "flashinfer-sinks-sm12x") == {"12.9": [("0.11.1", "0.27.1")], "13.0": [("0.11.1", "0.27.1")]}
    backend = (pristine("0.28.0") / "vllm/v1/attention/backends/flashinfer.py").read_text()
    assert "BatchAttentionWithAttentionSinkWrapper(" in backend and "is_device_capability_family(120)" in backend
    assert "flashinfer-python==0.6.16.post3" in (pristine("0.28.0") / "requirements/cuda.txt").read_text()


def cited(said: str) -> tuple[str, str]:
    """The ``(file:line)`` a verdict cites, and that line's text in the release."""
    found = re.search(r"\((?:[^():]+, )?(vllm/[^):]+):(\d+)\)", said)
    assert found, said
    return found.group(1), found.group(2)


def test_mxfp4_cutlass_is_not_needed_where_gpt_oss_is_never_offered_its_kernel(
    rows: list[releases.Row], pristine: TreeFactory
) -> None:
    """The verdict follows vLLM's selection for gpt-oss's layers (issue 44): from 0.22.0 the automatic
    path filters by the requested activation format, and gpt-oss's checkpoint declares none, so only
    BF16-activation backends are tried and vLLM's W4A4 CUTLASS MXFP4 never is; its experts apply no
    expert biases either (read here in every such release). Before, the old verdict stands."""
    assert spans(rows, "mxfp4-cutlass-sm12x") == {"12.9": [("0.20.0", "0.21.0")], "13.0": [("0.20.0", "0.21.0")]}
    for version in ("0.22.0", "0.29.0", "0.33.0"):
        said = why(rows, version, "mxfp4-cutlass-sm12x", "13.0").why
        rel, line = cited(said)
        assert rel == ORACLE and "(gpt-oss)" in said and "mxfp4-moe-flashinfer-sm12x" in said, said
        assert pristine(version).joinpath(rel).read_text().splitlines()[int(line) - 1].strip() == (
            "AVAILABLE_BACKENDS = _filter_by_activation("
        )
        experts = ast.parse(pristine(version).joinpath(EXPERTS).read_text())
        named = [n for n in experts.body if getattr(n, "name", "") in ("CutlassExpertsMxfp4", "run_cutlass_moe_mxfp4")]
        assert len(named) == 2 and not any("bias" in ast.unparse(n) for n in named), version


def test_mxfp4_moe_flashinfer_is_needed_where_gpt_oss_runs_on_marlin(rows: list[releases.Row], pristine: TreeFactory) -> None:
    """Its range (0.33.0) on both CUDA versions (the change is Python); a build for no SM12x GPU does not need it."""
    assert spans(rows, "mxfp4-moe-flashinfer-sm12x") == {"12.9": [("0.33.0", "0.33.0")], "13.0": [("0.33.0", "0.33.0")]}
    said = why(rows, "0.33.0", "mxfp4-moe-flashinfer-sm12x", "13.0").why
    rel, line = cited(said)
    assert rel == ORACLE and "issue #41477" in said and "(gpt-oss)" in said
    assert pristine("0.33.0").joinpath(rel).read_text().splitlines()[int(line) - 1].strip() == (
        "AVAILABLE_BACKENDS = _filter_by_activation("
    )
    (p,) = patch.load(PATCHES, ("mxfp4-moe-flashinfer-sm12x",))
    for arch_list, needed in (("12.1a", True), ("12.0f", True), ("9.0 10.0a", False)):
        assert need.judge(p, "applies", "", pristine("0.33.0"), need.Build("13.0", arch_list)).needed is needed, arch_list


def test_nvfp4_b12x_auto_is_needed_wherever_b12x_exists_outside_automatic_selection(
    rows: list[releases.Row], pristine: TreeFactory
) -> None:
    """0.29.0 - 0.33.0 have NvFp4MoeBackend.B12X (PR #52018) and a selector list without it, for any
    CUDA version (the change is Python); a build for no SM12x GPU does not need it."""
    assert spans(rows, "nvfp4-moe-b12x-auto") == {"12.9": [("0.29.0", "0.33.0")], "13.0": [("0.29.0", "0.33.0")]}
    said = why(rows, "0.33.0", "nvfp4-moe-b12x-auto", "13.0").why
    found = re.search(r"\((vllm/[^):]+):(\d+)\)", said)
    assert found, said
    rel, line = found.groups()
    assert rel == "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py" and "issue #54666" in said
    assert (pristine("0.33.0") / rel).read_text().splitlines()[int(line) - 1].strip() == "AVAILABLE_BACKENDS = ["
    (p,) = patch.load(PATCHES, ("nvfp4-moe-b12x-auto",))
    for arch_list, needed in (("12.1a", True), ("12.0f", True), ("9.0 10.0a", False)):
        assert need.judge(p, "applies", "", pristine("0.33.0"), need.Build("13.0", arch_list)).needed is needed, arch_list


def test_the_shipped_matrix_lists_a_patch_only_where_it_is_needed(every_tree: dict[str, Path]) -> None:
    """Each Spark target's patches are the ones its release needs for its CUDA and arch list (the
    opt-in ones aside, and on a release target the compile-only one); the rc lane's those the newest
    release needs (preflight audits the candidate)."""
    m = matrix.load(ROOT / "matrix.yaml")
    patches = patch.load(PATCHES)
    spark = [t for t in m.targets if t.profile == "spark"]
    assert {t.lane for t in spark} == {"nightly", "rc"}
    for target in spark:
        version = THROUGH if target.lane == "rc" else target.vllm.version
        assert target.cuda is not None and version in every_tree
        report = patch.check(every_tree[version], patches, version)
        build = need.Build(target.cuda, target.arch_list)
        wanted = {
            r.patch
            for p, r in zip(patches, report.results, strict=True)
            if need.judge(p, r.status, r.detail, every_tree[version], build).needed
        }
        assert set(target.patches) <= wanted, f"{target.id} lists a patch it does not need"
        optional = OPT_IN | (COMPILE_ONLY if target.lane != "rc" else set())
        assert wanted - set(target.patches) <= optional, f"{target.id} leaves out a patch it needs"


def test_a_target_that_needs_a_patch_is_seen_to_need_it(every_tree: dict[str, Path]) -> None:
    """The check above is not empty by construction: 0.33.0 with CUDA 12.9 needs cmake-arch-sm121."""
    (p,) = patch.load(PATCHES, ("cmake-arch-sm121",))
    (r,) = patch.check(every_tree["0.33.0"], (p,), "0.33.0").results
    assert need.judge(p, r.status, r.detail, every_tree["0.33.0"], need.Build("12.9")).needed


def sparkbuild(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARKBUILD_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "sparkbuild", *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_the_docs_table_is_what_the_command_prints(every_tree: dict[str, Path], source_cache: Path) -> None:
    doc = ROOT / "docs" / "patches-needed.md"
    args, table = patch_cli.readme_block(doc, patch_cli.NEEDED_BEGIN, patch_cli.NEEDED_END)
    done = sparkbuild("patch", "table", "--needed", "--markdown", *args.split(), cache=source_cache)
    assert done.returncode == 0, done.stderr
    assert table == done.stdout.rstrip("\n"), f"{doc}'s table is stale: run the command in its comment with --update-readme"


def test_the_json_says_per_release_and_build_whether_each_patch_is_needed(
    every_tree: dict[str, Path], source_cache: Path
) -> None:
    done = sparkbuild("patch", "table", "--through", THROUGH, "--json", "--patch", "mxfp4-cutlass-sm12x", cache=source_cache)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    newest = data["releases"][-1]["results"]["mxfp4-cutlass-sm12x"]
    assert newest["status"] == "applies" and newest["needed"]["13.0"]["needed"] is False
    assert data["needed_on"]["mxfp4-cutlass-sm12x"] == {"12.9": [["0.20.0", "0.21.0"]], "13.0": [["0.20.0", "0.21.0"]]}
