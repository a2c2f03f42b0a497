"""The nightly's summary: a table a person reads at a glance, also in GitHub's step summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder import log, patch, pipeline, plan
from builder.options import Options
from builder.verify import Answer, Bench, VerifyResult
from tests.conftest import ROOT


def a_run(status: str) -> pipeline.TargetRun:
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
    table = pipeline.summary_table([a_run("published")])
    header, rule, row = table.splitlines()
    columns = [cell.strip() for cell in header.split("|")[1:-1]]
    assert columns == ["target", "vLLM", "commit", "patches", "image tag", "digest", "verify", "status", "time"]
    assert set(rule) <= {"|", "-"}
    assert "vllm-0.32.0-cpu-amd64" in row and "published" in row and "4m51s" in row
    assert "1/1 answers, c=1: TTFT 17 ms, 592 tok/s" in row


def test_the_table_shows_each_patch_status_and_the_commit() -> None:
    run = a_run("published")
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


def test_a_failed_stage_is_recorded_and_the_rest_skipped() -> None:
    from builder.errors import BuildError

    run = pipeline.TargetRun(a_run("pending").plan)
    calls: list[str] = []

    def fails(ctx: pipeline.Context, r: pipeline.TargetRun) -> bool:
        calls.append("fails")
        r.status = "building"
        raise BuildError("compiler ran out of memory")

    def never(ctx: pipeline.Context, r: pipeline.TargetRun) -> bool:
        calls.append("never")
        return True

    pipeline.run_target(None, run, (fails, never))  # type: ignore[arg-type]
    assert calls == ["fails"]
    assert run.status == "failed (building)"
    assert run.error == "compiler ran out of memory"
