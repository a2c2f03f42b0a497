"""The patch set on every vLLM release: which releases there are, their trees, and the sweep.

Releases come from PyPI's simple index (every version from ``SINCE`` with an sdist or wheels).
A release's tree for the sweep keeps only what the patches read (their rules' ``READS``, diff and
detect files) plus ``KEEP``: the whole sdist is downloaded and checked against the index's sha256
once, the slice is unpacked under ``$SPARKBUILD_CACHE/patch-trees/``, and the archive is dropped.
An unpacked full sdist (``sparkbuild patch check --vllm-version``) is used where there is one.

The checks run in worker processes, one release each: a check is pure CPU (reading and parsing a
tree), so threads would share one core.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

from builder import log, sources
from builder.patch import diff, engine, meta, rules
from builder.patch.overlay import Status

# The sweep starts here: the oldest release any patch's range reaches.
SINCE = Version("0.10.0")
TREES = "patch-trees"
STAMP = ".sparkbuild-slice.json"
# Beside what the rules read: the version (PKG-INFO), the pins (requirements/, the FlashInfer a
# version's sink calls are checked against), all of csrc/ (the compile tests need the headers
# around each patched file), and setup.py (the plan runs its get_requirements and compute_num_jobs).
KEEP = ("PKG-INFO", "requirements/**", "csrc/**", "setup.py")


@dataclass(frozen=True)
class Release:
    version: str
    sdist: sources.IndexLink | None  # None: wheels only, no source to patch


@dataclass(frozen=True)
class Row:
    """One release (or the candidate): each patch's status and detail."""

    version: str
    label: str  # where the tree came from: "sdist", or the candidate's tag and commit
    results: tuple[engine.Result, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source": self.label,
            "results": {r.patch: {"status": r.status, "detail": r.detail} for r in self.results},
        }


def releases(through: Version | None = None, links: dict[str, sources.IndexLink] | None = None) -> tuple[Release, ...]:
    """Every final release from SINCE (up to ``through``), oldest first."""
    links = sources.index_links("vllm") if links is None else links
    found = []
    for version, kinds in sources.release_files(links).items():
        if version < SINCE or version.is_prerelease or version.is_devrelease or (through is not None and version > through):
            continue
        sdist = links.get(f"vllm-{version}.tar.gz") if "sdist" in kinds else None
        found.append(Release(str(version), sdist))
    return tuple(sorted(found, key=lambda r: Version(r.version)))


def reads(patches: Iterable[meta.Patch]) -> tuple[str, ...]:
    """The tree paths (globs) the patches read, and KEEP."""
    found = set(KEEP)
    for p in patches:
        found |= {d.file for d in p.detect}
        if p.rule is not None:
            found |= set(rules.load(p.rule).reads)
        if p.diff is not None:
            found |= set(diff.files_of(p.diff))
    return tuple(sorted(found))


def tree(
    version: str,
    cache: Path,
    patterns: tuple[str, ...],
    link: sources.IndexLink | None = None,
    full_ok: bool = True,
    folder: str = TREES,
) -> Path:
    """The release's tree: a full unpacked sdist if there is one (and ``full_ok``), else the slice of
    ``patterns`` (downloaded once, from ``link`` or the index's link for ``version``) kept under
    ``cache/folder`` (each reader of other files its own folder, so none re-slices another's)."""
    full = cache / "sources" / f"vllm-{version}"
    if full_ok and (full / ".sparkbuild-unpacked").is_file():
        return full
    slice_ = cache / folder / f"vllm-{version}"
    stamp = slice_ / STAMP
    if stamp.is_file() and set(patterns) <= set(json.loads(stamp.read_text(encoding="utf-8"))["patterns"]):
        return slice_
    link = link or sources.sdist_link(version)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        archive = sources.fetch(link, Path(tmp))
        count = sources.unpack_matching(archive, slice_, f"vllm-{version}", patterns)
    record = {"sdist": link.filename, "sha256": link.sha256, "patterns": list(patterns), "files": count}
    stamp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return slice_


