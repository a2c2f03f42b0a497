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
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

from sparkbuild.patch import diff, engine, meta, need, pullrequest, rules
from sparkbuild.patch.overlay import Status
from sparkbuild.upstream import sources
from sparkbuild.util import fsutil, log, runlock

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
    """One release (or the candidate): each patch's status and detail, and whether each build needs it."""

    version: str
    label: str  # where the tree came from: "sdist", or the candidate's tag and commit
    results: tuple[engine.Result, ...]
    builds: tuple[need.Build, ...] = ()
    needs: tuple[tuple[need.Need, ...], ...] = ()  # per result, per build

    def to_json(self) -> dict[str, Any]:
        results: dict[str, Any] = {}
        for i, r in enumerate(self.results):
            results[r.patch] = {"status": r.status, "detail": r.detail}
            if self.needs:
                results[r.patch]["needed"] = {b.cuda: n.to_json() for b, n in zip(self.builds, self.needs[i], strict=True)}
        return {"version": self.version, "source": self.label, "results": results}


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
        found |= {a.file for a in p.alternatives}
        if p.rule is not None:
            found |= set(rules.load(p.rule).reads)
        if p.diff is not None:
            found |= set(diff.files_of(p.diff))
        if p.pr is not None:
            found |= set(pullrequest.files(p.folder, p.pr))
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
    if _holds(slice_, patterns):
        return slice_
    # Two runs on one cache (a patch table beside a nightly, the suite's two workers) make a slice once:
    # the second waits, then finds it made.
    with runlock.hold(slice_.parent / f".vllm-{version}.lock", f"the source slice {slice_}"):
        if _holds(slice_, patterns):
            return slice_
        # A slice only grows: what it held stays, so callers that read less never narrow it for the others.
        patterns = tuple(sorted(set(patterns) | set(_held(slice_))))
        link = link or sources.sdist_link(version)
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
            archive = sources.fetch(link, Path(tmp))
            count = sources.unpack_matching(archive, slice_, f"vllm-{version}", patterns)
        record = {"sdist": link.filename, "sha256": link.sha256, "patterns": list(patterns), "files": count}
        (slice_ / STAMP).write_text(json.dumps(record) + "\n", encoding="utf-8")
    return slice_


def _held(slice_: Path) -> tuple[str, ...]:
    """The patterns a slice was unpacked with (none where it was never made)."""
    stamp = slice_ / STAMP
    return tuple(json.loads(stamp.read_text(encoding="utf-8"))["patterns"]) if stamp.is_file() else ()


def _holds(slice_: Path, patterns: tuple[str, ...]) -> bool:
    held = _held(slice_)
    return bool(held) and all(covered(p, held) for p in patterns)


def covered(pattern: str, held: tuple[str, ...]) -> bool:
    """Whether a slice unpacked with the patterns ``held`` has every file ``pattern`` names: it is
    one of them, or a plain path (no wildcard) one of them matches."""
    if pattern in held:
        return True
    return not any(c in pattern for c in "*?[") and any(re.fullmatch(fsutil.glob_regex(h), pattern) for h in held)


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
    builds: tuple[need.Build, ...] = ()  # judge each patch's need for these builds too


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
    results = engine.check(job.tree, patches, job.version).results
    by_name = {p.name: p for p in patches}
    needs = tuple(tuple(need.judge(by_name[r.patch], r.status, r.detail, job.tree, b) for b in job.builds) for r in results)
    return Row(job.version, job.label, results, job.builds, needs if job.builds else ())


def candidate_job(url: str, cache: Path) -> Job | None:
    """The newest release candidate of the git remote ``url``, checked out in the cache; None if
    the remote has no candidate newer than its newest release."""
    from sparkbuild.upstream import gitrepo  # gitpython: only for a candidate

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
    data: dict[str, Any] = {
        "releases": [r.to_json() for r in rows],
        "wheels_only": list(wheels_only),
        "first_upstream": first_upstream([r for r in rows if r.label == "sdist"]),
        "ok": all(r.status != "conflict" for row in rows for r in row.results),
    }
    sdists = [r for r in rows if r.label == "sdist"]
    if sdists and sdists[0].builds:
        data["needed_on"] = {
            name: {b.cuda: [list(span) for span in spans] for b, spans in per_build.items()}
            for name, per_build in needed_spans(sdists).items()
        }
    return data


# --- whether each patch is still needed ----------------------------------------------------------


def need_cell(status: Status, needs: Sequence[need.Need], builds: Sequence[need.Build]) -> str:
    """A status and, where the patch would change the tree, which builds need it."""
    if status in ("upstream", "not-applicable") or not builds:
        return status
    wanted = [b.cuda for b, n in zip(builds, needs, strict=True) if n.needed]
    if len(wanted) == len(builds):
        return f"{status}, needed"
    if wanted:
        return f"{status}, needed on CUDA {', '.join(wanted)}"
    return f"{status}, not needed"


def needed_spans(rows: Sequence[Row]) -> dict[str, dict[need.Build, list[tuple[str, str]]]]:
    """Per patch and build, the runs of consecutive releases (first, last) that need the patch."""
    spans: dict[str, dict[need.Build, list[tuple[str, str]]]] = {}
    for name_index, name in enumerate([r.patch for r in rows[0].results] if rows else []):
        spans[name] = {}
        for b_index, b in enumerate(rows[0].builds):
            runs: list[tuple[str, str]] = []
            previous = False
            for row in rows:
                now = row.needs[name_index][b_index].needed
                if now and previous:
                    runs[-1] = (runs[-1][0], row.version)
                elif now:
                    runs.append((row.version, row.version))
                previous = now
            spans[name][b] = runs
    return spans


def needed_markdown(rows: Sequence[Row], wheels_only: Sequence[str]) -> str:
    """The support table with need: each cell the status and the builds that need the patch
    (releases next to each other with equal cells share a line), then, per patch and build, the
    releases that need it and why the newest does or does not."""
    names = [r.patch for r in rows[0].results] if rows else []
    builds = rows[0].builds if rows else ()
    items: list[tuple[Version, str, tuple[str, ...]]] = [
        (Version(r.version), r.version, tuple(need_cell(x.status, r.needs[i], builds) for i, x in enumerate(r.results)))
        for r in rows
    ]
    items += [(Version(v), v, ()) for v in wheels_only]
    groups: list[tuple[list[str], tuple[str, ...]]] = []
    for _, version, cells in sorted(items):
        if groups and groups[-1][1] == cells:
            groups[-1][0].append(version)
        else:
            groups.append(([version], cells))
    lines = ["| vLLM | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for versions, cells in groups:
        span = versions[0] if len(versions) == 1 else f"{versions[0]} - {versions[-1]}"
        lines.append(f"| {span} | " + " | ".join(cells or tuple("wheels only, no sdist" for _ in names)) + " |")
    said = "; ".join(f"TORCH_CUDA_ARCH_LIST={b.arch_list} and CUDA {b.cuda}" for b in builds)
    lines += ["", f"Whether a build needs the patch: {said}." if builds else ""]
    newest = rows[-1] if rows else None
    for i, (name, per_build) in enumerate(needed_spans(rows).items()):
        lines += ["", f"`{name}`:"]
        for j, (b, runs) in enumerate(per_build.items()):
            where = ", ".join(first if first == last else f"{first} - {last}" for first, last in runs) or "no release"
            assert newest is not None
            latest = newest.needs[i][j]
            verdict = "needed" if latest.needed else "not needed"
            lines.append(f"- CUDA {b.cuda}: needed on {where}; on {newest.version} {verdict}: {latest.why}")
    return "\n".join(lines)
