"""Free disk, checked before any work: Docker's data root, the cache and the embedded registry's
storage, against an estimate of what the run writes there (``defaults.yaml`` ``disk:``).

Too little is one DiskSpaceError (exit 14) naming each folder, what it has and what the run needs,
instead of a registry's "HTTP 500" or an ``OSError [Errno 28]`` halfway through.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkbuild.config.options import defaults
from sparkbuild.errors import DiskSpaceError
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.util import log

GB = 10**9


def _table() -> dict[str, Any]:
    table: dict[str, Any] = defaults()["disk"]
    return table


def stage_gb(profile: str, stage: str) -> float:
    """What one stage image takes in the engine; a stage the table does not name counts as 10 GB."""
    return float(_table()["stages"].get(profile, {}).get(stage, UNKNOWN_STAGE_GB))


def named(profile: str, stage: str) -> bool:
    """Whether the table has a figure for this stage (sparkbuild's own templates' stages)."""
    return stage in _table()["stages"].get(profile, {})


UNKNOWN_STAGE_GB = 10


def stage_name(plan: TargetPlan, stage: str) -> str:
    """The table's name of a stage: a vllm stage that installs upstream's wheel is ``vllm_wheel``
    (a wheel of a few hundred MB, where the compile's stage is tens of GB)."""
    wheel = plan.choice is not None and plan.choice.mode == "wheel"
    return "vllm_wheel" if wheel and stage == "vllm" else stage


def estimate(plan: TargetPlan) -> dict[str, float]:
    """GB per stage in the engine, and the pushed image in the registry (shown by `sparkbuild plan`)."""
    profile = plan.target.profile
    return {
        **{s.name: stage_gb(profile, stage_name(plan, s.name)) for s in plan.stages},
        "registry": float(_table()["registry"].get(profile, 10)),
    }


@dataclass(frozen=True)
class Need:
    """``gb`` to be written under ``path`` (``what`` names it), for ``why``."""

    what: str
    path: Path
    gb: float
    why: tuple[str, ...]


def needs(
    plans: Iterable[TargetPlan],
    cache: Path,
    *,
    engine_root: Path | None,
    in_engine: Callable[[str], bool],
    registry_storage: Path | None,
) -> list[Need]:
    """What the run writes where: stages not yet in the engine, images not yet published."""
    plans = list(plans)
    result = [Need("the cache", cache, float(_table()["cache_gb"]), ("check model, build contexts",))]
    if engine_root is not None:
        stages = {s.ref: (p.target.profile, stage_name(p, s.name)) for p in plans for s in p.stages}
        missing = {ref: stage_gb(*key) for ref, key in stages.items() if not in_engine(ref)}
        if missing:
            why = tuple(f"{ref} ~{gb:g} GB" for ref, gb in missing.items())
            result.append(Need("Docker's data root", engine_root, sum(missing.values()), why))
    if registry_storage is not None and plans:
        why = tuple(f"{p.repository}:{p.content_tag} ~{estimate(p)['registry']:g} GB" for p in plans)
        result.append(Need("the registry storage", registry_storage, sum(estimate(p)["registry"] for p in plans), why))
    return result


def rebuilds(stages: Iterable[tuple[str, float]], cache: Path, *, engine_root: Path | None) -> list[Need]:
    """What two builds of each stage write (``sparkbuild reproduce``: no stage is reused); ``stages``:
    (what it is, GB one build of it writes)."""
    result = [Need("the cache", cache, float(_table()["cache_gb"]), ("build contexts",))]
    stages = list(stages)
    if engine_root is not None and stages:
        why = tuple(f"{name} twice ~{2 * gb:.2f} GB" for name, gb in stages)
        result.append(Need("Docker's data root", engine_root, round(sum(2 * gb for _, gb in stages), 2), why))
    return result


def engine_root(info: dict[str, Any]) -> Path | None:
    """Docker's data root from ``docker info``, where it is a folder of this machine."""
    root = Path(str(info.get("DockerRootDir", "")))
    if not root.is_absolute() or not root.is_dir():
        log.info(f"disk: Docker's data root '{root}' is not on this machine; not checked")
        return None
    return root


def check(wanted: list[Need]) -> None:
    """Raise DiskSpaceError unless every file system has room for what is written to it (plus a margin)."""
    margin = float(_table()["margin_gb"])
    by_device: dict[int, list[Need]] = {}
    for need in wanted:
        by_device.setdefault(_existing(need.path).stat().st_dev, []).append(need)
    short = []
    for group in by_device.values():
        total = sum(n.gb for n in group) + margin
        free = shutil.disk_usage(_existing(group[0].path)).free / GB
        names = " and ".join(f"{n.what} ({n.path}, ~{n.gb:g} GB: {'; '.join(n.why[:4])})" for n in group)
        if free < total:
            short.append(f"{names}: {free:.2f} GB free, {total:g} GB needed with the {margin:g} GB margin")
        else:
            log.info(f"disk: {free:.0f} GB free for {', '.join(n.what for n in group)} (~{math.ceil(total)} GB needed)")
    if short:
        raise DiskSpaceError(
            "not enough free disk for this run, nothing was started: "
            + "; ".join(short)
            + ". Free space there (`docker image prune`, `docker builder prune`, old files in the cache), or point "
            "SPARKBUILD_CACHE at a larger disk"
        )


def _existing(path: Path) -> Path:
    """``path``, or its nearest existing parent (a cache folder not made yet)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
