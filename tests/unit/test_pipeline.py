"""The nightly's summary: a table a person reads at a glance, also in GitHub's step summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder import log, patch, pipeline, plan
from builder.errors import BuildError
from builder.options import Options
from builder.registry import Registry
from builder.verify import Answer, Bench, VerifyResult
from tests.conftest import ROOT


def a_run(status: pipeline.Status) -> pipeline.TargetRun:
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261121", profile="local"))
    result = VerifyResult(
        image="img",
        model="m",
        check="alphabet",
        startup_s=1.0,
        answers=(Answer(name="completion", api="completions", prompt="c d e f", expected=" g h i j", received=" g h i j"),),
        bench=(
            Bench(
                concurrency=1,
                ttft_ms_p50=17.2,
                ttft_ms_max=18.0,
                decode_tokens_per_s_p50=591.9,
                total_tokens_per_s=453.5,
                requests=1,
            ),
        ),
    )
    return pipeline.TargetRun(p, status=status, digest="sha256:" + "ab" * 32, result=result, seconds=291.0)


def test_summary_table_has_one_row_per_target() -> None:
    table = pipeline.summary_table([a_run(pipeline.Status.PUBLISHED)])
    header, rule, row = table.splitlines()
    columns = [cell.strip() for cell in header.split("|")[1:-1]]
    assert columns == ["target", "vLLM", "commit", "patches", "preflight", "image tag", "digest", "verify", "status", "time"]
    assert set(rule) <= {"|", "-"}
    assert "vllm-0.32.0-cpu-amd64" in row and "published" in row and "4m51s" in row
    assert "1/1 answers, c=1: TTFT 17 ms, 592 tok/s" in row


def test_the_table_shows_each_patch_status_and_the_commit() -> None:
    run = a_run(pipeline.Status.PUBLISHED)
    (spark,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", only=("vllm-0.19.0-*",)))
    run.plan = spark
    run.patches = (
        patch.Result("cmake-arch-sm121", "upstream", ""),
        patch.Result("e2m1-software", "applies", ""),
    )
    row = pipeline.summary_table([run]).splitlines()[2]
    assert "cmake-arch-sm121=upstream e2m1-software=applies" in row
    assert "2a69949bdadf" in row
    assert pipeline.TargetRun(run.plan).row()["patches"] is None


def test_step_summary_goes_to_github(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    log.step_summary("| a |")
    log.step_summary("| b |")
    assert summary.read_text() == "| a |\n| b |\n"


def a_context(tmp_path: Path) -> pipeline.Context:
    opts = Options.from_env(matrix=ROOT / "matrix.yaml", out=tmp_path / "out", cache=tmp_path / "cache")
    return pipeline.Context(opts, Registry("127.0.0.1:9"), tmp_path / "work", ROOT / "patches")


def test_a_failed_stage_is_recorded_and_the_rest_skipped(tmp_path: Path) -> None:
    run = pipeline.TargetRun(a_run(pipeline.Status.PENDING).plan)
    calls: list[str] = []

    def fails(ctx: pipeline.Context, r: pipeline.TargetRun) -> bool:
        calls.append("fails")
        r.status = pipeline.Status.BUILDING
        raise BuildError("compiler ran out of memory")

    def never(ctx: pipeline.Context, r: pipeline.TargetRun) -> bool:
        calls.append("never")
        return True

    pipeline.run_target(a_context(tmp_path), run, (fails, never))
    assert calls == ["fails"]
    assert (run.status, run.failed_at) == (pipeline.Status.FAILED, pipeline.Status.BUILDING)
    assert run.error == "compiler ran out of memory"
    assert run.row()["status"] == "failed" and run.row()["failed_at"] == "building"
    assert "compiler ran out of memory" in (tmp_path / "out" / run.plan.id / "error.log").read_text()
    assert "failed (building)" in pipeline.summary_table([run])


def test_ctrl_c_in_a_target_stops_the_lane_and_the_summary_says_so(tmp_path: Path) -> None:
    # A stage function stands in for the moment a Ctrl-C lands; the real signal is in tests/integration/test_interrupt.py.
    runs = [pipeline.TargetRun(a_run(pipeline.Status.PENDING).plan) for _ in range(2)]

    def interrupted(ctx: pipeline.Context, r: pipeline.TargetRun) -> bool:
        r.status = pipeline.Status.VERIFYING
        raise KeyboardInterrupt

    ctx = a_context(tmp_path)
    with pytest.raises(KeyboardInterrupt), pipeline.finishing(ctx.opts, "nightly", runs, table_to_stderr=True):
        pipeline.run_lane(ctx, runs, (interrupted,))
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(r["status"], r["failed_at"]) for r in rows] == [("interrupted", "verifying"), ("not run", "pending")]
    assert {r["status"] for r in rows} <= {s.value for s in pipeline.Status}