def trees(
    found: Sequence[Release], cache: Path, patterns: tuple[str, ...], full_ok: bool = True, folder: str = TREES
) -> dict[str, Path]:
    """Every release's tree that has an sdist; downloads four at a time (network-bound)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = {
            r.version: pool.submit(tree, r.version, cache, patterns, r.sdist, full_ok, folder)
            for r in found
            if r.sdist is not None
        }
        return {version: future.result() for version, future in done.items()}


# --- the sweep -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    version: str
    tree: Path
    label: str


def sweep(found: Mapping[str, Path], names: tuple[str, ...] | None, jobs: Sequence[Job], workers: int | None = None) -> list[Row]:
    """Each job's check, in its order; in ``workers`` processes (default: one per core)."""
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers <= 1:
        patches = meta.load(found, names)
        return [_row(patches, job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers, initializer=_load_patches, initargs=(dict(found), names)) as pool:
        return list(pool.map(_worker_row, jobs))


_PATCHES: tuple[meta.Patch, ...] = ()


def _load_patches(found: Mapping[str, Path], names: tuple[str, ...] | None) -> None:
    global _PATCHES  # loaded once per worker process, not once per release
    _PATCHES = meta.load(found, names)


def _worker_row(job: Job) -> Row:
    return _row(_PATCHES, job)


def _row(patches: tuple[meta.Patch, ...], job: Job) -> Row:
    return Row(job.version, job.label, engine.check(job.tree, patches, job.version).results)


def candidate_job(url: str, cache: Path) -> Job | None:
    """The newest release candidate of the git remote ``url``, checked out in the cache; None if
    the remote has no candidate newer than its newest release."""
    from builder import gitrepo  # gitpython: only for a candidate

    candidate = gitrepo.newest_candidate(gitrepo.ls_remote(url))
    if candidate is None:
        log.info(f"{url} has no release candidate newer than its newest release")
        return None
    mirror = gitrepo.Mirror(cache, url)
    checkout = mirror.checkout(candidate.commit, cache / TREES / f"candidate-{mirror.path.stem}")
    return Job(candidate.version, checkout, f"{candidate.tag} {candidate.commit[:12]}")


# --- what the sweep says ------------------------------------------------------------------------


def first_upstream(rows: Sequence[Row]) -> dict[str, str | None]:
    """Per patch, the first release (oldest first) at which it reads ``upstream``."""
    firsts: dict[str, str | None] = {}
    for row in rows:
        for r in row.results:
            firsts.setdefault(r.patch, None)
            if r.status == "upstream" and firsts[r.patch] is None:
                firsts[r.patch] = row.version
    return firsts


_SHORT: dict[Status, str] = {
    "applies": "applies",
    "applied": "applied",
    "upstream": "upstream",
    "not-applicable": "n/a",
    "conflict": "CONFLICT",
}


def text_table(rows: Sequence[Row], wheels_only: Sequence[str]) -> str:
    """One line per release, oldest first (wheel-only ones in their place, a candidate last);
    "n/a" is not-applicable (``--json`` has every detail)."""
    names = [r.patch for r in rows[0].results] if rows else []
    width = max([len(r.version) for r in rows] + [len(v) for v in wheels_only] + [7])
    lines: list[tuple[Version, int, str]] = []
    for i, row in enumerate(rows):
        cells = "  ".join(_SHORT[r.status].ljust(max(len(r.patch), 8)) for r in row.results)
        extra = f"  ({row.label})" if row.label != "sdist" else ""
        lines.append((Version(row.version), i, f"{row.version.ljust(width)}  {cells}{extra}".rstrip()))
    lines += [(Version(v), -1, f"{v.ljust(width)}  wheels only on PyPI: no sdist to check") for v in wheels_only]
    head = "release".ljust(width) + "  " + "  ".join(n.ljust(max(len(n), 8)) for n in names)
    firsts = first_upstream([r for r in rows if r.label == "sdist"])
    tail = "first upstream: " + ", ".join(f"{n} {v or 'never'}" for n, v in firsts.items())
    return "\n".join([head, *(text for _, _, text in sorted(lines)), tail])


def markdown_table(rows: Sequence[Row], wheels_only: Sequence[str]) -> str:
    """Releases next to each other with the same statuses share a line (``0.12.0 - 0.14.1``); a
    wheel-only release gets its own: the README's table."""
    names = [r.patch for r in rows[0].results] if rows else []
    items: list[tuple[Version, str, tuple[Status, ...]]] = [
        (Version(r.version), r.version, tuple(x.status for x in r.results)) for r in rows
    ]
    items += [(Version(v), v, ()) for v in wheels_only]
    groups: list[tuple[list[str], tuple[Status, ...]]] = []
    for _, version, statuses in sorted(items):
        if groups and groups[-1][1] == statuses:
            groups[-1][0].append(version)
        else:
            groups.append(([version], statuses))
    lines = ["| vLLM | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for versions, statuses in groups:
        span = versions[0] if len(versions) == 1 else f"{versions[0]} - {versions[-1]}"
        cells: tuple[str, ...] = statuses or tuple("wheels only, no sdist" for _ in names)
        lines.append(f"| {span} | " + " | ".join(cells) + " |")
    firsts = first_upstream([r for r in rows if r.label == "sdist"])
    said = "; ".join(f"`{n}` {v or 'none yet'}" for n, v in firsts.items())
    return "\n".join([*lines, "", f"First release that reads `upstream`: {said}."])


def to_json(rows: Sequence[Row], wheels_only: Sequence[str]) -> dict[str, Any]:
    return {
        "releases": [r.to_json() for r in rows],
        "wheels_only": list(wheels_only),
        "first_upstream": first_upstream([r for r in rows if r.label == "sdist"]),
        "ok": all(r.status != "conflict" for row in rows for r in row.results),
    }
