"""The benchmark's pure parts: vllm bench serve's arguments, its saved results read into figures,
the consistency checks, the medians of repeats, and the regression gate's arithmetic on recorded
results (tests/data/bench/; no wall clock is read)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from builder import benchmark, benchreport, matrix, regression
from builder.benchmark import Benchmark, Figures, Shape
from builder.errors import VerifyError
from tests.support import DATA, ROOT

BENCH = DATA / "bench"


def recorded(name: str) -> Benchmark:
    """A sparkbuild benchmark result recorded from a real verify (verify.json's ``benchmark``)."""
    return benchmark.from_json(json.loads((BENCH / name).read_text()), name)


# --- shapes and argument lists -------------------------------------------------------------------


def test_the_full_shapes_are_kept_where_the_context_window_allows() -> None:
    assert benchmark.shape("decode", 32768) == Shape(input_len=2048, output_len=128)
    assert benchmark.shape("prefill", 32768) == Shape(input_len=4096, output_len=8)


def test_a_short_context_scales_the_shape_down_keeping_the_prompt_longest() -> None:
    # 128 tokens, an eighth kept free for the tokenizer: 112; decode keeps 16 output tokens.
    assert benchmark.shape("decode", 128) == Shape(input_len=96, output_len=16)
    assert benchmark.shape("prefill", 128) == Shape(input_len=108, output_len=4)
    for scenario in benchmark.SCENARIOS:
        for window in (64, 128, 1000, 2176, 4000):
            s = benchmark.shape(scenario, window)
            assert s.input_len + s.output_len <= window - max(4, window // 8)
            assert s.input_len > s.output_len


def test_a_window_too_short_for_any_benchmark_says_what_to_do() -> None:
    with pytest.raises(VerifyError, match="longer --max-model-len"):
        benchmark.shape("decode", 16)


def test_the_window_is_the_models_or_the_shorter_max_model_len() -> None:
    config = {"max_position_embeddings": 128}
    assert benchmark.context_window(config, ["--dtype", "float32"]) == 128
    assert benchmark.context_window(config, ["--max-model-len", "64"]) == 64
    assert benchmark.context_window(config, ["--max-model-len=100"]) == 100
    assert benchmark.context_window(config, ["--max-model-len", "4096"]) == 128
    with pytest.raises(VerifyError, match="max_position_embeddings"):
        benchmark.context_window({}, [])


def test_each_level_runs_each_scenario_each_repeat() -> None:
    runs = benchmark.runs([1, 2, 5, 10], 128, repeats=3)
    assert len(runs) == 4 * 3 * 3
    assert {r.name for r in runs} >= {"decode-c1-r0", "queueing-c10-r2", "prefill-c5-r1"}
    assert runs[0].repeat == 0 and runs[-1].repeat == 2  # repeats outermost


def test_the_arguments_pin_the_seed_warm_up_save_the_result_and_ask_for_p50_and_p99() -> None:
    (decode, _, queueing) = benchmark.runs([5], 128, repeats=1)
    args = benchmark.arguments(decode, url="http://127.0.0.1:8000", model="m", tokenizer="/model", result_dir="/results")
    assert args[:2] == ["bench", "serve"]

    def value(flag: str, of: list[str] = args) -> str:
        return of[of.index(flag) + 1]

    assert value("--seed") == str(benchmark.SEED) and int(value("--num-warmups")) > 0
    assert value("--random-input-len") == "96" and value("--random-output-len") == "16"
    assert value("--percentile-metrics") == "ttft,tpot,itl" and value("--metric-percentiles") == "50,99"
    assert value("--max-concurrency") == "5" and value("--num-prompts") == "10"
    assert "--save-result" in args and value("--result-dir") == "/results" and value("--result-filename") == "decode-c5-r0.json"
    queued = benchmark.arguments(queueing, url="u", model="m", tokenizer="t", result_dir="/r")
    # Queueing: more requests at once than the level, no client-side cap, so the server queues them.
    assert value("--request-rate", queued) == "inf" and value("--num-prompts", queued) == "20"
    assert "--max-concurrency" not in queued
    assert (decode.in_flight, queueing.in_flight) == (5, 20)  # what bounds the aggregate


# --- reading vLLM's result -------------------------------------------------------------------------


def test_a_saved_result_becomes_figures_taken_from_the_tool() -> None:
    f = benchmark.read(BENCH / "decode-c2.json")
    assert f == Figures(
        ttft_ms_p50=40.0,
        ttft_ms_p99=55.0,
        tpot_ms_p50=10.0,
        tpot_ms_p99=12.5,
        itl_ms_p50=9.8,
        itl_ms_p99=14.0,
        tokens_per_s_per_request=100.0,
        tokens_per_s=250.0,
        requests=4,
    )
    assert benchmark.inconsistencies(f, 2) == []


def test_a_failed_request_fails_the_benchmark_with_its_error() -> None:
    with pytest.raises(VerifyError, match=r"1 request\(s\) failed.*maximum context length"):
        benchmark.read(BENCH / "failed.json")


def test_a_result_without_a_figure_names_the_missing_field() -> None:
    with pytest.raises(VerifyError, match="no p99_ttft_ms"):
        benchmark.parse({"completed": 1, "failed": 0, "p50_ttft_ms": 1.0}, "r.json")


def test_impossible_figures_fail_loudly() -> None:
    f = benchmark.read(BENCH / "inconsistent.json")
    wrong = benchmark.inconsistencies(f, 2)
    assert any("TTFT p99 30.0 < p50 40.0" in w for w in wrong)
    assert any("82375.0 tok/s in aggregate is above 2 x the bound 10000" in w for w in wrong)  # the hand-made benchmark's
    run = benchmark.runs([2], 128, 1)[0]
    with pytest.raises(VerifyError, match="inconsistent"):
        benchmark.require_consistent(f, run)


def test_tokens_in_bursts_leave_the_per_request_rate_unmeasured() -> None:
    """ITL p50 below one engine step: the API server merged tokens; TPOT times the bursts."""
    f = benchmark.read(BENCH / "inconsistent.json")  # ITL p50 0.05 ms
    assert f.tokens_per_s_per_request is None


def test_an_aggregate_beyond_c_streams_at_their_own_rate_is_inconsistent() -> None:
    f = benchmark.read(BENCH / "decode-c2.json")  # 100 tok/s per request
    assert benchmark.inconsistencies(f, 2) == []
    assert any("more than 1 stream" in w for w in benchmark.inconsistencies(f, 1))  # 250 > 1 x 100 x 1.25


def test_repeats_give_the_median_of_each_figure_and_its_spread() -> None:
    one = benchmark.read(BENCH / "decode-c2.json")
    runs = [dataclasses.replace(one, tokens_per_s=v) for v in (240.0, 250.0, 300.0)]
    level = benchmark.median_of("decode", 2, Shape(input_len=96, output_len=16), runs)
    assert level.figures.tokens_per_s == 250.0
    assert level.spread["tokens_per_s"] == pytest.approx(0.24)
    assert level.figures.requests == 12 and level.repeats == 3


def test_a_rate_in_bursts_in_a_minority_of_repeats_still_has_a_median() -> None:
    one = benchmark.read(BENCH / "decode-c2.json")
    shape = Shape(input_len=96, output_len=16)
    mostly = [one, one, dataclasses.replace(one, tokens_per_s_per_request=None)]
    assert benchmark.median_of("decode", 2, shape, mostly).figures.tokens_per_s_per_request == 100.0
    rarely = [one, *[dataclasses.replace(one, tokens_per_s_per_request=None)] * 2]
    assert benchmark.median_of("decode", 2, shape, rarely).figures.tokens_per_s_per_request is None


def test_a_benchmark_round_trips_through_json() -> None:
    bench = recorded("baseline.json")
    assert benchmark.from_json(json.loads(json.dumps(bench.to_json())), "again") == bench
    with pytest.raises(VerifyError, match="not a sparkbuild benchmark"):
        benchmark.from_json({"levels": [{"scenario": "decode"}]}, "x.json")


# --- the gate ----------------------------------------------------------------------------------


def test_the_same_figures_are_ok() -> None:
    base = recorded("baseline.json")
    gate = regression.compare(base, base, threshold_pct=10, baseline_of="sha256:aa")
    assert gate.verdict == "ok" and gate.regressions() == []


def test_a_serve_setting_made_slower_is_a_regression_with_the_figures_side_by_side() -> None:
    gate = regression.compare(recorded("slower.json"), recorded("baseline.json"), threshold_pct=10, baseline_of="sha256:aa")
    assert gate.verdict == "regressed"
    worst = {(c.scenario, c.concurrency, c.figure) for c in gate.regressions()}
    assert ("queueing", 10, "ttft_ms_p99") in worst
    assert "vs baseline" in gate.reason()


def faster(bench: Benchmark, factor: float) -> Benchmark:
    """``bench`` with every rate ``factor`` times higher and every time ``factor`` times shorter."""

    def scaled(f: Figures) -> Figures:
        values: dict[str, Any] = {
            n: v if v is None else v * factor if n in regression.HIGHER_IS_BETTER else v / factor
            for n, v in dataclasses.asdict(f).items()
        }
        return Figures(**{**values, "requests": f.requests})

    return dataclasses.replace(bench, levels=tuple(dataclasses.replace(lv, figures=scaled(lv.figures)) for lv in bench.levels))


def test_a_faster_image_improves_and_becomes_the_next_baseline() -> None:
    base = recorded("baseline.json")
    quicker = faster(base, 1.3)
    gate = regression.compare(quicker, base, threshold_pct=10, baseline_of="sha256:bb")
    assert gate.verdict == "improved" and "regressed" not in {c.verdict for c in gate.changes}
    assert regression.next_baseline(quicker, base, gate) is quicker
    within = regression.compare(faster(base, 1.05), base, threshold_pct=10, baseline_of="sha256:bb")
    assert within.verdict == "ok"
    assert regression.next_baseline(faster(base, 1.05), base, within) is base  # ok: the old baseline carries on
    assert regression.compare(faster(base, 0.8), base, threshold_pct=10, baseline_of="sha256:bb").verdict == "regressed"


def test_the_threshold_is_the_floor_or_twice_the_noise_of_the_repeats() -> None:
    base = recorded("baseline.json")
    level = base.levels[0]
    quiet = dataclasses.replace(level, spread={"tokens_per_s": 0.01})
    noisy = dataclasses.replace(level, spread={"tokens_per_s": 0.2})
    assert regression.threshold("tokens_per_s", quiet, quiet, 0.10) == pytest.approx(0.10)
    assert regression.threshold("tokens_per_s", noisy, quiet, 0.10) == pytest.approx(0.4)
    assert regression.threshold("tokens_per_s", level, level, 0.10) == pytest.approx(max(0.10, 2 * level.spread["tokens_per_s"]))


def test_a_change_within_the_threshold_is_ok_and_direction_matters() -> None:
    assert regression.relative("tokens_per_s", 90, 100) == pytest.approx(-0.1)
    assert regression.relative("ttft_ms_p99", 90, 100) == pytest.approx(0.1)  # less waiting is better
    change = regression.Change(
        scenario="decode",
        concurrency=1,
        figure="tokens_per_s",
        value=95,
        baseline=100,
        change=-0.05,
        threshold=0.1,
        headline=True,
    )
    assert change.verdict == "ok"


def test_no_baseline_is_said_so() -> None:
    gate = regression.compare(recorded("baseline.json"), None, threshold_pct=10, baseline_of=None)
    assert gate.verdict == "no baseline"


# --- the report ----------------------------------------------------------------------------------


def test_the_table_shows_each_level_beside_its_baseline_and_the_verdict() -> None:
    base, slower = recorded("baseline.json"), recorded("slower.json")
    gate = regression.compare(slower, base, threshold_pct=10, baseline_of="sha256:aa")
    text = benchreport.table(slower, base, gate)
    lines = text.splitlines()
    assert lines[0].startswith("level") and [line.split()[0] for line in lines[2:6]] == ["c=1", "c=2", "c=5", "c=10"]
    assert "(was " in lines[5]
    assert lines[-1].startswith("verdict: regressed (baseline: sha256:aa): ")


def test_the_shipped_real_model_checks_find_their_published_figures() -> None:
    checks = matrix.load(ROOT / "matrix.yaml").checks
    assert sorted(benchreport.references(checks["gpt-oss-120b"].model)) == [1, 5, 10]
    assert sorted(benchreport.references(checks["qwen3-30b-a3b-fp8"].model)) == [1]
    assert benchreport.references(checks["alphabet"].model) == {}


def test_a_model_with_published_figures_shows_them_beside_the_measured_ones() -> None:
    bench = recorded("baseline.json")
    text = benchreport.table(bench, None, regression.compare(bench, None, threshold_pct=10, baseline_of=None), "gpt-oss-120b")
    assert "[published: 58-60 tok/s per request]" in text and "[published: 160.5 tok/s aggregate]" in text
    assert benchreport.references("alphabet") == {}


def test_the_plot_is_a_png_file(tmp_path: Path) -> None:
    path = benchreport.plot(recorded("slower.json"), recorded("baseline.json"), tmp_path, title="vllm-0.32.0-cpu-amd64")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
