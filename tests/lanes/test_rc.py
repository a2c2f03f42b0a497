"""The rc lane for real: a git remote with release candidates, the patch check on each, and build,
verify and publish of the local profile with a real engine and registry; the second run does nothing."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import embedded
from tests.support import ROOT
from tests.support.matrix import local_id, local_target, quick_checks
from tests.support.upstream import Upstream, sparkbuild

pytestmark = [pytest.mark.docker, pytest.mark.slow]
TARGET = local_id("rc")


def rc_matrix(path: Path, upstream: Upstream) -> Path:
    shipped = (ROOT / "matrix.yaml").read_text()
    path.write_text(
        f"patches_dir: {ROOT / 'patches'}\n"
        + shipped.split("targets:")[0]
        + textwrap.dedent(f"""\
        upstreams:
          vllm: {upstream.url}/vllm
        targets:
        """)
        + local_target(
            lane="rc", base="debian-bookworm", patches=["cmake-arch-sm121", "e2m1-software"], repository="sparkbuild-test/vllm-rc"
        )
    )
    return quick_checks(path)


def test_rc_lane_checks_builds_verifies_publishes_and_then_does_nothing(
    upstream: Upstream, engine: Engine, base: str, cache: Path, tmp_path: Path
) -> None:
    matrix = rc_matrix(tmp_path / "matrix.yaml", upstream)
    lane = ("rc", "--matrix", str(matrix), "--date", "20261121", "--json")
    (cache / "rc" / "state.json").unlink(missing_ok=True)

    # v0.34.0rc1 has the commit that breaks e2m1-software: said at once, nothing built.
    dry = sparkbuild(*lane, "--dry-run", cache=cache, out=tmp_path / "out1")
    assert dry.returncode == 8, dry.stderr
    first = json.loads(dry.stdout)
    assert first["candidate"]["tag"] == "v0.34.0rc1" and first["candidate"]["newest_release"] == "v0.33.0"
    (row,) = first["targets"]
    assert row["patches"] == {"cmake-arch-sm121": "applies", "e2m1-software": "conflict"}
    assert (row["status"], row["failed_at"]) == ("failed", "checking patches") and "sparkbuild bisect" in row["error"]
    assert row["commit"] == upstream.shas["docs"]

    # Upstream reverts it and tags v0.34.0rc2: the lane checks, builds, verifies and publishes it.
    rc2 = upstream.add_rc2()
    run = sparkbuild(*lane, cache=cache, out=tmp_path / "out2")
    assert run.returncode == 0, run.stderr
    second = json.loads(run.stdout)
    assert second["candidate"] | {"tag": "v0.34.0rc2", "commit": rc2, "version": "0.34.0rc2"} == second["candidate"]
    (row,) = second["targets"]
    assert row["status"] == "published", row
    assert row["patches"] == {"cmake-arch-sm121": "applies", "e2m1-software": "applies"}
    assert row["verify"].startswith("2/2 answers")
    assert row["tags"] == ["0.34.0rc2", "rc"]
    image = row["tag"]
    labels = engine.inspect(image)["Config"]["Labels"]
    assert labels["io.sparkbuild.candidate"] == f"v0.34.0rc2@{rc2}"
    assert labels["org.opencontainers.image.version"] == "0.34.0rc2"
    with embedded(cache / "registry") as registry:
        digests = {t: registry.digest("sparkbuild-test/vllm-rc", t) for t in ("0.34.0rc2", "rc", image.split(":")[1])}
    assert set(digests.values()) == {row["digest"]}
    assert "Release candidate v0.34.0rc2" in run.stderr  # the summary table (stderr when --json)

    # Unchanged candidate, image still in the registry: nothing is checked, built or pushed.
    again = sparkbuild(*lane, cache=cache, out=tmp_path / "out3")
    assert again.returncode == 0, again.stderr
    (row3,) = json.loads(again.stdout)["targets"]
    assert row3["status"] == "up to date" and row3["digest"] == row["digest"]
    assert row3["patches"] == row["patches"]
    commands = [line for line in again.stderr.splitlines() if line.startswith("+ ")]
    assert not any(" build " in c or " push " in c or "worktree" in c for c in commands), commands
