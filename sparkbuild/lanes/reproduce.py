"""``sparkbuild reproduce``: build a target twice without cache and compare what the two builds made.

Each build makes every stage anew (``build.Apart``): BuildKit's layer cache off (``--no-cache``, under
which every cache mount, pip's, apt's and ccache's, is a new empty one), each stage under a tag of its
own (``sparkbuild/reproduce:<target>-<random>-<n>-<stage>``; the content tag is neither made nor
moved), a later stage FROM that build's earlier ones, every RUN step with a host name of the build's
own (so BuildKit cannot give both builds one run of a step). What is not rebuilt is said in the
report: the bases (made once by content, inputs like the sources).

Then, stage by stage, both images' file systems are streamed (``docker export``, never written to
disk) into inventories and compared (``sparkbuild.build.compare``): every path (type, mode, owner,
size, sha256, link target; a difference of mtime alone is counted apart), every wheel under /wheels
member by member with each ELF member's defined dynamic symbols, the installed packages (Python
distributions with their RECORD hashes, Debian packages), and the image's configuration. A file whose
content differs is copied out of both images to find why (a .pyc's header, a date in it, an ELF
file's symbols or sections). The findings go to ``sparkbuild-out/<target>/reproduce.json``; the two
builds' images are removed at the end unless ``keep``.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from sparkbuild.build import build, compare, inventory
from sparkbuild.config.options import Options
from sparkbuild.errors import BuildError, ConfigError, EngineError, FatalError
from sparkbuild.lanes import disk, doctor, rehearse
from sparkbuild.oci.engine import CONTAINER_PATHS, Engine
from sparkbuild.plan import base_recipe, plan
from sparkbuild.plan.matrix import Matrix, Target
from sparkbuild.plan.plan import StagePlan, TargetPlan
from sparkbuild.upstream import gitrepo
from sparkbuild.util import log, runlock

REPOSITORY = "sparkbuild/reproduce"
# A file that differs is copied out of both images to find why, up to this size; above it, its
# cause stays "content" and the report says it was not read.
READ_LIMIT = 256 << 20
# At most this many differing files of a stage are copied out to find why (each a request to the
# engine); the others keep the cause their entries tell, and say so.
READ_FILES = 1000
# What the report samples of the paths that differ in mtime alone (they are counted in full).
MTIME_SAMPLE = 50
Mode = Literal["build", "rehearsal"]

# What each cache mount of sparkbuild's templates holds. Under --no-cache BuildKit gives each build a
# new, empty one (BuildKit since 2019, moby/buildkit#2447 and #4250); the mounts of normal builds stay.
CACHE_MOUNTS = {
    "/root/.cache/pip": "pip's downloads (each pinned, or checked by hash) and the wheels it builds from sdists",
    "/var/cache/apt": "apt's downloaded packages",
    "/var/lib/apt/lists": "apt's package index",
    "/root/.cache/ccache": "ccache's objects",
}
_CACHE_MOUNT = re.compile(r"--mount=type=cache,target=([^\s,\\]+)")


@dataclass(kw_only=True)
class StageFindings:
    """One stage's two images compared."""

    stage: str
    images: tuple[str, str]
    files: compare.Files
    wheels: compare.Wheels
    packages: compare.Packages
    config: dict[str, dict[str, Any]]

    @property
    def matches(self) -> bool:
        return self.files.matches and self.wheels.matches and self.packages.matches and not self.config

    def to_json(self) -> dict[str, Any]:
        files = self.files.to_json()
        files["mtime_only"]["paths"] = files["mtime_only"]["paths"][:MTIME_SAMPLE]
        return {
            "stage": self.stage,
            "matches": self.matches,
            "images": list(self.images),
            "files": files,
            "wheels": self.wheels.to_json(),
            "packages": self.packages.to_json(),
            "config": self.config,
        }

    def lines(self) -> list[str]:
        lines = [f"stage {self.stage}: {'the same' if self.matches else 'DIFFERS'}"]
        lines += ["  files: " + self.files.lines()[0], *("  " + line for line in self.files.lines()[1:])]
        if self.wheels.wheels or self.wheels.differences:
            lines += ["  wheels:", *("    " + line for line in self.wheels.lines())]
        lines += ["  packages: " + self.packages.lines()[0], *("  " + line for line in self.packages.lines()[1:])]
        config = ", ".join(self.config) or "the same (the time it was made and the layer digests aside)"
        lines.append(f"  configuration: {config}")
        return lines


