"""Each benchmarked check's headline figures night by night: the points measured, the baseline each
was judged against with the gate's band around it, and the nights that moved it marked.

Drawn with matplotlib (the benchmark's own plots use it) as SVG: text stays text, the ids are fixed
(``svg.hashsalt``) and no date is written, so the same history draws the same file. Each marked night
is an element of its own (``id="moved-<night>-<figure>"``), so a test, or a person's browser, finds it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sparkbuild import __version__
from sparkbuild.report.history import Cell
from sparkbuild.util import fsutil

# A night's baseline and band are drawn this far either side of it.
NIGHT_HALF = timedelta(hours=8)
# Small multiples: one panel per figure and level, this many side by side.
COLUMNS = 4
# The benchmark's own scenarios and labels (sparkbuild.verify.benchmark.SCENARIOS, benchreport.PLOTS),
# restated: a nightly with nothing to build writes the report, and must not load the verify stage to do
# it (tests/lanes/test_nightly.py holds it to that).
SCENARIOS = ("decode", "prefill", "queueing")
LABELS = {
    "tokens_per_s_per_request": "output tok/s per request",
    "tokens_per_s": "output tok/s (all requests)",
    "ttft_ms_p50": "TTFT p50 (ms)",
    "ttft_ms_p99": "TTFT p99 (ms)",
}


@dataclass(frozen=True, kw_only=True)
class Point:
    """One figure on one night: measured, and (where there was one) the baseline and its band."""

    night: str
    series: str
    value: float
    baseline: float | None = None
    threshold_pct: float | None = None
    verdict: str = "no baseline"
    # Where its panel sits: by scenario, figure, then concurrency.
    key: tuple[int, str, int] = (0, "", 0)

    @property
    def moved(self) -> bool:
        return self.verdict in ("regressed", "improved")


def series_name(figure: dict[str, Any]) -> str:
    return f"{figure['scenario']} c={figure['concurrency']} {LABELS.get(figure['figure'], figure['figure'])}"


def points(cells: Sequence[Cell], check: str) -> list[Point]:
    """Every headline figure of ``check`` on each night that measured it, oldest first."""
    found: list[Point] = []
    for cell in cells:
        for speed in (cell.row.get("speed") or {}).get("checks") or ():
            if speed.get("check") != check:
                continue
            changes = {(c["scenario"], c["concurrency"], c["figure"]): c for c in speed.get("changes") or ()}
            for figure in speed.get("measured") or ():
                change = changes.get((figure["scenario"], figure["concurrency"], figure["figure"]))
                found.append(
                    Point(
                        night=cell.night,
                        series=series_name(figure),
                        value=float(figure["value"]),
                        baseline=None if change is None else float(change["baseline"]),
                        threshold_pct=None if change is None else change.get("threshold_pct"),
                        verdict="no baseline" if change is None else str(change["verdict"]),
                        key=(SCENARIOS.index(figure["scenario"]), figure["figure"], int(figure["concurrency"])),
                    )
                )
    return found


def checks_measured(cells: Sequence[Cell]) -> list[str]:
    return sorted({str(s["check"]) for c in cells for s in (c.row.get("speed") or {}).get("checks") or () if s.get("measured")})


def draw(found: Sequence[Point], path: Path, *, title: str, cache: Path | None = None) -> Path:
    """One SVG, a panel per figure, nights along the bottom. The same points draw the same file, so
    one drawn before (kept under ``cache`` by what it shows) is copied, not drawn again."""
    shown = [(p.night, p.series, p.value, p.baseline, p.threshold_pct, p.verdict) for p in found]
    key = hashlib.sha256(json.dumps([title, __version__, shown]).encode()).hexdigest()
    kept = None if cache is None else cache / f"{key}.svg"
    if kept is not None and kept.is_file():
        fsutil.write_bytes(path, kept.read_bytes())
        return path
    _draw(found, path, title)
    if kept is not None:
        fsutil.write_bytes(kept, path.read_bytes())
    return path


def _draw(found: Sequence[Point], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a runner
    matplotlib.rcParams["svg.hashsalt"] = "sparkbuild-report"
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    keys = {p.series: p.key for p in found}
    names = sorted(keys, key=lambda name: keys[name])
    rows = -(-len(names) // COLUMNS)
    height = 2.4 * rows + 0.6
    # Fixed margins, not the constrained layout: that costs more than drawing every panel.
    figure, axes = plt.subplots(rows, COLUMNS, figsize=(3.4 * COLUMNS, height), squeeze=False, sharex=True)
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.6 / height, top=1 - 0.55 / height, wspace=0.22, hspace=0.35)
    for ax, name in zip(axes.flat, names, strict=False):
        _panel(ax, [p for p in found if p.series == name], name)
    _dates(axes.flat[0], sorted({_day(p.night) for p in found}))  # shared by every panel
    _legend(axes.flat[0])
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="svg", metadata={"Date": None})
    plt.close(figure)


def _panel(ax: Any, found: list[Point], name: str) -> None:
    x = [_day(p.night) for p in found]
    ax.plot(x, [p.value for p in found], marker="o", markersize=3, label="measured", gid=f"measured-{slug(name)}")
    # What each night was judged against: its baseline and the gate's band, one collection each (a
    # patch per night is thousands of artists a year, and matplotlib draws each on its own).
    judged = [(day, p) for day, p in zip(x, found, strict=True) if p.baseline is not None]
    if judged:
        _bands(ax, judged)
    for day, point in zip(x, found, strict=True):
        if point.moved:  # few: each an element of its own, found by its id
            color = "tab:red" if point.verdict == "regressed" else "tab:green"
            ax.plot(
                [day],
                [point.value],
                marker="o",
                markersize=11,
                fillstyle="none",
                color=color,
                linestyle="none",
                gid=f"moved-{point.night}-{slug(name)}",
            )
    ax.set_title(name, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=7)


def _bands(ax: Any, judged: list[tuple[datetime, Point]]) -> None:
    """The nights' bands as one compound path and their baselines as one line broken between nights:
    two SVG elements a panel, however many nights (a patch or a segment per night is thousands of
    elements a year, each drawn and written on its own)."""
    import matplotlib.dates as mdates
    import numpy as np
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as Outline

    days = np.asarray(mdates.date2num([day for day, _ in judged]))  # type: ignore[no-untyped-call]
    base = np.array([point.baseline or 0.0 for _, point in judged])
    width = base * np.array([point.threshold_pct or 0.0 for _, point in judged]) / 100
    half = NIGHT_HALF / timedelta(days=1)
    left, right, low, high = days - half, days + half, base - width, base + width
    boxes = np.stack(
        [np.stack([left, low], 1), np.stack([right, low], 1), np.stack([right, high], 1), np.stack([left, high], 1)], 1
    )
    band = PathPatch(Outline.make_compound_path_from_polys(boxes), facecolor="grey", alpha=0.25, linewidth=0)
    # Added as an artist with its corners as the data limits: add_patch walks every curve of the path.
    ax.add_artist(band)
    band.set_transform(ax.transData)
    ax.update_datalim(np.concatenate([np.stack([left, low], 1), np.stack([right, high], 1)]))
    gap = np.full_like(days, np.nan)
    ax.plot(np.stack([left, right, gap], 1).ravel(), np.stack([base, base, gap], 1).ravel(), linestyle="--", color="dimgrey")


def _legend(ax: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Line2D([], [], marker="o", label="measured"),
        Line2D([], [], linestyle="--", color="dimgrey", label="baseline judged against"),
        Patch(color="grey", alpha=0.25, label="gate's band"),
        Line2D([], [], marker="o", markersize=10, fillstyle="none", color="tab:red", linestyle="none", label="moved it"),
    ]
    ax.legend(handles=handles, fontsize=7, loc="lower left")


def _dates(ax: Any, days: list[datetime]) -> None:
    """Nights along the bottom: one tick a night over two weeks or less, else as matplotlib spaces them."""
    import matplotlib.dates as mdates

    span = (max(days) - min(days)).days if days else 0
    # matplotlib's own annotations leave these constructors untyped.
    locator = mdates.DayLocator() if span <= 14 else mdates.AutoDateLocator(minticks=3, maxticks=7)  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    if span == 0 and days:  # one night: a day either side, not matplotlib's years
        ax.set_xlim(min(days) - timedelta(days=1), max(days) + timedelta(days=1))


@functools.cache
def _day(night: str) -> datetime:
    return datetime.strptime(night, "%Y%m%d")


def slug(text: str) -> str:
    """``text`` as a part of an element id or a file name."""
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-")
