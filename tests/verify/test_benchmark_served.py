"""Speed with vLLM's own benchmark, on the real local image and the known-answer model: the figures
are consistent at every level; and, against the real embedded registry, each check's baseline
round-trips, a regressed image keeps the readable tags where they were, and a release with no
baseline of its own is compared with its lineage's. Images made slower on purpose are flagged in
tests/verify/test_speed_gate.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparkbuild.config.options import Options
from sparkbuild.lanes import pipeline
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import plan
from sparkbuild.publish import baseline
from sparkbuild.publish.publish import last_good_tag
from sparkbuild.verify import benchmark, benchreport, regression, verify
from sparkbuild.verify.benchmark import Benchmark
from tests.support import DATA, ROOT, speedrig
from tests.support.matrix import LOCAL_PLATFORM, local_id

# Not alone: its figures are held to each other (every request done, each level consistent in itself,
# a ceiling), never to another measurement, so the other worker's load slows them and breaks none.
pytestmark = pytest.mark.docker

RECORDED = DATA / "bench"


@pytest.fixture(scope="module")
def local_plan(cache: Path) -> plan.TargetPlan:
    """The shipped local target's plan on this host (amd64 or arm64); the session's ``local_image`` is its image."""
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", only=(local_id(),), cache=cache))
    return p


def test_the_tiny_models_figures_are_consistent_at_every_level(
    engine: Engine, local_image: str, local_plan: plan.TargetPlan, cache: Path, tmp_path: Path
) -> None:
    check = dataclasses.replace(local_plan.target.check, bench_repeats=1)
    bench = speedrig.measure(engine, local_image, check, cache, tmp_path / "bench")
    assert {(lv.scenario, lv.concurrency) for lv in bench.levels} == {
        (s, c) for s in benchmark.SCENARIOS for c in check.concurrency
    }
    runs = {(r.scenario, r.concurrency): r for r in benchmark.runs(check.concurrency, bench.window, 1)}
    for level in bench.levels:
        f, run = level.figures, runs[(level.scenario, level.concurrency)]
        assert f.requests == run.num_prompts  # every request completed; none failed
        assert benchmark.inconsistencies(f, run.in_flight) == []
        assert f.ttft_ms_p99 >= f.ttft_ms_p50 > 0 and f.itl_ms_p99 >= f.itl_ms_p50 and f.tpot_ms_p99 >= f.tpot_ms_p50
        assert f.tokens_per_s <= run.in_flight * benchmark.MAX_STREAM_TOKENS_PER_S
    # The model's 128-token window, scaled as benchmark.shape says; each level's time is recorded.
    assert bench.window == 128 and bench.levels[0].shape == benchmark.Shape(input_len=96, output_len=16)
    assert set(bench.seconds_per_level) == set(check.concurrency)
    print(f"benchmark seconds per level: {bench.seconds_per_level}")  # the cost, for the record
    png = benchreport.plot(bench, None, tmp_path, title=local_plan.id)
    assert png.read_bytes()[:4] == b"\x89PNG"


# --- the baseline in the registry, and the readable tags of a regressed image -------------------


def recorded(name: str, repeats: int = 5) -> Benchmark:
    """A recorded benchmark, as if each of its figures were the median of ``repeats`` runs."""
    bench = benchmark.from_json(json.loads((RECORDED / name).read_text()), name)
    return dataclasses.replace(bench, levels=tuple(dataclasses.replace(lv, repeats=repeats) for lv in bench.levels))


def a_run(p: plan.TargetPlan, image: str, measured: Benchmark, found: baseline.Found | None) -> pipeline.TargetRun:
    answer = verify.Answer(name="completion", api="completions", prompt="c d e f", expected=" g h i j", received=" g h i j")
    result = verify.VerifyResult(
        image=image, model="alphabet", check="alphabet", startup_s=1.0, answers=(answer,), benchmark=measured
    )
    was = found.benchmark if found else None
    check = p.target.check
    gate = regression.compare(
        measured,
        was,
        threshold_pct=check.bench_threshold_pct,
        baseline_of=found.image if found else None,
        baseline_target=found.target if found else None,
    )
    speed = pipeline.Speed(check=check, measured=measured, baseline=was, gate=gate, table="", plot=Path("benchmark.png"))
    return pipeline.TargetRun(p, image=image, result=result, speeds={check.name: speed})


def test_the_baseline_round_trips_and_a_regressed_image_keeps_the_readable_tags(
    engine: Engine, base: str, registry: Registry, local_plan: plan.TargetPlan, tmp_path: Path
) -> None:
    # Two small real images stand in for two nights' builds (their SBOMs are read from them).
    first, second = "sparkbuild-test/bench-first:1", "sparkbuild-test/bench-second:1"
    engine.tag(base, "sparkbuild-test/bench-first", "1")
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(f"FROM {base}\nLABEL io.sparkbuild.test=second\n")
    engine.build(
        context=tmp_path / "ctx",
        tag=second,
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=tmp_path / "b.log",
    )
    opts = Options.from_env(
        matrix=ROOT / "matrix.yaml", only=(local_id(),), out=tmp_path / "out", lock=tmp_path / "matrix.lock.json"
    )
    ctx = pipeline.Context(opts, registry, tmp_path / "work", {})
    check = local_plan.target.check.name
    try:
        # Night one: no baseline yet; published, its own figures become the baseline of its check.
        night1 = a_run(local_plan, first, recorded("baseline.json"), baseline.read(registry, local_plan, check))
        assert night1.speed_verdict == "no baseline"
        pipeline.publish_image(ctx, night1)
        assert night1.status == pipeline.Status.PUBLISHED and night1.error is None
        found = baseline.read(registry, local_plan, check)
        assert found is not None and found.image == night1.digest and found.target == local_plan.id
        assert found.benchmark == recorded("baseline.json")
        assert baseline.read(registry, local_plan, "moe-alphabet") is None  # each check has its own

        # Night two: slower; published by digest, readable tags and last-good left on night one.
        p2 = dataclasses.replace(local_plan, content_tag=f"{local_plan.content_tag}-slower")
        night2 = a_run(p2, second, recorded("slower.json"), found)
        pipeline.publish_image(ctx, night2)
        assert night2.status == pipeline.Status.REGRESSED and "readable tags not moved" in str(night2.error)
        assert f"check {check} against {night1.digest}" in str(night2.error)
        for tag in (*local_plan.tags, last_good_tag(local_plan.id)):
            assert registry.digest(local_plan.repository, tag) == night1.digest, tag
        assert registry.digest(local_plan.repository, p2.content_tag) == night2.digest != night1.digest
        # Its attached baseline is night one's, carried forward; the target's baseline is unchanged.
        again = baseline.read(registry, local_plan, check)
        assert again is not None and again.image == night1.digest and again.benchmark == found.benchmark

        # Where the check does not hold tags, a regressed image moves them (and is still flagged).
        loose = dataclasses.replace(p2.target.check, bench_hold_tags=False)
        p3 = dataclasses.replace(p2, target=dataclasses.replace(p2.target, checks=(loose,)), content_tag=f"{p2.content_tag}-2")
        night3 = a_run(p3, second, recorded("slower.json"), found)
        pipeline.publish_image(ctx, night3)
        assert night3.status == pipeline.Status.REGRESSED
        assert registry.digest(local_plan.repository, local_plan.tags[-1]) == night2.digest

        # The next release has no last-good of its own: its lineage's (this release's) is its baseline;
        # another platform's, a newer release's or a release candidate's never is.
        later = dataclasses.replace(local_plan, target=dataclasses.replace(local_plan.target, id=local_id("0.33.0")))
        lineage = baseline.read(registry, later, check)
        assert lineage is not None and lineage.target == local_plan.id
        assert lineage.image == registry.digest(local_plan.repository, last_good_tag(local_plan.id)) == night3.digest
        other = dataclasses.replace(local_plan, target=dataclasses.replace(local_plan.target, id="vllm-0.33.0-cpu-riscv64"))
        assert baseline.read(registry, other, check) is None
        older = dataclasses.replace(local_plan, target=dataclasses.replace(local_plan.target, id=local_id("0.31.0")))
        assert baseline.read(registry, older, check) is None
    finally:  # the names this test gave (the base keeps its own)
        for ref in (first, second):
            for name in engine.inspect(ref)["RepoTags"]:
                if name in (first, second) or name.startswith(f"{registry.host}/"):
                    engine.client.images.remove(name)
