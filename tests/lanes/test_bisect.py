"""bisect against a real git remote: the patch check on every probed tree names the breaking commit."""

from __future__ import annotations

import json
from pathlib import Path

from tests.lanes.conftest import Upstream, spark_matrix, sparkbuild


def test_bisect_names_the_commit_that_breaks_a_patch(upstream: Upstream, tmp_path: Path) -> None:
    matrix = spark_matrix(tmp_path / "matrix.yaml", upstream, '{version: "0.33.0"}', "nvidia/cuda:13.0.2-devel")
    args = ("bisect", "--matrix", str(matrix), "--good", "v0.33.0", "--bad", "v0.34.0rc1", "--patch", "e2m1-software")
    result = sparkbuild(*args, "--json", cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["first_bad"] == upstream.shas["break"]
    assert found["subject"] == "[Kernel] Convert to FP4 with cuda_fp4.h intrinsics"
    assert "e2m1-software=conflict" in found["detail"]
    assert found["commits_in_range"] == 3
    # bad and good are checked first, then log2 of the range; each commit at most once.
    tested = [s["commit"] for s in found["steps"]]
    assert tested[:2] == [upstream.shas["docs"], upstream.shas["v0.33.0"]] and len(tested) == len(set(tested)) <= 4

    text = sparkbuild(*args, cache=tmp_path / "cache")
    assert text.returncode == 0, text.stderr
    assert f"{upstream.shas['break']} is the first commit where `patch` fails" in text.stdout
    assert "fetch --prune" in text.stderr  # the mirror already exists: an incremental fetch


def test_bisect_refuses_a_range_whose_good_end_fails(upstream: Upstream, tmp_path: Path) -> None:
    matrix = spark_matrix(tmp_path / "matrix.yaml", upstream, '{version: "0.33.0"}', "nvidia/cuda:13.0.2-devel")
    result = sparkbuild(
        "bisect", "--matrix", str(matrix), "--good", upstream.shas["break"], "--bad", "v0.34.0rc1", cache=tmp_path / "cache"
    )
    assert result.returncode == 2
    assert "fails `patch`" in result.stderr and "needs a good commit that passes" in result.stderr
