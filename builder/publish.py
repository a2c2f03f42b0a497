"""Publish stage: push by digest, check the digest, then move the readable tags.

Readable tags are set through the registry API from the manifest already pushed, so they only
ever point at a complete, checked image: nothing is half-published.
"""

from __future__ import annotations

from dataclasses import dataclass

from builder import log
from builder.engine import Engine
from builder.errors import PublishError
from builder.plan import TargetPlan
from builder.registry import Registry


@dataclass(frozen=True, kw_only=True)
class Published:
    reference: str
    digest: str
    tags: tuple[str, ...]


def push(engine: Engine, registry: Registry, plan: TargetPlan, local: str) -> Published:
    remote = f"{registry.host}/{plan.repository}"
    engine.tag(local, remote, plan.content_tag)
    pushed = engine.push(remote, plan.content_tag)
    served = registry.digest(plan.repository, plan.content_tag)
    if served != pushed:
        raise PublishError(
            f"{remote}:{plan.content_tag}: pushed {pushed} but the registry serves {served}; readable tags were not moved"
        )
    return move_tags(registry, plan, pushed)


def move_tags(registry: Registry, plan: TargetPlan, digest: str) -> Published:
    """Point every readable tag at ``digest`` (already in the registry)."""
    body, media_type = registry.manifest(plan.repository, digest)
    for tag in plan.tags:
        registry.put_tag(plan.repository, tag, body, media_type)
        if registry.digest(plan.repository, tag) != digest:
            raise PublishError(f"{registry.host}/{plan.repository}:{tag} does not point at {digest} after tagging")
    reference = f"{registry.host}/{plan.repository}@{digest}"
    log.info(f"published {reference} as {', '.join([plan.content_tag, *plan.tags])}")
    return Published(reference=reference, digest=digest, tags=(plan.content_tag, *plan.tags))
