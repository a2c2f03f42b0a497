"""The report's static site: one page a team opens in the morning, and a page per image.

The pages are Jinja2 templates (sparkbuild's Dockerfiles use it already) with no JavaScript: a grid of
targets by night, where each readable tag points now, each speed figure over time (``plots``), the
kernel paths vLLM chose when they changed, each patch's status per release; per image what
``inspect`` shows, its checks' answers and logprobs, and its SBOM beside the previous night's.

The site is written in a folder beside ``dest`` and moved into place whole, so a report that fails
half way leaves the previous site as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2

from sparkbuild.errors import ConfigError, PublishError
from sparkbuild.oci.registry import Registry
from sparkbuild.publish import inspection
from sparkbuild.report import history, plots
from sparkbuild.report.history import NIGHTS, Cell, History, Image, log_text
from sparkbuild.resources.packaged import resource
from sparkbuild.util import fsutil, log

# The file that marks a folder as a site the report wrote (and so may replace whole).
MARK = ".sparkbuild-report"


@dataclass(frozen=True, kw_only=True)
class CellView:
    state: str
    label: str
    detail: str
    image: str | None
    logs: tuple[tuple[str, str], ...]


@dataclass
class Page:
    """One repository's part of the index."""

    history: History
    nights: list[str]
    grid: dict[str, dict[str, CellView]] = field(default_factory=dict)
    pulls: dict[str, list[tuple[str, str, str | None, str | None]]] = field(default_factory=dict)
    speeds: list[dict[str, Any]] = field(default_factory=list)
    kernels: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    patches: dict[str, dict[str, str]] = field(default_factory=dict)
    versions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Made:
    index: Path
    # Per repository: how many runs and images were read, and the runs that could not be.
    counts: list[dict[str, Any]]


def make(registry: Registry, repositories: Sequence[str], dest: Path, cache: Path, nights: int = NIGHTS) -> Made:
    """Read each repository's history and write the site; a registry that fails past its retries
    stops it with the site at ``dest`` as it was (``PublishError`` saying so)."""
    check_destination(dest)  # before any read: a folder it must not replace is refused at once
    try:
        histories = [history.read(registry, repository, cache, nights) for repository in repositories]
        index = write(histories, registry, dest, cache, nights)
    except PublishError as exc:
        kept = f"{dest} is as it was" if dest.exists() else f"no site at {dest}"
        raise PublishError(f"{exc}. report: nothing written; {kept}", unreachable=exc.unreachable) from None
    counts = [
        {"repository": h.repository, "runs": len(h.runs), "images": len(h.images), "unreadable": sorted(h.problems)}
        for h in histories
    ]
    return Made(index=index, counts=counts)


def check_destination(dest: Path) -> Path:
    """``dest``, absolute, where a site may be written: a folder that does not exist, an empty one, or a
    site written before (its ``MARK``). Anything else would be replaced whole: refused."""
    dest = dest.resolve()
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / MARK).is_file())):
        raise ConfigError(
            f"--site {dest}: exists and is not a site sparkbuild report wrote (no {MARK} in it), and the report "
            "replaces its folder whole; name a new or empty folder"
        )
    return dest


