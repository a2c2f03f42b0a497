"""bisect against a real git remote: the patch check on every probed tree names the breaking commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild.oci.engine import Engine
from tests.lanes.test_rc import rc_matrix
from tests.support.matrix import local_id
from tests.support.upstream import Upstream, spark_matrix, sparkbuild


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


@pytest.mark.docker
def test_bisect_at_the_build_stage_builds_each_probe_of_one_target(
    upstream: Upstream, engine: Engine, base: str, cache: Path, tmp_path: Path
) -> None:
    """--stage build runs the target's pipeline at each commit: the patch check, then a real build
    (the local profile's image, here); the breaking commit fails at its patch check."""
    matrix = rc_matrix(tmp_path / "matrix.yaml", upstream)
    matrix.write_text(
        matrix.read_text().replace("lane: rc", "lane: nightly").replace("sparkbuild-test/vllm-rc", "sparkbuild-test/bisect")
    )
    result = sparkbuild(
        "bisect", "--matrix", str(matrix), "--good", "v0.33.0", "--bad", "v0.34.0rc1", "--stage", "build", "--json", cache=cache
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["first_bad"] == upstream.shas["break"]
    passed = [s for s in found["steps"] if s["ok"]]
    assert passed and all(s["detail"].startswith(f"build passed ({local_id()}-") for s in passed)
    for step in passed:
        tag = step["detail"].split("(")[1].rstrip(")")
        labels = engine.inspect(f"sparkbuild-test/bisect:{tag}")["Config"]["Labels"]
        assert labels["io.sparkbuild.candidate"].endswith(step["commit"])
