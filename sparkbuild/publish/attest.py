"""What is attached to a published image: its SBOM, its provenance, its verify result and the
wheels its build made (``sparkbuild.publish.wheels``).

Publish attaches them after the push and its digest check, before any readable tag moves: an image
a readable tag points at has them. Each kind is attached once: a rerun, or a nightly that finds
the image already published, attaches only what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkbuild.errors import EngineError, PublishError
from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import lock
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.publish import provenance, wheels
from sparkbuild.util import log
from sparkbuild.verify import layout

if TYPE_CHECKING:
    from sparkbuild.config.options import Options
    from sparkbuild.oci.engine import Engine

VERIFY_MEDIA_TYPE = "application/vnd.sparkbuild.verify+json"
# Which check a verify result is of: a target with several checks gets one verify document each.
CHECK = "io.sparkbuild.check"
# Made at publish from the image and the plan; then one verify result per check.
MADE = ("sbom", "provenance")
# What `oras pull` saves each as.
FILES = {"sbom": "sbom.cdx.json", "provenance": "provenance.intoto.json", "verify": "verify.json"}


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What the documents are made from beyond the plan and the image."""

    files: provenance.Files
    # Each check's verify result of this target's image, by check, the benchmarked one first
    # (attached where it exists and names that image).
    verify: dict[str, Path]
    local: str
    started: datetime | None = None
    # Where publishing the wheels remembers the stage images that hold none (``wheels.EMPTY``).
    cache: Path | None = None

    @classmethod
    def of(cls, opts: Options, p: TargetPlan, local: str, started: datetime | None = None) -> Evidence:
        files = provenance.Files(matrix=opts.matrix, lock=opts.lock or lock.default_path(opts.matrix))
        results = layout.result_files(opts.out / p.id / "verify.json", p.target.checks)
        return cls(files=files, verify=results, local=local, started=started, cache=opts.cache)


def attach(engine: Callable[[], Engine], registry: Registry, p: TargetPlan, digest: str, evidence: Evidence) -> list[str]:
    """Attach to ``digest`` each document not attached yet; the kinds attached now. Any failure is a
    PublishError that says no readable tag moved."""
    try:
        listed = referrers.listed(registry, p.repository, digest)
        have = {a.kind for a in listed}
        made = []
        for kind in MADE:
            if kind in have:
                continue
            document = _make(kind, engine, registry, p, digest, evidence)
            if document is not None:
                _attach(registry, p, digest, kind, document, {})
                made.append(kind)
        verified = {a.annotations.get(CHECK, p.target.check.name) for a in listed if a.kind == "verify"}
        for check, path in evidence.verify.items():
            if check not in verified and (result := _verify_result(engine, path, evidence.local)) is not None:
                _attach(registry, p, digest, "verify", result, {CHECK: check})
                made.append("verify" if check == p.target.check.name else f"verify ({check})")
        if wheels.KIND not in have and wheels.publish(engine, registry, p, digest, cache=evidence.cache):
            made.append(wheels.KIND)
    except (PublishError, EngineError) as exc:
        raise PublishError(
            f"{p.id}: attaching the SBOM, provenance, verify result and wheels to {registry.host}/{p.repository}@{digest} "
            f"failed: {exc}. No readable tag moved; rerun to attach what is missing (nothing is rebuilt)"
        ) from None
    if not made:
        log.info(f"{p.id}: SBOM, provenance and verify result already attached to {digest[:19]}")
    return made


def _attach(
    registry: Registry, p: TargetPlan, digest: str, kind: str, document: tuple[bytes, str], annotations: dict[str, str]
) -> None:
    payload, media_type = document
    annotations = {referrers.KIND: kind, referrers.CREATED: referrers.created_now(), **annotations}
    attached = referrers.Document(payload=payload, artifact_type=media_type, filename=FILES[kind], annotations=annotations)
    referrers.attach(registry, p.repository, digest, attached)


def _make(
    kind: str, engine: Callable[[], Engine], registry: Registry, p: TargetPlan, digest: str, evidence: Evidence
) -> tuple[bytes, str] | None:
    image = f"{registry.host}/{p.repository}"
    if kind == "sbom":
        # Imported here for start-up: cyclonedx's model is a few hundred ms to import, and a lane whose
        # images are all published already makes no SBOM (tests/test_startup.py).
        from sparkbuild.publish import sbom

        contents = sbom.read_image(engine(), published_in_engine(engine(), image, digest, p.target.platform))
        return sbom.to_json(sbom.make(contents, image=image, digest=digest)).encode(), sbom.MEDIA_TYPE
    if kind == "provenance":
        statement = provenance.statement(
            p,
            image=image,
            digest=digest,
            files=evidence.files,
            builder=provenance.builder_identity(),
            started=evidence.started,
            finished=datetime.now(UTC) if evidence.started else None,
        )
        return json.dumps(statement, indent=2).encode(), provenance.MEDIA_TYPE
    raise AssertionError(f"no document of kind {kind}")


def _verify_result(engine: Callable[[], Engine], path: Path, local: str) -> tuple[bytes, str] | None:
    """A check's verify.json where it is tied to this image (``verify.tie``; a --unverified
    publish may have none)."""
    # Imported here for start-up: the verify stage and what it loads are for a run that attaches a
    # result; a nightly with nothing to build has every result attached (tests/test_startup.py).
    from sparkbuild.verify import verify

    data = _json(path)
    if data is None or data.get("image") != local:
        log.info(f"  no verify result of {local} in {path}: none attached")
        return None
    why = verify.tie(path, local, engine().inspect(local))
    if why is not None:
        log.warning(f"  {path} is not attached: {why}")
        return None
    return json.dumps(data, indent=2).encode(), VERIFY_MEDIA_TYPE


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def published_in_engine(engine: Engine, image: str, digest: str, platform: str) -> str:
    """The published image by digest, read from the engine (which has it after pushing it), else
    pulled (a target published before sparkbuild attached SBOMs): not the local build of the same
    content tag, which a rebuild may have made with other bytes."""
    by_digest = f"{image}@{digest}"
    if not engine.image_exists(by_digest):
        engine.pull(image, digest, platform=platform)
    return by_digest