@dataclass(kw_only=True)
class Reproduction:
    target: str
    mode: Mode
    status: str = "pending"
    builds: list[dict[str, Any]] = field(default_factory=list)
    stages: list[StageFindings] = field(default_factory=list)
    not_rebuilt: list[str] = field(default_factory=list)
    caches: list[str] = field(default_factory=list)
    # Why the builds made no wheel, where they made none.
    no_wheels: str | None = None
    swapped: list[str] = field(default_factory=list)
    # The stages not built (--stage chose others).
    skipped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    # What BuildKit's cache grew by: the layers of both builds, which it keeps after their images go.
    cache_growth: int | None = None
    # What removing those records (their images gone; no later build can use them) reclaimed.
    cache_removed: int | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def matches(self) -> bool:
        return bool(self.stages) and all(s.matches for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "mode": self.mode,
            "status": self.status,
            "matches": self.matches,
            "builds": self.builds,
            "not_rebuilt": self.not_rebuilt,
            "cache_mounts": self.caches,
            "no_wheels": self.no_wheels,
            "swapped": self.swapped,
            "not_built": self.skipped,
            "stages": [s.to_json() for s in self.stages],
            "kept_images": self.kept,
            "build_cache_growth_bytes": self.cache_growth,
            "build_cache_removed_bytes": self.cache_removed,
            "error": self.error,
            "seconds": round(self.seconds, 1),
        }

    def _cache_fate(self) -> str:
        if self.cache_removed is not None:
            return f"removed with their images, {self.cache_removed / 1e9:.1f} GB reclaimed"
        return "kept with the images (`docker builder prune` reclaims what no image uses once they are removed)"

    def text(self) -> str:
        times = " and ".join(log.format_seconds(b["seconds"]) for b in self.builds)
        lines = [f"{self.target}: {self.status}" + (f" (two builds without cache: {times})" if times else "")]
        if self.swapped:
            lines.append("  rehearsal (the runner builds these as the matrix says): " + "; ".join(self.swapped))
        lines += [f"  not rebuilt: {line}" for line in self.not_rebuilt]
        lines += [f"  cache mount: {line}" for line in self.caches]
        if self.skipped:
            lines.append(f"  not built (--stage): {', '.join(self.skipped)}")
        if self.no_wheels:
            lines.append(f"  wheels: none built ({self.no_wheels})")
        for stage in self.stages:
            lines += ["  " + line for line in stage.lines()]
        if self.kept:
            lines.append(f"  images kept (--keep): {', '.join(self.kept)}")
        if self.cache_growth is not None:
            grew = f"{self.cache_growth / 1e9:.1f} GB"
            lines.append(f"  BuildKit's cache grew by {grew} (both builds' layers): {self._cache_fate()}")
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)


def reproduce(
    opts: Options, *, rehearsal: bool, offline_sources: bool, keep: bool, stages: tuple[str, ...] = ()
) -> list[Reproduction]:
    """Build each selected target twice without cache and compare; each writes its reproduce.json.

    With ``rehearsal``, a Spark target is built as ``sparkbuild rehearse`` builds it (with
    ``offline_sources``, from the git daemon's stand-ins); with ``stages``, only those stages and the
    earlier ones they need. A failing build stops the run with its own error."""
    m = plan.load_matrix(opts)
    mode: Mode = "rehearsal" if rehearsal else "build"
    targets: tuple[Target | TargetPlan, ...] = rehearse.rehearsable(m, opts) if rehearsal else plan.plan_lane(m, opts)
    engine = Engine()
    # Checked before any work, as `sparkbuild build` is; a rehearsal is not held to the runner's stage
    # sizes, as `sparkbuild rehearse` is not.
    if not rehearsal:
        plans = [t for t in targets if isinstance(t, TargetPlan)]
        doctor.require([p.target for p in plans], opts, registry=False, gpu=False)
        built = [(f"{p.id} {s.name}", one_build_gb(engine, p, s)) for p in plans for s in chosen(p, stages)]
        disk.check(disk.rebuilds(built, opts.cache, engine_root=disk.engine_root(engine.client.info())))
    results = []
    with ExitStack() as stack:
        stack.enter_context(runlock.run(opts.cache, wait=opts.wait))
        url = stack.enter_context(gitrepo.daemon(opts.cache / "offline")) if rehearsal and offline_sources else None
        for item in targets:
            result = Reproduction(target=item.id, mode=mode)
            results.append(result)
            with log.step(f"Reproducing {item.id}: two builds without cache"):
                try:
                    p = item if isinstance(item, TargetPlan) else _rehearsal_plan(m, item, opts, url, result)
                    _one(engine, p, opts, keep, result, chosen(p, stages))
                except FatalError as exc:
                    result.status, result.error = f"failed ({result.status})", str(exc)
                    raise
                finally:
                    write(result, opts.out / result.target)
    return results


