"""The status of every patch on every supported vLLM version, from real sdists, through the CLI too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from builder import patch
from tests.patches.conftest import PATCHES, VERSIONS, TreeFactory, tree_hash

# What each patch does to each version. A new patch or version needs a row here: the test below
# fails until the table covers every patch folder.
# Per patch, its status on each of VERSIONS (0.11.0, 0.12.0, 0.16.0, 0.19.0, 0.33.0).
BY_PATCH: dict[str, tuple[patch.Status, ...]] = {
    # flashkda.cmake still lacks 12.1a on the CUDA 12.9 branch in 0.33.0.
    "cmake-arch-sm121": ("applies", "applies", "applies", "upstream", "applies"),
    "e2m1-software": ("applies", "applies", "applies", "applies", "applies"),
    # 0.11.0's FlashInfer (0.3.1) has no sink wrapper; 0.33.0 serves sinks on SM12x itself.
    "flashinfer-sinks-sm12x": ("not-applicable", "applies", "applies", "applies", "upstream"),
    # vLLM's CUTLASS MXFP4 MoE is not in 0.11-0.19.
    "mxfp4-cutlass-sm12x": ("not-applicable", "not-applicable", "not-applicable", "not-applicable", "applies"),
}
EXPECTED: dict[str, dict[str, patch.Status]] = {
    version: {name: row[i] for name, row in BY_PATCH.items()} for i, version in enumerate(VERSIONS)
}


def test_table_covers_every_patch_and_version() -> None:
    names = {p.name for p in patch.load(PATCHES)}
    assert set(EXPECTED) == set(VERSIONS)
    for version, row in EXPECTED.items():
        assert set(row) == names, f"EXPECTED[{version}] must give a status for every patch"


@pytest.mark.parametrize("version", VERSIONS)
def test_status_of_every_patch(version: str, pristine: TreeFactory) -> None:
    report = patch.check(pristine(version), patch.load(PATCHES), version)
    assert {r.patch: r.status for r in report.results} == EXPECTED[version]
    assert report.ok


@pytest.mark.parametrize("version", VERSIONS)
def test_second_apply_reads_applied_and_changes_nothing(version: str, patched: TreeFactory) -> None:
    """Applied once, each patch that applied reads `applied` (sparkbuild's own change, not upstream's),
    and a second apply writes nothing: every file, the record included, stays byte for byte."""
    tree = patched(version)
    before = tree_hash(tree)
    report = patch.check(tree, patch.load(PATCHES), version)
    want = {name: "applied" if status == "applies" else status for name, status in EXPECTED[version].items()}
    assert {r.patch: r.status for r in report.results} == want, patch.table(report)
    assert patch.apply(report) == ()
    assert tree_hash(tree) == before


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
def test_cli_check_by_version_prints_table_and_json(version: str, pristine: TreeFactory) -> None:
    pristine(version)  # downloaded and checked once by the fixture; the CLI reuses the cache
    base = [sys.executable, "-m", "builder", "patch", "check", "--vllm-version", version]
    table = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    for name, status in EXPECTED[version].items():
        assert any(line.split()[1:3] == [name, status] for line in table.splitlines() if line.strip()), table
    data = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True, check=True).stdout)
    assert data["version"] == version
    assert data["ok"] is True
    assert {r["patch"]: r["status"] for r in data["results"]} == EXPECTED[version]
