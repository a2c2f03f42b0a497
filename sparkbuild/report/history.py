"""A repository's history, read from its registry: its runs (``sparkbuild.publish.runrecord``), where
each readable tag points now, and the documents attached to the images of the newest nights.

The registry is the only store. What is read by digest (a run's manifest and run.json, a document's
manifest and blob, a log) never changes, so it is kept under the cache by digest and read from the
registry once; a run's tag is written once, so the digest it names is kept too. A second report reads
the tag list, the readable tags, each shown image's referrers, and what is new.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbuild.errors import PublishError
from sparkbuild.oci.registry import MANIFEST_TYPES, Registry
from sparkbuild.publish import inspection, publish, runrecord
from sparkbuild.util import fsutil, log

# How many nights the grid shows, and how many nights' images get a page (the plots cover them all).
NIGHTS = 30
# Reads in flight at once: the registry answers each small read in milliseconds, so the time goes
# in waiting, not in work.
READERS = 8
# The rows' statuses whose cell reads failed (the lane's Status values).
FAILED = ("failed", "interrupted", "not run")


@dataclass(frozen=True)
class CachedRegistry(Registry):
    """A registry whose manifests and blobs read by digest are kept under ``store`` (content never
    changes under a digest, and each is checked against it when first read)."""

    store: Path = Path()

    def manifest(self, repository: str, digest: str) -> tuple[bytes, str]:
        path = self._manifest_path(digest)
        if path.is_file():
            body = path.read_bytes()
            return body, str(json.loads(body).get("mediaType") or MANIFEST_TYPES[-1])
        body, media_type = super().manifest(repository, digest)
        self.keep_manifest(digest, body)
        return body, media_type

    def keep_manifest(self, digest: str, body: bytes) -> None:
        """Keep a manifest read by other means (``tagged``), under the digest of its bytes."""
        fsutil.write_bytes(self._manifest_path(digest), body)

    def _manifest_path(self, digest: str) -> Path:
        return self.store / "manifests" / digest.replace(":", "-")

    def blob(self, repository: str, digest: str) -> bytes:
        path = self.store / "blobs" / digest.replace(":", "-")
        if path.is_file():
            return path.read_bytes()
        data = super().blob(repository, digest)
        fsutil.write_bytes(path, data)
        return data


def cached(registry: Registry, store: Path) -> CachedRegistry:
    kept = {f.name: getattr(registry, f.name) for f in dataclasses.fields(registry)}
    return CachedRegistry(**kept, store=store)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One target on one night: the newest run of that night that named it."""

    night: str
    target: str
    run: str
    row: dict[str, Any]
    # Each log kept for it (``error.log``, ``checks/<check>/server.log``) -> its digest in the registry.
    logs: dict[str, str]

    @property
    def state(self) -> str:
        """published, held back, slower (published with a regressed speed), or failed."""
        status = str(self.row.get("status"))
        if status in FAILED:
            return "failed"
        if self.row.get("held"):
            return "held back"
        return "slower" if status == "regressed" else "published"

    @property
    def digest(self) -> str | None:
        return self.row.get("digest") or None


@dataclass
class Image:
    """What ``inspect`` reads of one published digest, or why it could not."""

    digest: str
    target: str
    night: str
    report: dict[str, Any] | None = None
    problem: str | None = None


@dataclass
class History:
    """Everything the page shows of one repository."""

    registry: str
    repository: str
    # Oldest first.
    runs: list[runrecord.Run] = field(default_factory=list)
    # A run tag that could not be read -> why (its night's column says so).
    problems: dict[str, str] = field(default_factory=dict)
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    # By target: each readable tag (and its last-good tag) -> the digest it points at now.
    pointers: dict[str, dict[str, str | None]] = field(default_factory=dict)
    images: dict[str, Image] = field(default_factory=dict)

    @property
    def nights(self) -> list[str]:
        return sorted({night for night, _ in self.cells}, reverse=True)

    @property
    def targets(self) -> list[str]:
        return sorted({target for _, target in self.cells})

    def of_target(self, target: str) -> list[Cell]:
        """A target's cells, oldest night first."""
        return sorted((c for (_, t), c in self.cells.items() if t == target), key=lambda c: c.night)

    def night_of(self, digest: str) -> str | None:
        """The first night that published ``digest``."""
        found = sorted(c.night for c in self.cells.values() if c.digest == digest)
        return found[0] if found else None


