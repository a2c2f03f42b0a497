"""A lane's summary table, from the rows of ``summary.json``; and one table from many of them.

A fanned-out lane (the nightly and rc workflows) runs each target in its own job, and each job
writes its own ``summary.json``. Their last job merges them here into the table one run prints,
with a row for every planned target: one whose job stopped before its lane wrote a summary is
shown as such, and counts as failed.

Pure: reads files, never Docker or the network; light, so ``sparkbuild summary`` starts fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparkbuild.config import options
from sparkbuild.errors import ConfigError
from sparkbuild.util import log, yamlsrc

Row = dict[str, Any]

# The keys of ``pipeline.TargetRun.row()`` (a test holds the two equal).
ROW_KEYS = (
    "target",
    "platform",
    "vllm",
    "commit",
    "patches",
    "tag",
    "tags",
    "digest",
    "signature",
    "status",
    "held",
    "failed_at",
    "closure",
    "preflight",
    "verify",
    "checks",
    "speed",
    "seconds",
    "stages",
    "startup",
    "error",
)
HEADER = (
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
MISSING = "no summary (job failed before the lane wrote one)"
NOTHING_TO_DO = "nothing to do"
# A summary.json holds a few rows: far below this.
MAX_BYTES = 16 * 1024 * 1024


def patch_cell(patches: dict[str, str] | None) -> str:
    if patches is None:
        return "-"
    return " ".join(f"{name}={status}" for name, status in patches.items()) or "none"


def platform_cell(platform: dict[str, Any] | None) -> str:
    """The platform the row's results are from, and whether they ran emulated (QEMU) on this host."""
    if not platform:
        return "-"
    return f"{platform['name']} (emulated)" if platform["emulated"] else str(platform["name"])


def cells(row: Row) -> tuple[str, ...]:
    """One table line from one ``summary.json`` row."""
    status, failed_at, seconds = row["status"], row["failed_at"], row["seconds"]
    return (
        str(row["target"]),
        platform_cell(row["platform"]),
        str(row["vllm"] or "-"),
        str(row["commit"] or "-")[:12],
        patch_cell(row["patches"]),
        row["preflight"]["cell"] if row["preflight"] else "-",
        str(row["tag"]).rsplit(":", 1)[-1] if row["tag"] else "-",  # the content tag, without its repository
        str(row["digest"] or "-")[:19],
        str(row["signature"] or "-"),
        str(row["verify"]),
        speed_cell(row.get("speed")),
        status if failed_at is None else f"{status} ({failed_at})",
        "-" if seconds is None else log.format_seconds(float(seconds)),
    )


def table(rows: Sequence[Row]) -> str:
    """A Markdown table a person reads at a glance (and GitHub renders)."""
    lines = [cells(r) for r in rows]
    widths = [max(len(c) for c in col) for col in zip(HEADER, *lines, strict=True)]

    def line(values: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(values, widths, strict=True)) + " |"

    return "\n".join([line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, lines)])


def speed_cell(speed: dict[str, Any] | None) -> str:
    """The regression gate's verdict over the target's benchmarked checks (``regressed``, ``ok``,
    ``improved``, ``too noisy``, ``no baseline``)."""
    return str(speed["verdict"]) if speed else "-"


def speeds(rows: Sequence[Row]) -> str:
    """Each benchmarked check's figures per level beside its baseline, and where its plot is."""
    parts = [
        f"### {r['target']} {c['check']}: speed ({c['verdict']})\n\n```\n{c['table']}\n```\n" + plot_line(str(c["plot"]))
        for r in rows
        if r.get("speed")
        for c in r["speed"]["checks"]
    ]
    return "\n\n".join(parts)


def plot_line(plot: str) -> str:
    """Where the plot is: in GitHub Actions a link to the run's artifacts (the target's job uploads
    its sparkbuild-out/, the plot at ``<target>/benchmark.png`` or ``checks/<name>/benchmark.png``
    in it), else its path."""
    run, repository = options.env("GITHUB_RUN_ID"), options.env("GITHUB_REPOSITORY")
    if not (run and repository) or plot in ("", "None"):
        return f"plot: {plot}"
    server = options.env("GITHUB_SERVER_URL", "https://github.com")
    inside = "/".join(Path(plot).parts[-2:])
    return f"plot: [{inside}]({server}/{repository}/actions/runs/{run}#artifacts) (in the target's artifact)"


