"""The benchmark for a person: plots against concurrency, a plain-text table, published references.

Plots are drawn with matplotlib's Agg backend (no display needed) into the target's output folder;
the table is what the terminal summary prints under the lane's table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.verify.benchmark import SCENARIOS, Benchmark, Level, Scenario
from sparkbuild.verify.regression import Gate


@dataclass(frozen=True, kw_only=True)
class Reference:
    """A published figure for a model on a DGX Spark, shown beside a measured one."""

    model: str
    concurrency: int
    # "per request" (one stream's decode tok/s) or "aggregate" (every stream's).
    kind: str
    low: float
    high: float
    source: str

    def cell(self) -> str:
        value = f"{self.low:g}" if self.low == self.high else f"{self.low:g}-{self.high:g}"
        return f"{value} tok/s {self.kind}"


# From ../shared/seeds: the figures a Spark user compares an image with (decode, prompt 2048/128
# for gpt-oss-120b; single-stream chat for Qwen3-30B-A3B-FP8).
GPT_OSS = "seeds/004_70f57a0587091339.txt"
QWEN = "seeds/000_73a540043c0431bb.txt"
REFERENCES = (
    Reference(model="gpt-oss-120b", concurrency=1, kind="per request", low=58, high=60, source=GPT_OSS),
    Reference(model="gpt-oss-120b", concurrency=5, kind="aggregate", low=118.7, high=118.7, source=GPT_OSS),
    Reference(model="gpt-oss-120b", concurrency=10, kind="aggregate", low=160.5, high=160.5, source=GPT_OSS),
    Reference(model="Qwen3-30B-A3B-FP8", concurrency=1, kind="per request", low=51, high=54, source=QWEN),
)


def references(model: str) -> dict[int, Reference]:
    """The published figures of ``model`` (a check's model: a name, or a hub id such as
    ``openai/gpt-oss-120b`` or ``Qwen/Qwen3-30B-A3B-Instruct-2507-FP8``), by concurrency."""
    return {r.concurrency: r for r in REFERENCES if _family(r.model) == _family(model)}


def _family(model: str) -> str:
    """The model's name without its organisation and its ``Instruct-2507``-style release marks."""
    name = model.rsplit("/", 1)[-1].lower()
    return re.sub(r"-instruct(-\d+)?", "", name)


# --- the plain-text table ----------------------------------------------------------------------

HEADER = ("level", "decode tok/s (1 req / all)", "TPOT p50/p99 ms", "prefill TTFT p50 ms", "queueing TTFT p99 ms", "requests")


def _pair(level: Level | None, baseline: Level | None, figure: str) -> str:
    """``figure`` of ``level``, beside the baseline's where there is one."""
    if level is None:
        return "-"

    def shown(value: float | None) -> str:
        return "bursts" if value is None else f"{value:.1f}"  # see Figures.tokens_per_s_per_request

    now = shown(getattr(level.figures, figure))
    return now if baseline is None else f"{now} (was {shown(getattr(baseline.figures, figure))})"


def rows(current: Benchmark, baseline: Benchmark | None, model: str = "") -> list[tuple[str, ...]]:
    """One row per concurrency level: the three scenarios' headline figures, each beside its
    baseline's where there is one, and the published reference where the model has one."""
    refs = references(model)
    out: list[tuple[str, ...]] = []
    for c in sorted({lv.concurrency for lv in current.levels}):
        decode, prefill, queueing = (current.level(s, c) for s in SCENARIOS)
        was = {s: baseline.level(s, c) if baseline else None for s in SCENARIOS}
        rates = f"{_pair(decode, was['decode'], 'tokens_per_s_per_request')} / {_pair(decode, was['decode'], 'tokens_per_s')}"
        published = f" [published: {refs[c].cell()}]" if c in refs else ""
        tpot = f"{decode.figures.tpot_ms_p50:.1f} / {decode.figures.tpot_ms_p99:.1f}" if decode else "-"
        out.append(
            (
                f"c={c}",
                rates + published,
                tpot,
                _pair(prefill, was["prefill"], "ttft_ms_p50"),
                _pair(queueing, was["queueing"], "ttft_ms_p99"),
                "/".join(str(lv.figures.requests) for lv in (decode, prefill, queueing) if lv),
            )
        )
    return out


def table(current: Benchmark, baseline: Benchmark | None, gate: Gate, model: str = "") -> str:
    """The benchmark as a plain-text table, then the verdict and what regressed."""
    lines = rows(current, baseline, model)
    widths = [max(len(cell) for cell in col) for col in zip(HEADER, *lines, strict=True)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    text = [line(HEADER), line(["-" * w for w in widths]), *map(line, lines)]
    verdict = f"verdict: {gate.verdict}"
    if gate.baseline_of:
        lineage = f", {gate.baseline_target}'s last-good" if gate.baseline_target else ""
        verdict += f" (baseline: {gate.baseline_of}{lineage})"
    if gate.regressions():
        verdict += f": {gate.reason()}"
    if gate.unmeasured():
        verdict += f"; too noisy to judge here: {gate.noisy()}"
    return "\n".join([*text, verdict])


# --- plots ---------------------------------------------------------------------------------------

PLOTS: tuple[tuple[str, str, Scenario, str], ...] = (
    # file stem, y label, scenario, figure
    ("decode-tokens-per-s", "output tok/s (all requests)", "decode", "tokens_per_s"),
    ("decode-tokens-per-s-per-request", "output tok/s per request", "decode", "tokens_per_s_per_request"),
    ("prefill-ttft", "TTFT p50 (ms)", "prefill", "ttft_ms_p50"),
    ("queueing-ttft-p99", "TTFT p99 (ms)", "queueing", "ttft_ms_p99"),
)


def _series(bench: Benchmark, scenario: Scenario, figure: str) -> tuple[list[int], list[float]]:
    """The levels that measured ``figure`` and its values (a per-request rate in bursts is left out)."""
    levels = sorted((lv for lv in bench.levels if lv.scenario == scenario), key=lambda lv: lv.concurrency)
    measured = [(lv.concurrency, getattr(lv.figures, figure)) for lv in levels if getattr(lv.figures, figure) is not None]
    return [c for c, _ in measured], [float(v) for _, v in measured]


def plot(current: Benchmark, baseline: Benchmark | None, folder: Path, *, title: str, baseline_label: str = "baseline") -> Path:
    """One PNG of four panels (decode tok/s in aggregate and per request, prefill TTFT, queueing
    TTFT p99) against concurrency, this image beside its baseline; its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a runner
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for ax, (_, label, scenario, name) in zip(axes.flat, PLOTS, strict=True):
        x, y = _series(current, scenario, name)
        ax.plot(x, y, marker="o", label="this image")
        if baseline is not None:
            bx, by = _series(baseline, scenario, name)
            ax.plot(bx, by, marker="s", linestyle="--", label=baseline_label)
        ax.set_title(f"{scenario}: {label}")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({lv.concurrency for lv in current.levels}))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    figure.suptitle(title)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "benchmark.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
