"""The speed baselines of a target, kept in the registry beside its published images.

Each published image gets one more attached document per benchmarked check (``sparkbuild.oci.referrers``:
an OCI artifact whose subject is the image's digest, annotated with the check's name): the
benchmark the next image's check is compared with, moved figure by figure
(``regression.next_baseline``). A check's baseline is read from the target's last-good image
(``publish.last_good_tag``), so any runner finds it. A target with none of its own (a new vLLM
release) is compared with its lineage: the last-good image of the newest earlier release of the
same profile, CUDA and GPU (its target id differs only in the version). An image published before
baselines were attached falls back to the benchmark in its attached verify result. A document
attached before baselines were per check (no check annotation) is the target's first check's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from sparkbuild.errors import VerifyError
from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.publish.publish import last_good_tag
from sparkbuild.util import log
from sparkbuild.verify.benchmark import Benchmark, from_json

MEDIA_TYPE = "application/vnd.sparkbuild.benchmark-baseline+json"
KIND = "benchmark-baseline"
FILENAME = "benchmark-baseline.json"
# Which check a baseline (or a verify result) is of: the annotation attest puts on verify results.
CHECK = "io.sparkbuild.check"
LAST_GOOD = "-last-good"
# A target id as sparkbuild makes it: vllm-<version>-<what it is built for> (cpu-amd64, cu130-sm121).
TARGET_ID = re.compile(r"vllm-(?P<version>[^-]+)-(?P<kind>.+)")


@dataclass(frozen=True, kw_only=True)
class Found:
    """A check's baseline and where it was read from."""

    benchmark: Benchmark
    # The digest of the image it is attached to (a last-good image).
    image: str
    # The target whose last-good image that is: this target's, or its lineage's.
    target: str


def read(registry: Registry, plan: TargetPlan, check: str) -> Found | None:
    """The baseline of ``check``: from the target's last-good image, else from its lineage's
    (``lineage``); None where nothing comparable exists."""
    first = plan.target.checks[0].name
    for target in (plan.id, *lineage(plan.id, registry.tags(plan.repository))):
        found = _from_last_good(registry, plan.repository, target, check, first)
        if found is not None:
            if target != plan.id:
                log.info(f"  {plan.id} has no {check} baseline of its own: compared with {target}'s last-good")
            return found
    log.info(f"  no {check} baseline for {plan.id} or an earlier release like it: no baseline")
    return None


def lineage(target_id: str, tags: Iterable[str]) -> list[str]:
    """The targets whose last-good tags are among ``tags`` and that are earlier releases of what
    ``target_id`` is built for (the same id but for an older, final vLLM version), newest first.
    Empty for an id sparkbuild did not make (a matrix's own ``id:`` names no lineage)."""
    mine = _parsed(target_id)
    if mine is None:
        return []
    older: list[tuple[Version, str]] = []
    for tag in tags:
        if not tag.endswith(LAST_GOOD):
            continue
        other = tag.removesuffix(LAST_GOOD)
        parsed = _parsed(other)
        if parsed is None or parsed[1] != mine[1]:
            continue
        version = parsed[0]
        if version < mine[0] and not (version.is_prerelease or version.is_devrelease):
            older.append((version, other))
    return [target for _, target in sorted(older, reverse=True)]


def _parsed(target_id: str) -> tuple[Version, str] | None:
    match = TARGET_ID.fullmatch(target_id)
    if match is None:
        return None
    try:
        return Version(match["version"]), match["kind"]
    except InvalidVersion:
        return None


def _from_last_good(registry: Registry, repository: str, target: str, check: str, first: str) -> Found | None:
    digest = registry.digest(repository, last_good_tag(target))
    if digest is None:
        return None
    attached = referrers.listed(registry, repository, digest)
    where = f"{registry.host}/{repository}@{digest}"

    def of_check(kind: str) -> referrers.Attached | None:
        mine = [a for a in attached if a.kind == kind and a.annotations.get(CHECK, first) == check]
        return referrers.newest(mine)[kind] if mine else None

    found = of_check(KIND)
    if found is not None:
        return Found(benchmark=_parse(referrers.read(registry, repository, found), where), image=digest, target=target)
    # Published before baselines were attached: its own measured figures, in its verify result.
    result = of_check("verify")
    if result is not None:
        data = json.loads(referrers.read(registry, repository, result))
        if isinstance(data, dict) and isinstance(data.get("benchmark"), dict):
            benchmark = from_json(data["benchmark"], f"{where} verify.json")
            return Found(benchmark=benchmark, image=digest, target=target)
    return None


def _parse(payload: bytes, where: str) -> Benchmark:
    try:
        data = json.loads(payload)
    except ValueError:
        raise VerifyError(f"{where}: its {FILENAME} is not JSON; delete that artifact (oras discover lists it)") from None
    return from_json(data, f"{where} {FILENAME}")


def attach(registry: Registry, plan: TargetPlan, digest: str, check: str, benchmark: Benchmark, created: str) -> None:
    """Attach ``benchmark`` to the published image ``digest`` as ``check``'s next baseline, unless
    one is attached already (a rerun)."""
    first = plan.target.checks[0].name
    listed = referrers.listed(registry, plan.repository, digest)
    if any(a.kind == KIND and a.annotations.get(CHECK, first) == check for a in listed):
        return
    document = referrers.Document(
        payload=json.dumps(benchmark.to_json(), indent=2).encode(),
        artifact_type=MEDIA_TYPE,
        filename=FILENAME,
        annotations={referrers.KIND: KIND, referrers.CREATED: created, CHECK: check},
    )
    referrers.attach(registry, plan.repository, digest, document)