def write(histories: Sequence[History], registry: Registry, dest: Path, cache: Path, nights: int = NIGHTS) -> Path:
    """The site for ``histories`` at ``dest`` (replaced whole); its index page."""
    dest = check_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.with_name(f".{dest.name}-new-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)  # a run killed before it moved its site in
    work.mkdir()
    try:
        pages = [_page(h, registry, work, cache, nights) for h in histories]
        env = _templates()
        generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        index = env.get_template("report-index.html.j2").render(pages=pages, generated=generated, short=_short)
        fsutil.write_text(work / "index.html", index)
        fsutil.write_text(work / MARK, "written by sparkbuild report; the next report replaces this folder whole\n")
        for history in histories:
            for image in history.images.values():
                _image_page(env, history, image, work)
        _readable(work)
        _swap(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info(f"report: {dest / 'index.html'}")
    return dest / "index.html"


def _readable(site: Path) -> None:
    """Every file readable by all, every folder listable: a web server reads the site as another user, and
    the files were made private (fsutil writes through mkstemp, whose files are 0600)."""
    site.chmod(0o755)
    for path in site.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _swap(work: Path, dest: Path) -> None:
    """Move the new site into place: the old one out first, then removed (two renames, no copy)."""
    old = dest.with_name(f".{dest.name}-old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    work.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(resource("")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _short(digest: str | None) -> str:
    return digest.split(":", 1)[-1][:12] if digest else "(none)"


def image_href(digest: str) -> str:
    return f"images/{digest.replace(':', '-')}.html"


# --- the index ------------------------------------------------------------------------------------


def _page(history: History, registry: Registry, site: Path, cache: Path, nights: int) -> Page:
    page = Page(history=history, nights=history.nights[:nights])
    for target in history.targets:
        cells = history.of_target(target)
        page.grid[target] = {c.night: _cell(history, c, registry, site, cache) for c in cells if c.night in page.nights}
        page.pulls[target] = [
            (tag, _short(at), history.night_of(at) if at else None, image_href(at) if at in history.images else None)
            for tag, at in history.pointers.get(target, {}).items()
        ]
        page.speeds += _speeds(history, target, cells, site, cache, set(page.nights))
        page.kernels[target] = list(_kernel_changes(cells))
    page.patches, page.versions = _patches(history)
    return page


def _cell(history: History, cell: Cell, registry: Registry, site: Path, cache: Path) -> CellView:
    row = cell.row
    state = cell.state
    if state == "failed":
        label = f"failed at {row.get('failed_at') or '?'}"
    elif state == "held back":
        label = "held back by the speed gate: " + ", ".join(f"check {c}" for c in row["held"])
    elif state == "slower":
        label = "published, slower"
    else:
        label = str(row.get("status"))
    image = history.images.get(cell.digest or "")
    detail = str(row.get("error") or row.get("verify") or "")
    if image is not None and image.problem:
        detail = f"documents: {image.problem}"
    logs = tuple(_log(history, cell, name, digest, registry, site, cache) for name, digest in sorted(cell.logs.items()))
    href = image_href(image.digest) if image is not None else None
    return CellView(state=state, label=label, detail=detail, image=href, logs=logs)


def _log(history: History, cell: Cell, name: str, digest: str, registry: Registry, site: Path, cache: Path) -> tuple[str, str]:
    """The log copied into the site (as .txt, which a browser shows rather than downloads)."""
    relative = f"logs/{cell.run}/{cell.target}/{name}.txt"
    fsutil.write_bytes(site / relative, log_text(registry, history.repository, cache, digest))
    return name, relative


def _speeds(
    history: History, target: str, cells: list[Cell], site: Path, cache: Path, nights: set[str]
) -> Iterator[dict[str, Any]]:
    """Each benchmarked check's plot (every night) and the table under it (the nights the grid shows)."""
    for check in plots.checks_measured(cells):
        found = plots.points(cells, check)
        name = f"plots/{plots.slug(history.repository)}-{plots.slug(target)}-{plots.slug(check)}.svg"
        plots.draw(found, site / name, title=f"{target} ({check})", cache=cache / "report" / "plots")
        yield {
            "target": target,
            "check": check,
            "plot": name,
            "points": [p for p in found if p.night in nights],
            "id": f"{target}-{check}",
        }


def _kernel_changes(cells: list[Cell]) -> Iterator[dict[str, str]]:
    """Each night a check's kernel path differed from the night before it (the first night too)."""
    last: dict[tuple[str, str], str] = {}
    for cell in cells:
        for check in cell.row.get("checks") or ():
            for kernel in check.get("kernels") or ():
                key = (str(check["check"]), str(kernel["kind"]))
                chosen = "/".join(kernel.get("backends") or ()) or "not logged"
                if last.get(key) != chosen:
                    was = last.get(key)
                    yield {"night": cell.night, "check": key[0], "kind": key[1], "chosen": chosen, "was": was or ""}
                    last[key] = chosen


def _patches(history: History) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Each patch's newest status per vLLM version (an rc's version marked so), and those versions."""
    status: dict[str, dict[str, str]] = {}
    order: dict[str, str] = {}
    for run in history.runs:
        for row in run.rows:
            version = f"{row.get('vllm')}{' (rc)' if run.lane == 'rc' else ''}"
            order.setdefault(version, run.started)
            for patch, said in (row.get("patches") or {}).items():
                status.setdefault(patch, {})[version] = str(said)
    return status, sorted(order, key=lambda v: order[v])


# --- a page per image ------------------------------------------------------------------------------


def _image_page(env: jinja2.Environment, history: History, image: Image, site: Path) -> None:
    previous = _previous(history, image)
    packages = _packages(image.report)
    diff = _diff(_packages(previous.report) if previous else None, packages)
    text = inspection.text(image.report) if image.report else ""
    page = env.get_template("report-image.html.j2").render(
        history=history,
        image=image,
        inspect=text,
        checks=(image.report or {}).get("verify") or [],
        packages=packages,
        previous=previous,
        diff=diff,
        short=_short,
        href=lambda digest: "../" + image_href(digest),
    )
    fsutil.write_text(site / image_href(image.digest), page)


def _previous(history: History, image: Image) -> Image | None:
    """The image of the same target on the night before this one's that published another digest."""
    earlier = [c for c in history.of_target(image.target) if c.night < image.night and c.digest and c.digest != image.digest]
    for cell in reversed(earlier):
        found = history.images.get(cell.digest or "")
        if found is not None and found.report is not None:
            return found
    return None


def _packages(report: dict[str, Any] | None) -> dict[str, str] | None:
    document = ((report or {}).get("sbom") or {}).get("document")
    if not document:
        return None
    return {str(c.get("name")): str(c.get("version", "")) for c in document.get("components") or ()}


def _diff(before: dict[str, str] | None, after: dict[str, str] | None) -> dict[str, list[str]] | None:
    if before is None or after is None:
        return None
    return {
        "added": [f"{n} {after[n]}" for n in sorted(after.keys() - before.keys())],
        "removed": [f"{n} {before[n]}" for n in sorted(before.keys() - after.keys())],
        "changed": [f"{n} {before[n]} -> {after[n]}" for n in sorted(after.keys() & before.keys()) if after[n] != before[n]],
    }
