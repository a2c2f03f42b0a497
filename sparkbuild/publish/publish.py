"""Publish stage: push by digest, check the digest, attach the documents, then move the readable tags.

The image's SBOM, provenance and verify result are attached to its digest (``sparkbuild.publish.attest``)
before any readable tag moves. Readable tags are set through the registry API from the manifest
already pushed, so they only ever point at a complete, checked image: nothing is half-published. A registry cannot move two
tags at once, so the move is made visible instead: before it, each tag's current image is read;
a failure says which tag points where; and the next run (the content tag is then in the
registry) finishes the move before anything else, saying which tags it moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkbuild.config.options import UNSIGNED, Signer
from sparkbuild.errors import PublishError
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.push import named, push_image
from sparkbuild.oci.registry import Registry
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.publish import attest, sign
from sparkbuild.util import log


@dataclass(frozen=True, kw_only=True)
class Published:
    reference: str
    digest: str
    tags: tuple[str, ...]
    # What signed it: "cosign (key)", "cosign (keyless)", or "unsigned" (said with a warning).
    signature: str


def push(
    engine: Engine,
    registry: Registry,
    plan: TargetPlan,
    local: str,
    *,
    verified: bool = True,
    evidence: attest.Evidence | None = None,
    signer: Signer | None = None,
) -> Published:
    """Push ``local`` by digest and check it; attach its SBOM, provenance and verify result (with
    ``evidence``); sign it; then move the readable tags."""
    remote = f"{registry.host}/{plan.repository}"
    # Named in the registry while it is published (the SBOM is read from the image by the digest the
    # push gives it); no registry name stays to hold this image on disk once ``local`` moves on.
    with named(engine, local, remote, plan.content_tag):
        pushed = push_image(engine, registry, remote, plan.content_tag)
        served = registry.digest(plan.repository, plan.content_tag)
        if served is None:
            raise PublishError(
                f"{remote}:{plan.content_tag}: the engine pushed {pushed}, but the registry has no such tag (HTTP 404); "
                "readable tags were not moved. Is something in front of the registry dropping writes? Rerun to push again"
            )
        if served != pushed:
            raise PublishError(
                f"{remote}:{plan.content_tag}: pushed {pushed} but the registry serves {served}; readable tags were not moved"
            )
        if evidence is not None:
            attest.attach(lambda: engine, registry, plan, pushed, evidence)
        # Signed and checked by digest before any readable tag names it (a failure stops here).
        return move_tags(registry, plan, pushed, verified=verified, signer=signer)


def move_tags(
    registry: Registry, plan: TargetPlan, digest: str, *, verified: bool = True, signer: Signer | None = None
) -> Published:
    """Sign ``digest`` (already in the registry) and check the signature; then point every readable
    tag at it, then, for an image that passed verify, the target's last-good tag; saying which move."""
    reference = f"{registry.host}/{plan.repository}@{digest}"
    signature = sign.ensure_signed(signer or Signer(mode="none", why=UNSIGNED), reference, registry.host)
    point(registry, plan.repository, plan.tags, digest)
    last_good = (last_good_tag(plan.id),) if verified else ()
    point(registry, plan.repository, last_good, digest)
    tags = (plan.content_tag, *plan.tags, *last_good)
    log.info(f"published {reference} as {', '.join(tags)}")
    return Published(reference=reference, digest=digest, tags=tags, signature=signature)


def last_good_tag(target_id: str) -> str:
    """The newest image of a target that passed verify (``sparkbuild rollback`` goes back to it)."""
    return f"{target_id}-last-good"


def point(registry: Registry, repository: str, tags: tuple[str, ...], digest: str) -> dict[str, str | None]:
    """Point each of ``tags`` not there yet at ``digest``, from its manifest (nothing is pushed);
    return where each pointed before."""
    where = {tag: registry.digest(repository, tag) for tag in tags}
    before = dict(where)
    behind = [tag for tag, at in where.items() if at != digest]
    if not behind:  # a rerun or an up-to-date target: no manifest to fetch
        return before
    body, media_type = registry.manifest(repository, digest)
    if len(behind) < len(tags):
        log.warning(f"{registry.host}/{repository}: readable tags point at different images: {_state(where)}")
    for tag in behind:
        log.info(f"  {repository}:{tag}: {_short(where[tag])} -> {_short(digest)}")
        try:
            registry.put_tag(repository, tag, body, media_type)
            if registry.digest(repository, tag) != digest:
                raise PublishError(f"{registry.host}/{repository}:{tag} does not point at {digest} after tagging")
        except PublishError as exc:
            raise PublishError(
                f"{exc}. Readable tags now: {_state(where)}; rerun to finish the move (the image is pushed: nothing is rebuilt)"
            ) from None
        where[tag] = digest
    return before


def _short(digest: str | None) -> str:
    return digest[:19] if digest else "(none)"


def _state(where: dict[str, str | None]) -> str:
    return ", ".join(f"{tag} -> {_short(at)}" for tag, at in where.items())
