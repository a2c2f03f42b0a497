"""The sweep: every patch's status on every vLLM release with an sdist on PyPI, pinned here, and the
newest release candidate of a git remote; the support table command and the documentation's copy of it (docs/patches.md).

A new patch, or a release past THROUGH, needs its column or row here: the tests fail until the
table covers every patch folder and the index's every release through THROUGH.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version

from sparkbuild import patch
from sparkbuild.patch import cli as patch_cli
from sparkbuild.patch import releases
from sparkbuild.upstream import sources
from tests.support import ROOT, cli
from tests.support.git import git
from tests.support.trees import PATCHES, RELEASES, THROUGH, WHEELS_ONLY, TreeFactory, linked_copy, tree_hash

NAMES = (
    "cmake-arch-sm121",
    "e2m1-software",
    "fa3-hopper-only",
    "flashinfer-sinks-sm12x",
    "mxfp4-cutlass-sm12x",
    "mxfp4-moe-flashinfer-sm12x",
    "nvfp4-moe-b12x-auto",
)
A: patch.Status = "applies"
N: patch.Status = "not-applicable"
U: patch.Status = "upstream"
# Per release, each patch's status in NAMES order.
EXPECTED: dict[str, tuple[patch.Status, ...]] = {
    "0.10.0": (A, N, A, N, N, N, N),  # e2m1: before nvfp4_utils.cuh (range); sinks: FlashInfer 0.3.1 (range); no MXFP4 kernel
    "0.10.1": (A, N, A, N, N, N, N),
    "0.10.1.1": (A, N, A, N, N, N, N),
    "0.10.2": (A, A, A, N, N, N, N),
    "0.11.0": (A, A, A, N, N, N, N),
    "0.11.1": (A, A, A, A, N, N, N),  # FlashInfer 0.5.2: the sink wrapper is there
    "0.11.2": (A, A, A, A, N, N, N),
    "0.12.0": (A, A, A, A, N, N, N),
    "0.13.0": (A, A, A, A, N, N, N),
    "0.14.0": (A, A, A, A, N, N, N),
    "0.14.1": (A, A, A, A, N, N, N),
    "0.16.0": (A, A, A, A, N, N, N),
    "0.17.0": (A, A, A, A, N, N, N),
    "0.17.1": (A, A, A, A, N, N, N),
    "0.18.0": (A, A, A, A, N, N, N),
    "0.18.1": (A, A, A, A, N, N, N),
    "0.19.0": (U, A, A, A, N, N, N),  # CMake serves 12.1 itself (#37725, #38126)
    "0.19.1": (U, A, A, A, N, N, N),
    "0.20.0": (U, A, A, A, A, N, N),  # the CUTLASS MXFP4 MoE, under csrc/libtorch_stable/ (Python gate to 0.23.0)
    "0.20.1": (U, A, A, A, A, N, N),
    "0.20.2": (U, A, A, A, A, N, N),
    "0.21.0": (U, A, A, A, A, N, N),  # the prefill wrapper takes backend=
    "0.22.0": (U, A, A, A, A, N, N),
    "0.22.1": (U, A, A, A, A, N, N),
    "0.23.0": (U, A, A, A, A, N, N),
    "0.24.0": (U, A, A, A, A, N, N),  # the MXFP4 gate moves to C++
    "0.25.0": (U, A, A, A, A, N, N),  # supports_sink rewritten; the builder picks the decode kernel
    "0.25.1": (U, A, A, A, A, N, N),
    "0.26.0": (U, A, A, A, A, N, N),
    "0.27.0": (A, A, A, A, A, N, N),  # flashkda.cmake arrives without 12.1a on CUDA 12.9
    "0.27.1": (A, A, A, A, A, N, N),
    "0.28.0": (A, A, A, U, A, N, N),  # the SM12x sink path is upstream
    "0.29.0": (A, A, A, U, A, N, A),  # NvFp4MoeBackend.B12X (PR #52018), not in the automatic list
    "0.30.0": (A, A, A, U, A, N, A),
    "0.31.0": (A, A, A, U, A, N, A),
    "0.32.0": (A, A, A, U, A, N, A),  # the MXFP4 kernel back under csrc/quantization/fp4/
    "0.33.0": (A, A, A, U, A, A, A),  # the MXFP4 oracle's automatic path the FlashInfer rule reads (its range)
}
FIRST_UPSTREAM = {
    "cmake-arch-sm121": "0.19.0",
    "e2m1-software": None,
    "fa3-hopper-only": None,
    "flashinfer-sinks-sm12x": "0.28.0",
    "mxfp4-cutlass-sm12x": None,
    "mxfp4-moe-flashinfer-sm12x": None,
    "nvfp4-moe-b12x-auto": None,
}


def test_the_table_covers_every_patch_and_every_release_on_the_index() -> None:
    assert tuple(p.name for p in patch.load(PATCHES)) == NAMES
    found = releases.releases(Version(THROUGH))
    assert tuple(r.version for r in found if r.sdist) == RELEASES == tuple(EXPECTED)
    assert tuple(r.version for r in found if not r.sdist) == WHEELS_ONLY


def test_status_of_every_patch_on_every_release(sweep: dict[str, patch.Report]) -> None:
    got = {v: tuple(r.status for r in report.results) for v, report in sweep.items()}
    assert got == EXPECTED


def test_no_conflict_and_a_reason_for_every_status(sweep: dict[str, patch.Report]) -> None:
    """Inside its range a patch applies, is upstream, or has nothing to change in that layout; outside
    it, the detail says why the range stops there."""
    patches = {p.name: p for p in patch.load(PATCHES)}
    for version, report in sweep.items():
        for r in report.results:
            p = patches[r.patch]
            assert r.status != "conflict", (version, r)
            assert r.detail, (version, r)
            if not p.versions.contains(version):
                assert p.range_why and r.detail.endswith(p.range_why), (version, r)


def test_a_second_apply_on_every_release_reads_applied_and_writes_nothing(
    sweep: dict[str, patch.Report], pristine: TreeFactory, tmp_path: Path
) -> None:
    """Applied once, each patch that applied reads `applied` (sparkbuild's own change, not upstream's),
    and applying again writes nothing: every file, the record included, stays byte for byte."""
    patches = patch.load(PATCHES)
    for version in RELEASES:
        tree = linked_copy(pristine(version), tmp_path / version)
        patch.apply(patch.check(tree, patches, version))
        before = tree_hash(tree)
        again = patch.check(tree, patches, version)
        want = tuple("applied" if s == "applies" else s for s in EXPECTED[version])
        assert tuple(r.status for r in again.results) == want, patch.table(again)
        assert patch.apply(again) == ()
        assert tree_hash(tree) == before, version
        shutil.rmtree(tree)


# --- the command, the README, the candidate ---------------------------------------------------------


def sparkbuild(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return cli.run(*args, env={"SPARKBUILD_CACHE": str(cache)})


def test_the_table_command_says_the_same(every_tree: dict[str, Path], source_cache: Path) -> None:
    done = sparkbuild("patch", "table", "--through", THROUGH, "--json", cache=source_cache)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    got = {row["version"]: tuple(row["results"][n]["status"] for n in NAMES) for row in data["releases"]}
    assert got == EXPECTED
    assert data["wheels_only"] == list(WHEELS_ONLY)
    assert data["first_upstream"] == FIRST_UPSTREAM
    assert data["ok"] is True


def test_the_documented_table_is_what_the_command_prints(every_tree: dict[str, Path], source_cache: Path) -> None:
    args, table = patch_cli.readme_block(ROOT / "docs" / "patches.md")
    done = sparkbuild("patch", "table", "--markdown", *args.split(), cache=source_cache)
    assert done.returncode == 0, done.stderr
    assert table == done.stdout.rstrip("\n"), (
        "docs/patches.md's patch table is stale: run the command in its comment with --update-readme docs/patches.md"
    )


@pytest.fixture(scope="module")
def remote(pristine: TreeFactory, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A vLLM remote: 0.33.0 tagged v0.33.0, then a commit tagged v0.34.0rc1 (and an older rc)."""
    repo = tmp_path_factory.mktemp("remote") / "vllm"
    shutil.copytree(pristine("0.33.0"), repo)
    git("init", "--quiet", "--initial-branch=main", cwd=repo)
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", "Release v0.33.0", cwd=repo)
    git("tag", "v0.33.0rc1", cwd=repo)
    git("tag", "v0.33.0", cwd=repo)
    (repo / "docs.md").write_text("0.34 release candidate\n")
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", "[Doc] rc notes", cwd=repo)
    git("tag", "v0.34.0rc1", cwd=repo)
    return str(repo)


