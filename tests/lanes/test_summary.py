"""The fanned-out lanes' last job: every target job's summary.json, written by the lane's own
report, merged into one table with a row for every planned target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild import errors
from sparkbuild.config.options import Options
from sparkbuild.lanes import pipeline, rc, summary
from sparkbuild.plan import plan
from sparkbuild.upstream import gitrepo
from sparkbuild.upstream.gitrepo import RemoteRefs
from sparkbuild.util import host
from tests.support import ROOT
from tests.support.cli import Outcome
from tests.support.cli import in_process as sparkbuild

PREFIX = "nightly-4242-"


def plans() -> dict[str, plan.TargetPlan]:
    return {p.id: p for p in plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261121"))}


def three() -> tuple[plan.TargetPlan, plan.TargetPlan, plan.TargetPlan]:
    """The local target, the 0.33.0 Spark target and the 0.19.0 one of the shipped matrix."""
    by_id = plans()
    local = next(p for p in by_id.values() if p.target.profile == "local")
    return local, by_id["vllm-0.33.0-cu130-sm121"], by_id["vllm-0.19.0-cu129-sm121"]


def job_output(artifacts: Path, run: pipeline.TargetRun) -> Path:
    """What one target's job uploads: its lane's summary.json, written by the lane's own report."""
    out = artifacts / f"{PREFIX}{run.plan.id}"
    opts = Options.from_env(matrix=ROOT / "matrix.yaml", out=out)
    if run.error:
        with pytest.raises(errors.LaneFailed):
            pipeline.report(opts, "nightly", [run], 1.0, table_to_stderr=True)
    else:
        pipeline.report(opts, "nightly", [run], 1.0, table_to_stderr=True)
    return out / "summary.json"


def published(p: plan.TargetPlan) -> pipeline.TargetRun:
    return pipeline.TargetRun(p, status=pipeline.Status.PUBLISHED, digest="sha256:" + "ab" * 32, seconds=291.0)


def merge(artifacts: Path, targets: list[str], *extra: str) -> Outcome:
    env = {"GITHUB_STEP_SUMMARY": str(artifacts / "step-summary.md")}
    return sparkbuild("summary", str(artifacts), "--targets", json.dumps(targets), "--prefix", PREFIX, *extra, env=env)


def test_a_summary_row_has_the_keys_the_merge_reads() -> None:
    run = published(next(iter(plans().values())))
    assert tuple(run.row()) == summary.ROW_KEYS
    assert pipeline.summary_table([run]) == summary.table([run.row()])


def test_the_merged_table_has_every_target_a_failed_one_failed_and_a_missing_one_missing(tmp_path: Path) -> None:
    local, spark, older = three()
    failed = pipeline.TargetRun(
        spark, status=pipeline.Status.FAILED, failed_at=pipeline.Status.BUILDING, error="nvcc ran out of memory"
    )
    job_output(tmp_path, published(local))
    job_output(tmp_path, failed)
    (tmp_path / f"{PREFIX}{older.id}").mkdir()  # its job uploaded logs but stopped before the lane's summary
    result = merge(tmp_path, [local.id, spark.id, older.id])
    assert result.code == errors.LaneFailed.exit_code
    _, _, *rows = result.out.split("\n\n")[0].splitlines()
    assert [r.split("|")[1].strip() for r in rows] == [local.id, spark.id, older.id]
    assert "| published " in rows[0] and local.content_tag in rows[0] and "sha256:abababababab" in rows[0]
    assert "failed (building)" in rows[1]
    assert summary.MISSING in rows[2]
    # Which platform each row's results are from, and whether they ran emulated on this host.
    platforms = [r.split("|")[2].strip() for r in rows]
    assert platforms[1] == ("linux/arm64" if host.host_platform() == "linux/arm64" else "linux/arm64 (emulated)")
    assert platforms[0] == local.target.platform and platforms[2] == "-"
    assert f"- {spark.id}: nvcc ran out of memory" in result.out  # why, under the table
    assert f"2 of 3 target(s) failed or left no summary: {spark.id}, {older.id}" in result.err
    step = (tmp_path / "step-summary.md").read_text()
    assert "## sparkbuild nightly: every target" in step and all(r in step for r in rows)


def test_a_target_without_its_artifact_is_missing_too(tmp_path: Path) -> None:
    local, spark, _ = three()
    job_output(tmp_path, published(local))
    result = merge(tmp_path, [local.id, spark.id])
    assert result.code == errors.LaneFailed.exit_code
    assert summary.MISSING in result.out.splitlines()[3]


def test_every_target_published_merges_to_success_and_json_has_every_row(tmp_path: Path) -> None:
    runs = [published(p) for p in plans().values()]
    for run in runs:
        job_output(tmp_path, run)
    ids = [r.plan.id for r in runs]
    assert merge(tmp_path, ids).code == 0
    result = merge(tmp_path, ids, "--json")
    assert result.code == 0
    rows = json.loads(result.out)
    assert rows == [json.loads(json.dumps(r.row())) for r in runs]
    assert "| published " in result.err  # the table, out of JSON's way


def test_a_lane_with_nothing_to_do_merges_to_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rc lane with no candidate newer than the newest release: its job still leaves a summary.
    monkeypatch.setattr(gitrepo, "ls_remote", lambda url: RemoteRefs(url=url, tags={"v0.33.0": "a" * 40}, heads={}))
    (target,) = plan.lane_ids(Options.from_env(matrix=ROOT / "matrix.yaml"), "rc")
    out = tmp_path / f"{PREFIX}{target}"
    result = rc.rc(Options.from_env(matrix=ROOT / "matrix.yaml", out=out, cache=tmp_path / "cache", only=(target,)))
    assert result.candidate is None and json.loads((out / "rc.json").read_text())["candidate"] is None
    merged = merge(tmp_path, [target], "--lane", "rc")
    assert merged.code == 0, merged.err
    assert f"| {summary.NOTHING_TO_DO} " in merged.out


@pytest.mark.parametrize(
    ("targets", "summary_text", "message"),
    [
        ("vllm-a", None, "--targets: give the JSON list"),
        ('["a", "a"]', None, "names a target twice"),
        ('["a"]', "{not json", "not JSON"),
        ('["a"]', '[{"target": "a"}]', "row 1 has no platform, vllm"),
    ],
)
def test_bad_input_is_a_config_error_naming_what_to_fix(
    tmp_path: Path, targets: str, summary_text: str | None, message: str
) -> None:
    if summary_text is not None:
        (tmp_path / f"{PREFIX}a").mkdir()
        (tmp_path / f"{PREFIX}a" / "summary.json").write_text(summary_text)
    result = sparkbuild("summary", str(tmp_path), "--targets", targets, "--prefix", PREFIX)
    assert result.code == errors.ConfigError.exit_code
    assert message in result.err and "Traceback" not in result.err


def test_the_plot_is_linked_to_the_runs_artifacts_in_github_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    plot = "/runner/work/sparkbuild-out/vllm-0.33.0-cu130-sm121/benchmark.png"
    assert summary.plot_line(plot) == f"plot: {plot}"
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    monkeypatch.setenv("GITHUB_REPOSITORY", "team/sparkbuild")
    assert summary.plot_line(plot) == (
        "plot: [vllm-0.33.0-cu130-sm121/benchmark.png](https://github.com/team/sparkbuild/actions/runs/4242#artifacts)"
        " (in the target's artifact)"
    )
