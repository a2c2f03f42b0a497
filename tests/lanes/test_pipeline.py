"""The nightly's summary: a table a person reads at a glance, also in GitHub's step summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.errors import BuildError, ToolMissingError, VerifyError
from sparkbuild.lanes import pipeline
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import plan
from sparkbuild.upstream import kernelpath
from sparkbuild.util import log
from sparkbuild.verify import benchmark, benchreport, layout, regression, verify
from sparkbuild.verify.verify import Answer, VerifyResult
from tests.support import DATA, ROOT
from tests.support.matrix import local_id

BASELINE = DATA / "bench" / "baseline.json"


def a_run(status: pipeline.Status) -> pipeline.TargetRun:
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261121", profile="local"))
    result = VerifyResult(
        image="img",
        model="m",
        check="alphabet",
        startup_s=1.0,
        answers=(Answer(name="completion", api="completions", prompt="c d e f", expected=" g h i j", received=" g h i j"),),
        benchmark=benchmark.from_json(json.loads(BASELINE.read_text()), "baseline.json"),
    )
    return pipeline.TargetRun(p, status=status, digest="sha256:" + "ab" * 32, result=result, seconds=291.0)


def test_summary_table_has_one_row_per_target() -> None:
    table = pipeline.summary_table([a_run(pipeline.Status.PUBLISHED)])
    header, rule, row = table.splitlines()[:3]
    columns = [cell.strip() for cell in header.split("|")[1:-1]]
    assert columns == [
        *(
            "target",
            "platform",
            "vLLM",
            "commit",
            "patches",
            "preflight",
            "image tag",
            "digest",
            "signed",
            "verify",
            "speed",
            "status",
            "time",
        )
    ]
    assert set(rule) <= {"|", "-"}
    assert local_id() in row and "published" in row and "4m51s" in row
    assert "1/1 answers, decode c=1: TTFT 14 ms, 241 tok/s" in row


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
    return pipeline.Context(opts, Registry("127.0.0.1:9"), tmp_path / "work", patch.folders((ROOT / "patches",)))


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
    # A stage function stands in for the moment a Ctrl-C lands; the real signal is in tests/lanes/test_interrupt.py.
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


def test_the_compiles_preflight_runs_after_the_patch_check_and_before_the_build() -> None:
    from sparkbuild.lanes import rc

    for stages in (pipeline.TARGET_STAGES, rc.lane_stages({}, dry_run=False)):
        order = list(stages)
        assert order.index(pipeline.check_patches) < order.index(pipeline.preflight_build) < order.index(pipeline.build_image)
        # The start-up prediction between the build and verify: a check it fails never reaches a server or a push.
        assert order.index(pipeline.build_image) < order.index(pipeline.predict_startup) < order.index(pipeline.verify_image)
    assert rc.lane_stages({}, dry_run=True) == (pipeline.check_patches,)


def test_the_local_profile_has_no_preflight_and_touches_no_engine(tmp_path: Path) -> None:
    # The context's registry is a closed port and its engine is never connected: a local target
    # has no preflight stage, so preflight_build returns before either is asked.
    run = pipeline.TargetRun(a_run(pipeline.Status.PENDING).plan)
    assert pipeline.preflight_build(a_context(tmp_path), run) is True
    assert (run.status, run.preflight, run.closure) == (pipeline.Status.PENDING, None, None)


def test_a_failed_preflight_names_its_units_in_the_row_and_the_table() -> None:
    from sparkbuild.build import binaries, closure, preflight

    run = a_run(pipeline.Status.FAILED)
    run.failed_at = pipeline.Status.PREFLIGHT
    spark = binaries.Arch.parse("12.1")
    sm_120a = binaries.Code(kind="sass", arch=binaries.Arch.parse("12.0a"), name="sm_120a")
    run.preflight = preflight.Report(
        target=run.plan.id,
        device=spark,
        units=(preflight.Unit(file="csrc/quant/nvfp4.cu", library="_C", codes=(sm_120a,), verdict="none"),),
        compiled=(),
        stubbed=("FLASH_MLA",),
        changed_files=(),
        configure_seconds=40.0,
        compile_seconds=2.0,
    )
    run.closure = closure.Closure(
        target=run.plan.id,
        platform="linux/arm64",
        python="3.12",
        requirements=("vllm",),
        verdict="failed",
        problems=("no aarch64 wheel of xformers==0.0.30",),
    )
    row = run.row()
    assert row["preflight"]["ok"] is False  # type: ignore[index]
    assert row["preflight"]["failing_units"][0]["file"] == "csrc/quant/nvfp4.cu"  # type: ignore[index]
    assert row["closure"] == {"verdict": "failed", "cell": "failed: no aarch64 wheel of xformers==0.0.30"}
    table = pipeline.summary_table([run])
    assert "1 units: 0 sass, 0 ptx-only, 1 none; 0/0 patched ok; 1 stubbed; 42s" in table
    assert "failed (preflight)" in table


def test_a_row_shows_the_aggregate_where_the_per_request_rate_came_in_bursts() -> None:
    run = a_run(pipeline.Status.PUBLISHED)
    assert run.result is not None and run.result.benchmark is not None
    bench = run.result.benchmark
    first = bench.levels[0]
    bursts = dataclasses.replace(first, figures=dataclasses.replace(first.figures, tokens_per_s_per_request=None))
    run.result = dataclasses.replace(run.result, benchmark=dataclasses.replace(bench, levels=(bursts, *bench.levels[1:])))
    assert "decode c=1: TTFT 14 ms, 241 tok/s" in pipeline.summary_table([run])


def test_a_target_with_several_checks_shows_each_and_fails_naming_each_that_failed() -> None:
    run = a_run(pipeline.Status.PUBLISHED)
    assert run.result is not None
    line = "Using CPU Unquantized MoE backend out of potential backends: ['CPU']"
    moe = dataclasses.replace(
        run.result,
        check="moe-alphabet",
        benchmark=None,
        kernels=(kernelpath.Chosen(kind="moe", expected=("CPU",), found=(("CPU", line),)),),
    )
    wrong = VerifyError("img gave 1 wrong answer(s) of 1")
    run.verified = verify.Verified(
        checks=("alphabet", "moe-alphabet", "moe-fp8"),
        results={"alphabet": run.result, "moe-alphabet": moe},
        failures={"moe-fp8": ToolMissingError("moe-fp8: cannot make the model")},
        folders={"moe-fp8": Path("out/t/checks/moe-fp8")},
    )
    row = run.row()
    assert row["verify"] == (
        "alphabet: 1/1 answers, decode c=1: TTFT 14 ms, 241 tok/s; moe-alphabet: 1/1 answers, moe CPU; moe-fp8: FAILED"
    )
    # A failed check names the server log to read (its folder keeps it, pass or fail).
    assert row["checks"] == [
        {"check": "alphabet", "ok": True, "skipped": None, "error": None, "log": None, "kernels": []},
        # The kernel path each check's server chose: what the report shows night by night.
        {
            "check": "moe-alphabet",
            "ok": True,
            "skipped": None,
            "error": None,
            "log": None,
            "kernels": [{"kind": "moe", "backends": ["CPU"], "ok": True}],
        },
        {
            "check": "moe-fp8",
            "ok": False,
            "skipped": None,
            "error": "moe-fp8: cannot make the model",
            "log": str(Path("out/t/checks/moe-fp8/server.log")),
            "kernels": [],
        },
    ]
    assert "check moe-fp8 FAILED: moe-fp8: cannot make the model (log: out/t/checks/moe-fp8/server.log)" in (
        pipeline.summary_table([run])
    )
    # One failure is raised as it was (its exit code); several in one message, of the first one's kind.
    with pytest.raises(ToolMissingError, match="cannot make the model"):
        run.verified.require()
    several = dataclasses.replace(run.verified, failures={"moe-alphabet": wrong, **run.verified.failures})
    assert pipeline.verified_cell(several).startswith("alphabet: 1/1 answers")
    assert "moe-alphabet: FAILED (1/1 answers, moe CPU)" in pipeline.verified_cell(several)
    with pytest.raises(VerifyError, match=r"2 of 3 checks failed:\ncheck moe-alphabet: img gave .*\ncheck moe-fp8: moe-fp8"):
        several.require()


def test_each_further_check_writes_its_result_in_its_own_folder(tmp_path: Path) -> None:
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", profile="local"))
    files = layout.result_files(tmp_path / "verify.json", p.target.checks)
    assert files == {"alphabet": tmp_path / "verify.json", "moe-alphabet": tmp_path / "checks" / "moe-alphabet" / "verify.json"}


def test_a_kernel_path_read_with_unverified_patterns_says_so_in_the_summary() -> None:
    """The recorded vLLM 0.32.0 CPU log read as a newer vLLM's (none exists to record: the stand-in
    for a fault that cannot be produced for real), its check accepting unverified patterns."""
    log = (DATA / "kernel-logs" / "vllm-0.32.0-cpu-mixtral.log").read_text()
    chosen = tuple(kernelpath.gate({"moe": ("CPU",)}, log, "0.34.0", accept_unverified=True))
    run = a_run(pipeline.Status.PUBLISHED)
    assert run.result is not None
    moe = dataclasses.replace(run.result, check="moe-alphabet", benchmark=None, kernels=chosen)
    why = "vLLM 0.34.0's log words are unread: patterns of kernel-paths.yaml ranges[0], read from 0.33.0"
    unverified = f"moe CPU [UNVERIFIED: {why}]"
    results = {"alphabet": run.result, "moe-alphabet": moe}
    run.verified = verify.Verified(checks=("alphabet", "moe-alphabet"), results=results, failures={})
    assert str(run.row()["verify"]).endswith(f"; moe-alphabet: 1/1 answers, {unverified}")
    # A check's only (or first) result shows its kernel path too.
    assert pipeline.verify_cell(moe) == f"1/1 answers, {unverified}"


def test_each_benchmarked_check_is_judged_on_its_own_and_the_worst_verdict_is_the_targets() -> None:
    run = a_run(pipeline.Status.REGRESSED)
    assert run.result is not None and run.result.benchmark is not None
    bench = run.result.benchmark
    base = dataclasses.replace(bench, levels=tuple(dataclasses.replace(lv, repeats=7) for lv in bench.levels))
    slower = benchmark.from_json(json.loads((BASELINE.parent / "slower.json").read_text()), "slower.json")
    checks = {c.name: c for c in run.plan.target.checks}
    for name, measured in (("alphabet", base), ("moe-alphabet", slower)):
        gate = regression.compare(measured, base, threshold_pct=10, baseline_of=f"sha256:{name}", baseline_target=run.plan.id)
        table = benchreport.table(measured, base, gate)
        run.speeds[name] = pipeline.Speed(
            check=checks[name], measured=measured, baseline=base, gate=gate, table=table, plot=Path(f"{name}.png")
        )
    row = run.row()
    # What the report plots night by night: the headline figures measured, and each beside its baseline.
    speeds = row["speed"]
    assert isinstance(speeds, dict)
    for check in speeds["checks"]:
        speed = run.speeds[check["check"]]
        assert check.pop("measured") == regression.headline_figures(speed.measured)
        assert check.pop("changes") == [c.to_json() for c in speed.gate.changes]
    assert {"scenario": "decode", "concurrency": 1, "figure": "tokens_per_s", "value": 240.9431} in (
        regression.headline_figures(base)
    )
    assert row["speed"] == {
        "verdict": "regressed",
        "checks": [
            {
                "check": "alphabet",
                "verdict": "ok",
                "baseline_of": "sha256:alphabet",
                "baseline_target": run.plan.id,
                "table": run.speeds["alphabet"].table,
                "plot": "alphabet.png",
            },
            {
                "check": "moe-alphabet",
                "verdict": "regressed",
                "baseline_of": "sha256:moe-alphabet",
                "baseline_target": run.plan.id,
                "table": run.speeds["moe-alphabet"].table,
                "plot": "moe-alphabet.png",
            },
        ],
    }
    table = pipeline.summary_table([run])
    assert f"### {run.plan.id} alphabet: speed (ok)" in table
    assert f"### {run.plan.id} moe-alphabet: speed (regressed)" in table
    pipeline.regressed(run, held=True)
    assert str(run.error).startswith("speed regressed: check moe-alphabet against sha256:moe-alphabet: ")
    assert "readable tags not moved" in str(run.error)