def test_the_newest_candidate_of_a_git_remote_is_checked(remote: str, every_tree: dict[str, Path], source_cache: Path) -> None:
    done = sparkbuild("patch", "table", "--through", THROUGH, "--candidate-from", remote, "--json", cache=source_cache)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["releases"]
    assert [r["version"] for r in rows[:-1]] == list(RELEASES)
    candidate = rows[-1]
    assert candidate["version"] == "0.34.0rc1" and candidate["source"].startswith("v0.34.0rc1 ")
    assert {n: candidate["results"][n]["status"] for n in NAMES} == dict(zip(NAMES, EXPECTED["0.33.0"], strict=True))
    text = sparkbuild("patch", "table", "--through", THROUGH, "--candidate-from", remote, cache=source_cache).stdout
    (line,) = [line for line in text.splitlines() if line.startswith("0.34.0rc1 ")]
    assert "(v0.34.0rc1 " in line


def test_a_conflict_in_the_table_exits_9_and_names_the_release(tmp_path: Path, source_cache: Path) -> None:
    """The sinks patch stretched to a release its rule cannot serve (0.11.0 has no supports_sink()):
    the table still prints, then the error names the release and the patch."""
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES / "flashinfer-sinks-sm12x", patches / "flashinfer-sinks-sm12x")
    meta = patches / "flashinfer-sinks-sm12x" / "patch.yaml"
    meta.write_text(meta.read_text().replace('versions: ">=0.11.1"', 'versions: ">=0.10"'))
    done = sparkbuild("patch", "table", "--through", "0.11.0", "--patches", str(patches), cache=source_cache)
    assert done.returncode == 9, done.stderr
    assert [line.split() for line in done.stdout.splitlines() if line.startswith("0.11.0 ")] == [["0.11.0", "CONFLICT"]]
    assert (
        "0.11.0: flashinfer-sinks-sm12x (vllm/v1/attention/backends/flashinfer.py: expected one class with a supports_sink()"
        in done.stderr
    )


def test_versions_written_as_tags_in_the_table(source_cache: Path, every_tree: dict[str, Path]) -> None:
    done = sparkbuild("patch", "table", "--through", "v0.10.1", "--json", cache=source_cache)
    assert done.returncode == 0, done.stderr
    assert [r["version"] for r in json.loads(done.stdout)["releases"]] == ["0.10.0", "0.10.1"]


def test_the_index_and_the_cache_agree_on_what_a_release_is(every_tree: dict[str, Path], source_cache: Path) -> None:
    """The sha256 each slice was checked against is the index's, for the pinned releases."""
    links = sources.index_links("vllm")
    cache = source_cache / releases.TREES
    for version in RELEASES:
        stamp = cache / f"vllm-{version}" / releases.STAMP
        if stamp.is_file():
            assert json.loads(stamp.read_text())["sha256"] == links[f"vllm-{version}.tar.gz"].sha256, version