def reasons(rows: Sequence[Row]) -> str:
    """Why each failed target failed, one Markdown line each (the table has no room for it)."""
    return "\n".join(f"- {r['target']}: {r['error']}" for r in rows if r["error"])


def check_notes(rows: Sequence[Row]) -> str:
    """Each check that failed (with the server log to read) or was skipped on this host (with why),
    one Markdown line each."""
    lines = []
    for r in rows:
        for c in r.get("checks") or ():
            if c.get("skipped"):
                lines.append(f"- {r['target']}: check {c['check']} SKIPPED: {c['skipped']}")
            elif c.get("error"):
                lines.append(f"- {r['target']}: check {c['check']} FAILED: {c['error']} (log: {c.get('log') or '-'})")
    return "\n".join(lines)


def failed(rows: Sequence[Row]) -> list[str]:
    """The targets that failed: as in a lane, a row with an error."""
    return [str(r["target"]) for r in rows if r["error"]]


# --- merging the fanned-out jobs' summaries --------------------------------------------------


def stand_in(target: str, status: str, error: str | None) -> Row:
    """A row for a target its job's summary.json does not describe."""
    row: Row = dict.fromkeys(ROW_KEYS)
    row.update(target=target, status=status, verify="-", tags=[], stages=[], error=error)
    return row


def read(path: Path) -> list[Row] | None:
    """The rows of one ``summary.json``; None when the file is not there."""
    if not path.exists():
        return None
    redo = "it is not a summary.json that `sparkbuild nightly` or `sparkbuild rc` wrote; rerun that target's job"
    try:
        data = json.loads(yamlsrc.read_text(path, "summary.json", MAX_BYTES))
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: not JSON ({str(exc)[:120]}); {redo}") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"{path}: not a list of rows; {redo}")
    for i, row in enumerate(data):
        lacking = [k for k in ROW_KEYS if k not in row]
        if lacking:
            raise ConfigError(f"{path}: row {i + 1} has no {', '.join(lacking)}; {redo}")
    rows: list[Row] = data
    return rows


def target_rows(target: str, rows: list[Row] | None) -> list[Row]:
    """What one target's job left: its rows, or a stand-in saying why there are none."""
    if rows is None:
        return [stand_in(target, MISSING, "its job uploaded no summary.json; its job's log says why")]
    if not rows:  # the lane ran and had nothing to do (rc: no new release candidate)
        return [stand_in(target, NOTHING_TO_DO, None)]
    mine = [r for r in rows if r["target"] == target]
    if not mine:
        listed = ", ".join(str(r["target"]) for r in rows)
        return [stand_in(target, "not in its job's summary", f"its job's summary.json lists {listed}, not this target")]
    return mine


def merge(targets: Sequence[str], folder: Path, prefix: str = "") -> list[Row]:
    """Every planned target's rows, in plan order, from ``folder/<prefix><target>/summary.json``
    (where actions/download-artifact puts the artifact ``<prefix><target>``)."""
    return [r for t in targets for r in target_rows(t, read(folder / f"{prefix}{t}" / "summary.json"))]


def parse_targets(text: str) -> tuple[str, ...]:
    """The planned target ids, as ``sparkbuild plan --ids`` prints them (a JSON list of strings)."""
    what = "--targets: give the JSON list of target ids that `sparkbuild plan --ids` prints"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise ConfigError(f"{what}; got {text[:80]!r}, not JSON") from None
    if not isinstance(data, list) or not all(isinstance(t, str) and t for t in data):
        raise ConfigError(f"{what}; got {text[:80]!r}")
    if len(set(data)) != len(data):
        raise ConfigError(f"{what}; {text[:80]!r} names a target twice")
    return tuple(data)
