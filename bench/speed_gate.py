"""The speed gate on this machine (docs/speed-gate.md): its tolerances, the slowed images' verdicts
and the real image against its own baseline, run after run.

Reproduce with:

    .venv/bin/python bench/speed_gate.py runs [--runs 4] [--check alphabet] [--check moe-alphabet]
        [--out bench/results/speed-gate.json]
    .venv/bin/python bench/speed_gate.py factors

``runs``: the shipped local image, each check served fresh ``--runs`` times as verify serves it
(its own compile volume) and benchmarked with the shipped settings; the first run is the baseline,
each later one is judged against it by the gate (``regression.compare``), as a nightly judges the
next image. Then the two images made slower on purpose (tests/support/speedrig.py: a sleep after the CPU
MoE kernel call; a sleep in every decode step), built from the shipped one, each benchmarked once
and judged against the same baseline; removed after. Writes every benchmark, each verdict with the
figures that moved, each headline figure's tolerance (or why it is too noisy to judge) and the
spread of each figure's medians over the runs. Minutes per run on 2 cores.

``factors``: ``regression.NOISE_FACTORS`` from a million simulated pairs of N normal draws each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.build import build  # noqa: E402
from sparkbuild.config import options  # noqa: E402
from sparkbuild.oci.engine import Engine  # noqa: E402
from sparkbuild.plan import matrix, plan  # noqa: E402
from sparkbuild.util import host  # noqa: E402
from sparkbuild.verify import regression  # noqa: E402
from sparkbuild.verify.benchmark import Benchmark  # noqa: E402
from tests.support import speedrig  # noqa: E402

# What each slowed image sleeps: a few times an engine step of the tiny models here (a few ms).
SLOWDOWNS: dict[speedrig.Kind, tuple[float, str]] = {"moe": (0.002, "moe-alphabet"), "decode": (0.003, "alphabet")}


def factors() -> dict[int, list[float]]:
    import numpy as np

    rng = np.random.default_rng(29)
    found = {}
    for n in range(3, 11):
        base, now = rng.standard_normal((2, 1_000_000, n))
        ratio = (np.median(now, axis=1) - np.median(base, axis=1)) / np.ptp(base, axis=1)
        found[n] = [round(float(q), 2) for q in np.quantile(ratio, [0.99, 0.995, 0.999])]
        print(f"N={n}: 1% {found[n][0]}, 0.5% {found[n][1]}, 0.1% {found[n][2]} (shipped: {regression.NOISE_FACTORS[n]})")
    return found


def tolerances(base: Benchmark, floor: float) -> list[dict[str, Any]]:
    """Each headline figure's tolerance against ``base``, or why it is too noisy to judge."""
    rows: list[dict[str, Any]] = []
    for level in base.levels:
        for figure in regression.HEADLINE[level.scenario]:
            if getattr(level.figures, figure) is None:
                rows.append(
                    {
                        "scenario": level.scenario,
                        "concurrency": level.concurrency,
                        "figure": figure,
                        "tolerance_pct": None,
                        "why_not": "not measured (tokens in bursts)",
                    }
                )
                continue
            tolerance, why = regression.threshold(figure, level, floor)
            rows.append(
                {
                    "scenario": level.scenario,
                    "concurrency": level.concurrency,
                    "figure": figure,
                    "spread_pct": round(level.spread.get(figure, 0.0) * 100, 1),
                    "tolerance_pct": None if tolerance is None else round(tolerance * 100, 1),
                    "why_not": why or None,
                }
            )
    return rows


def between_runs(benches: list[Benchmark]) -> list[dict[str, Any]]:
    """How far each headline figure's median moved from run to run: (max - min) / median."""
    rows = []
    for level in benches[0].levels:
        for figure in regression.HEADLINE[level.scenario]:
            values = [getattr(lv.figures, figure) for b in benches if (lv := b.level(level.scenario, level.concurrency))]
            measured = [float(v) for v in values if v is not None]
            moved = (max(measured) - min(measured)) / statistics.median(measured) if len(measured) > 1 else None
            rows.append(
                {
                    "scenario": level.scenario,
                    "concurrency": level.concurrency,
                    "figure": figure,
                    "medians": values,
                    "moved_pct": None if moved is None else round(moved * 100, 1),
                }
            )
    return rows


def judged(gate: regression.Gate) -> dict[str, Any]:
    return {
        "verdict": gate.verdict,
        "regressed": [c.to_json() for c in gate.regressions()],
        "too_noisy": [f"{c.scenario} c={c.concurrency} {c.figure}" for c in gate.unmeasured()],
        "headline": [c.to_json() for c in gate.changes if c.headline],
    }


def runs(args: argparse.Namespace) -> dict[str, Any]:
    opts = options.Options.from_env(matrix=ROOT / "matrix.yaml", profile="local")
    engine = Engine()
    (p,) = plan.make(opts)
    image = build.build(engine, p, opts).image
    checks = matrix.load(ROOT / "matrix.yaml").checks
    work: Path = args.work
    cpu = host.read_cpu()
    machine = {"cpu": cpu.model, "cores": cpu.cores, "features": list(cpu.features()), "load_before": list(os.getloadavg())}
    report: dict[str, Any] = {"image": image, "machine": machine, "checks": {}}
    for name in args.check:
        check = checks[name]
        check = dataclasses.replace(check, bench=True)
        floor = check.bench_threshold_pct / 100
        benches, seconds = [], []
        for i in range(args.runs):
            start = time.monotonic()
            benches.append(speedrig.measure(engine, image, check, opts.cache, work / name / f"run{i}"))
            seconds.append(round(time.monotonic() - start, 1))
            print(f"{name} run {i}: {seconds[-1]} s", flush=True)
        base = benches[0]
        gates = [regression.compare(b, base, threshold_pct=check.bench_threshold_pct, baseline_of="run0") for b in benches[1:]]
        report["checks"][name] = {
            "concurrency": list(check.concurrency),
            "repeats": check.bench_repeats,
            "floor_pct": check.bench_threshold_pct,
            "seconds_per_run": seconds,
            "benchmark_seconds": [round(b.seconds, 1) for b in benches],
            "tolerances": tolerances(base, floor),
            "between_runs": between_runs(benches),
            "real_against_its_baseline": [judged(g) for g in gates],
            "benchmarks": [b.to_json() for b in benches],
            "slowed": {},
        }
        for kind, (sleep, on) in SLOWDOWNS.items():
            if on != name:
                continue
            slow = speedrig.slowed_image(engine, image, kind, sleep, work / f"image-{kind}")
            try:
                bench = speedrig.measure(engine, slow, check, opts.cache, work / name / f"slower-{kind}")
            finally:
                speedrig.remove(engine, slow)
            gate = regression.compare(bench, base, threshold_pct=check.bench_threshold_pct, baseline_of="run0")
            report["checks"][name]["slowed"][kind] = {"sleep_s": sleep, **judged(gate), "benchmark": bench.to_json()}
            print(f"{name} slower-{kind}: {gate.verdict}: {gate.reason()}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("factors")
    r = sub.add_parser("runs")
    r.add_argument("--runs", type=int, default=4)
    r.add_argument("--check", action="append", default=None)
    r.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "sparkbuild-speed-gate")
    r.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speed-gate.json")
    args = parser.parse_args()
    if args.command == "factors":
        factors()
        return
    args.check = args.check or ["alphabet", "moe-alphabet"]
    report = runs(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
