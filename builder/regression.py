"""The regression gate: this image's speed against its target's baseline, figure by figure.

Pure arithmetic on two ``benchmark.Benchmark`` values. Each figure is a median of repeated runs;
a change counts only beyond the noise threshold: the larger of the check's ``bench_threshold_pct``
and twice the spread the repeats showed (this run's or the baseline's, whichever is wider), so a
noisy machine does not flag a regression and a quiet one still catches a small one.

The verdict weighs each scenario's headline figure (what a user feels): decode tok/s per request
and in aggregate, prefill TTFT p50, queueing TTFT p99. Every other figure is compared and shown
beside its baseline, but p99s of a few requests are too noisy to fail an image on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from builder.benchmark import Benchmark, Level, Scenario

Verdict = Literal["regressed", "ok", "improved", "no baseline"]

# Figures where more is better; every other (times in ms) is better when less.
HIGHER_IS_BETTER = ("tokens_per_s", "tokens_per_s_per_request")
HEADLINE: dict[Scenario, tuple[str, ...]] = {
    "decode": ("tokens_per_s_per_request", "tokens_per_s"),  # per request where the stream shows it
    "prefill": ("ttft_ms_p50",),
    "queueing": ("ttft_ms_p99",),
}
COMPARED = (
    "tokens_per_s_per_request",
    "tokens_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
)
# The spread of N repeats underestimates the noise of one median; twice it is the allowance.
SPREAD_FACTOR = 2.0


@dataclass(frozen=True, kw_only=True)
class Change:
    """One figure of one scenario at one level, this image's beside the baseline's."""

    scenario: Scenario
    concurrency: int
    figure: str
    value: float
    baseline: float
    # Signed relative change, positive = better (faster, or less waiting).
    change: float
    threshold: float
    headline: bool

    @property
    def verdict(self) -> Verdict:
        if self.change < -self.threshold:
            return "regressed"
        if self.change > self.threshold:
            return "improved"
        return "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "concurrency": self.concurrency,
            "figure": self.figure,
            "value": self.value,
            "baseline": self.baseline,
            "change_pct": round(self.change * 100, 1),
            "threshold_pct": round(self.threshold * 100, 1),
            "headline": self.headline,
            "verdict": self.verdict,
        }


@dataclass(frozen=True, kw_only=True)
class Gate:
    """The gate's answer for one image: each figure's change and the verdict they add up to."""

    changes: tuple[Change, ...]
    baseline_of: str | None

    @property
    def verdict(self) -> Verdict:
        if self.baseline_of is None:
            return "no baseline"
        headline = [c.verdict for c in self.changes if c.headline]
        if "regressed" in headline:
            return "regressed"
        return "improved" if "improved" in headline else "ok"

    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.headline and c.verdict == "regressed"]

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "baseline_of": self.baseline_of, "changes": [c.to_json() for c in self.changes]}

    def reason(self) -> str:
        """One line naming each headline figure that regressed, beside its baseline."""
        return "; ".join(
            f"{c.scenario} c={c.concurrency} {c.figure} {c.value:.1f} vs baseline {c.baseline:.1f} "
            f"({c.change * 100:+.1f}%, threshold {c.threshold * 100:.0f}%)"
            for c in self.regressions()
        )


def relative(figure: str, value: float, baseline: float) -> float:
    """The change from ``baseline`` to ``value``, positive when better."""
    if baseline == 0:
        return 0.0
    delta = (value - baseline) / baseline
    return delta if figure in HIGHER_IS_BETTER else -delta


def threshold(figure: str, level: Level, base: Level, floor: float) -> float:
    noise = max(level.spread.get(figure, 0.0), base.spread.get(figure, 0.0))
    return max(floor, SPREAD_FACTOR * noise)


def compare(current: Benchmark, baseline: Benchmark | None, *, threshold_pct: float, baseline_of: str | None) -> Gate:
    """Each figure of ``current`` against ``baseline`` (levels and scenarios both have); a change
    counts beyond ``threshold_pct`` percent or the repeats' noise, whichever is larger."""
    if baseline is None:
        return Gate(changes=(), baseline_of=None)
    floor = threshold_pct / 100
    changes: list[Change] = []
    for level in current.levels:
        base = baseline.level(level.scenario, level.concurrency)
        if base is None:
            continue  # a level the baseline did not measure: nothing to compare it with
        for figure in COMPARED:
            now, then = getattr(level.figures, figure), getattr(base.figures, figure)
            if now is None or then is None:
                continue  # not measured in one of them (tokens in bursts): nothing to compare
            value, was = float(now), float(then)
            changes.append(
                Change(
                    scenario=level.scenario,
                    concurrency=level.concurrency,
                    figure=figure,
                    value=value,
                    baseline=was,
                    change=relative(figure, value, was),
                    threshold=threshold(figure, level, base, floor),
                    headline=figure in HEADLINE[level.scenario],
                )
            )
    return Gate(changes=tuple(changes), baseline_of=baseline_of)


def next_baseline(current: Benchmark, baseline: Benchmark | None, gate: Gate) -> Benchmark:
    """What the next image of the target is compared with: this one's figures where they improved
    (or there were none before), else the old baseline, carried forward so a slow drift within the
    threshold each night cannot add up unseen."""
    if baseline is None or gate.verdict in ("improved", "no baseline"):
        return current
    return baseline