def read(registry: Registry, repository: str, cache: Path, nights: int = NIGHTS) -> History:
    """``repository``'s history from ``registry``; documents read by digest come from ``cache`` when
    read before. A registry that fails (after its retries) raises ``PublishError``; a malformed run
    or document is that run's or that image's problem, said on the page."""
    reg = cached(registry, cache / "report")
    history = History(registry=registry.host, repository=repository)
    tags = sorted(t for t in registry.tags(repository) if runrecord.is_run_tag(t))
    # Many small reads, each waiting on the registry: a few at once (each call is its own request).
    with ThreadPoolExecutor(READERS) as pool:
        for tag, found in zip(tags, pool.map(lambda tag: _read_run(reg, repository, tag), tags), strict=True):
            if isinstance(found, runrecord.Run):
                history.runs.append(found)
            elif found is not None:
                history.problems[tag] = found
    history.runs.sort(key=lambda r: r.started)
    for run in history.runs:  # a later run of a night wins its cells
        for row in run.rows:
            cell = Cell(night=run.night, target=row["target"], run=run.tag, row=row, logs=run.logs.get(row["target"], {}))
            history.cells[(run.night, cell.target)] = cell
    history.pointers = {target: _pointers(registry, repository, history, target) for target in history.targets}
    shown = {cell.digest: cell for cell in _newest(history, nights) if cell.digest is not None}
    with ThreadPoolExecutor(READERS) as pool:
        history.images = dict(zip(shown, pool.map(lambda cell: _image(reg, repository, cell), shown.values()), strict=True))
    log.info(f"{registry.host}/{repository}: {len(history.runs)} run(s), {len(history.images)} image(s) read")
    return history


def _read_run(registry: CachedRegistry, repository: str, tag: str) -> runrecord.Run | str | None:
    """The run ``tag`` names; why it cannot be read; or None where the tag went since the listing."""
    where = f"{registry.host}/{repository}:{tag}"
    try:
        body = _run_manifest(registry, repository, tag)
        if body is None:
            return None  # removed between the listing and now (retention)
        first = runrecord.manifest_layers(body, where)[0]
        return runrecord.parse(tag, registry.blob(repository, str(first["digest"])), where)
    except PublishError as exc:
        if exc.unreachable:
            raise  # the registry itself failed: no page from half a history
        return str(exc)  # this run's own manifest or run.json: missing or malformed


def _run_manifest(registry: CachedRegistry, repository: str, tag: str) -> bytes | None:
    """The manifest a run's tag names. A run's tag is written once (its name holds the run's start to
    the microsecond) and never moved, so the digest it named is kept with the manifest: a second report
    asks the registry only for new runs."""
    kept = registry.store / "runs" / registry.host.replace(":", "_") / repository / tag
    if kept.is_file():
        return registry.manifest(repository, kept.read_text())[0]
    found = registry.tagged(repository, tag)
    if found is None:
        return None
    digest, body = found
    registry.keep_manifest(digest, body)
    fsutil.write_text(kept, digest)
    return body


def _pointers(registry: Registry, repository: str, history: History, target: str) -> dict[str, str | None]:
    newest = history.of_target(target)[-1]
    tags = [*newest.row.get("tags", ()), publish.last_good_tag(target)]
    return {tag: registry.digest(repository, tag) for tag in tags}


def _newest(history: History, nights: int) -> Iterator[Cell]:
    shown = set(history.nights[:nights])
    for target in history.targets:
        cells = history.of_target(target)
        # The night before the first shown too: its SBOM is what the first shown one is compared with.
        for i, cell in enumerate(cells):
            if cell.night in shown or (i + 1 < len(cells) and cells[i + 1].night in shown):
                yield cell


def _image(registry: Registry, repository: str, cell: Cell) -> Image:
    assert cell.digest is not None
    image = Image(digest=cell.digest, target=cell.target, night=cell.night)
    try:
        image.report = inspection.inspect(registry, repository, cell.digest)
    except PublishError as exc:
        if exc.unreachable:
            raise
        image.problem = str(exc)  # a document missing or malformed: this image's page says so
    except ValueError as exc:
        image.problem = f"a document is not JSON: {exc}"
    return image


def log_text(registry: Registry, repository: str, cache: Path, digest: str) -> bytes:
    """A kept log, by digest."""
    return cached(registry, cache / "report").blob(repository, digest)
