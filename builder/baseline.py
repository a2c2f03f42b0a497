"""The speed baseline of a target, kept in the registry beside its published images.

Each published image gets one more attached document (``builder.referrers``: an OCI artifact whose
subject is the image's digest): the benchmark the next image of the target is compared with. That
is the image's own figures where they improved on the baseline before (or there was none), else
that baseline carried forward (``regression.next_baseline``). The baseline of a target is read
from its last-good image (``publish.last_good_tag``), so any runner finds it; an image published
before baselines were attached falls back to the benchmark in its attached verify result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from builder import log, referrers
from builder.benchmark import Benchmark, from_json
from builder.errors import VerifyError
from builder.plan import TargetPlan
from builder.publish import last_good_tag
from builder.registry import Registry

MEDIA_TYPE = "application/vnd.sparkbuild.benchmark-baseline+json"
KIND = "benchmark-baseline"
FILENAME = "benchmark-baseline.json"


@dataclass(frozen=True, kw_only=True)
class Found:
    """A target's baseline and the image it was read from."""

    benchmark: Benchmark
    # The digest of the image it is attached to (the target's last-good image).
    image: str


def read(registry: Registry, plan: TargetPlan) -> Found | None:
    """The baseline attached to the target's last-good image; None where it has none (a first
    publish, or an image with no benchmark)."""
    digest = registry.digest(plan.repository, last_good_tag(plan.id))
    if digest is None:
        return None
    attached = {a.kind: a for a in referrers.listed(registry, plan.repository, digest)}
    where = f"{registry.host}/{plan.repository}@{digest}"
    if KIND in attached:
        return Found(benchmark=_parse(referrers.read(registry, plan.repository, attached[KIND]), where), image=digest)
    # Published before baselines were attached: its own measured figures, in its one verify result.
    if "verify" in attached:
        data = json.loads(referrers.read(registry, plan.repository, attached["verify"]))
        if isinstance(data, dict) and isinstance(data.get("benchmark"), dict):
            return Found(benchmark=from_json(data["benchmark"], f"{where} verify.json"), image=digest)
    log.info(f"  {where} ({last_good_tag(plan.id)}) has no benchmark attached: no baseline")
    return None


def _parse(payload: bytes, where: str) -> Benchmark:
    try:
        data = json.loads(payload)
    except ValueError:
        raise VerifyError(f"{where}: its {FILENAME} is not JSON; delete that artifact (oras discover lists it)") from None
    return from_json(data, f"{where} {FILENAME}")


def attach(registry: Registry, plan: TargetPlan, digest: str, benchmark: Benchmark, created: str) -> None:
    """Attach ``benchmark`` to the published image ``digest`` as the target's next baseline,
    unless one is attached already (a rerun)."""
    if any(a.kind == KIND for a in referrers.listed(registry, plan.repository, digest)):
        return
    document = referrers.Document(
        payload=json.dumps(benchmark.to_json(), indent=2).encode(),
        artifact_type=MEDIA_TYPE,
        filename=FILENAME,
        annotations={referrers.KIND: KIND, referrers.CREATED: created},
    )
    referrers.attach(registry, plan.repository, digest, document)