def one_build_gb(engine: Engine, p: TargetPlan, stage: StagePlan) -> float:
    """What one build of ``stage`` writes: the disk table's figure for sparkbuild's own stages (which
    counts what building them writes, not only their image: a wheel stage's image is its wheels);
    for another stage (a team's own template), its image's size where the engine has it, else the
    table's figure for a stage it does not name."""
    if disk.named(p.target.profile, stage.name) or not engine.image_exists(stage.ref):
        return disk.stage_gb(p.target.profile, stage.name)
    return float(engine.inspect(stage.ref)["Size"]) / disk.GB


def _rehearsal_plan(m: Matrix, target: Target, opts: Options, url: str | None, result: Reproduction) -> TargetPlan:
    try:
        prepared = rehearse.prepare(m, target, opts, url)
    except rehearse.NotRehearsable as exc:
        raise BuildError(f"{target.id} cannot be rehearsed here: {exc}") from None
    result.swapped = prepared.swapped
    return rehearse.plan_of(prepared, m, opts, url)


def write(result: Reproduction, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "reproduce.json"
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    return path


def chosen(p: TargetPlan, wanted: tuple[str, ...]) -> list[StagePlan]:
    """The stages to build: those ``wanted`` (all where none is) and every earlier stage they need."""
    names = [s.name for s in p.stages]
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ConfigError(f"--stage {', '.join(unknown)}: {p.id} has no such stage; its stages: {', '.join(names)}")
    needed = set(wanted or names)
    for stage in reversed(p.stages):
        if stage.name in needed:
            needed.update(stage.rendered.needs)
    return [s for s in p.stages if s.name in needed]


def _one(engine: Engine, p: TargetPlan, opts: Options, keep: bool, result: Reproduction, stages: list[StagePlan]) -> None:
    start = time.monotonic()
    result.not_rebuilt = inputs(p)
    result.caches = caches(stages)
    result.skipped = [s.name for s in p.stages if s not in stages]
    token = secrets.token_hex(4)
    # One reading of the engine's disk usage (each walks every image and record): ids and bytes.
    found = engine.build_cache()
    records_before = {r.id for r in found}
    cache_before = sum(r.size for r in found)
    runs = [{s.name: f"{REPOSITORY}:{p.id}-{token}-{run}-{s.name}" for s in stages} for run in (1, 2)]
    try:
        for run, tags in enumerate(runs, 1):
            result.status = f"building ({run} of 2)"
            began = time.monotonic()
            apart = build.Apart(tags=tags, logs=opts.out / p.id / "reproduce" / f"build-{run}", marker=f"{token}-{run}")
            build.build_apart(engine, p, opts, apart)
            result.builds.append({"run": run, "stages": tags, "seconds": round(time.monotonic() - began, 1)})
        result.status = "comparing"
        with tempfile.TemporaryDirectory(prefix="sparkbuild-reproduce-") as scratch:
            for stage in stages:
                pair = (runs[0][stage.name], runs[1][stage.name])
                result.stages.append(compare_stage(engine, stage.name, pair, Path(scratch)))
        result.no_wheels = no_wheels(p, result.stages)
        result.cache_growth = engine.build_cache_bytes() - cache_before
        result.status = "reproduces" if result.matches else "differs"
    finally:
        result.seconds = time.monotonic() - start
        if keep:
            result.kept = [tag for tags in runs for tag in tags.values() if engine.image_exists(tag)]
        else:
            _remove(engine, [tag for tags in runs for tag in tags.values()])
            result.cache_removed = _forget(engine, records_before)


def _remove(engine: Engine, tags: list[str]) -> None:
    """Remove the builds' images; a failure on the way out is logged under the one already on its way."""
    for tag in tags:
        try:
            engine.remove_image(tag)
        except EngineError as exc:
            log.error(str(exc))


def _forget(engine: Engine, before: set[str]) -> int | None:
    """Remove the build-cache records the two builds made, once their images are gone: each RUN ran
    under a host name of its build's own, so no later build can use them, and BuildKit would keep
    them (gigabytes for a CUDA stage) until pruned. A record an image holds, or one in use, stays.
    None where the engine refused (logged: the report is on its way out)."""
    try:
        return engine.prune_build_cache(engine.made_since(before))
    except EngineError as exc:
        log.error(str(exc))
        return None


def inputs(p: TargetPlan) -> list[str]:
    """What neither build makes: each base, an input made once by content (or pinned by digest)."""
    found = dict.fromkeys(
        base_recipe.reference(b, plan.base_platform(p.target, role))[0] for role, b in plan.bases(p.target).items()
    )
    return [f"base {ref} (an input: made once by its content or pinned by digest, as the sources are)" for ref in found]


def caches(stages: list[StagePlan]) -> list[str]:
    """The cache mounts the stages use: new and empty in each build without cache, so nothing in them
    comes from an earlier build (every download fetched again, every unit compiled again)."""
    found = dict.fromkeys(m for s in stages for m in _CACHE_MOUNT.findall(s.rendered.dockerfile))
    return [f"{target} ({CACHE_MOUNTS.get(target, 'a cache mount')}): new and empty in each build" for target in found]


def no_wheels(p: TargetPlan, stages: list[StageFindings]) -> str | None:
    """Why the builds made no wheel (under /wheels of a stage), where they made none."""
    if any(s.wheels.wheels or s.wheels.differences for s in stages):
        return None
    if p.target.vllm.kind == "wheel":
        return f"no stage makes one: this target installs vLLM's published wheel ({p.target.vllm.spec})"
    return "no stage left a wheel under /wheels"


def compare_stage(engine: Engine, name: str, refs: tuple[str, str], scratch: Path) -> StageFindings:
    """Both builds' images of one stage: their file systems, wheels, packages and configuration."""
    found = []
    for ref in refs:
        with log.step(f"Reading every file of {ref}"), engine.export(ref) as stream:
            found.append(inventory.read_tar(stream, skip=CONTAINER_PATHS))
    first, second = found
    files = compare.compare_files(first, second)
    files.differences = explained(engine, refs, files.differences, scratch)
    wheels = compare.compare_wheels(first.wheels, second.wheels)
    wheels.differences = explained_members(engine, refs, wheels.differences, scratch)
    return StageFindings(
        stage=name,
        images=(str(engine.inspect(refs[0])["Id"]), str(engine.inspect(refs[1])["Id"])),
        files=files,
        wheels=wheels,
        packages=compare.compare_packages(first.packages(), second.packages()),
        config=compare.compare_config(engine.inspect(refs[0]), engine.inspect(refs[1])),
    )


def explained(
    engine: Engine, refs: tuple[str, str], differences: list[compare.Difference], scratch: Path
) -> list[compare.Difference]:
    """Each difference whose cause only the file's two copies tell, with that cause (files over
    READ_LIMIT keep theirs, and say so); the copies are removed after."""
    wanted = {d.path: d for d in differences if compare.needs_reading(d)}
    readable = [d for d in wanted.values() if max(_size(d.first), _size(d.second)) <= READ_LIMIT][:READ_FILES]
    better = {d.path: _unread(d) for d in wanted.values()}
    if readable:
        paths = ["/" + d.path for d in readable]
        copies = [engine.fetch_files(ref, paths, scratch / str(n)) for n, ref in enumerate(refs, 1)]
        for d, path in zip(readable, paths, strict=True):
            a, b = copies[0][path], copies[1][path]
            better[d.path] = compare.explain(d, a, b) if a is not None and b is not None else d
        for n in (1, 2):
            shutil.rmtree(scratch / str(n))
    return [better.get(d.path, d) for d in differences]


def explained_members(
    engine: Engine, refs: tuple[str, str], differences: list[compare.Difference], scratch: Path
) -> list[compare.Difference]:
    """The wheel members that differ, with the causes their two copies tell (each wheel copied out
    of both images once)."""
    wheels = dict.fromkeys(d.path.partition("!")[0] for d in differences if compare.needs_reading(d))
    for wheel in wheels:
        copies = [engine.fetch_files(ref, ["/" + wheel], scratch / str(n))["/" + wheel] for n, ref in enumerate(refs, 1)]
        if copies[0] is not None and copies[1] is not None:
            differences = compare.explain_members(wheel, differences, copies[0], copies[1], scratch)
        for n in (1, 2):
            shutil.rmtree(scratch / str(n))
    return differences


def _size(entry: Any) -> int:
    return int(entry["size"]) if entry else 0


def _unread(d: compare.Difference) -> compare.Difference:
    """``d`` as a difference whose copies are not read (over READ_LIMIT, or past READ_FILES)."""
    return replace(d, detail=f"not read again (over {READ_LIMIT >> 20} MB, or past the first {READ_FILES} files)")


def table(results: list[Reproduction]) -> str:
    return "\n\n".join(r.text() for r in results)
