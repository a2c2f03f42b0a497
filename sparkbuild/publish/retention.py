"""Retention and rollback: ``sparkbuild gc``, the ``last-good`` tag and ``sparkbuild rollback``.

Every nightly leaves a content tag (``<target>-<hash>``) behind. ``gc`` keeps each nightly target's
newest ``keep_nightlies`` of them (by the images' created time) and deletes the rest through the
registry API, except a digest that any other tag points to: a readable tag, a ``last-good`` tag,
an rc tag, another target's tag. Deleting a manifest removes every tag on it, so a digest goes only
when every tag on it is an old content tag. The layers stay in the registry's storage until its own
garbage collection runs.

``<target>-last-good`` names the newest image of a target that passed verify (and, where one is
configured, the speed gate); ``rollback`` points the target's moving readable tags (those without
``{date}``) back at it, or at a digest or tag given.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from sparkbuild.errors import ConfigError, PublishError
from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry
from sparkbuild.plan.matrix import Target
from sparkbuild.publish import publish, runrecord
from sparkbuild.util import log, validate

REGISTRY_GC = (
    "the registry still stores their layers: run its garbage collection to free the space "
    "(distribution: `registry garbage-collect --delete-untagged /etc/docker/registry/config.yml`, "
    "with the registry stopped or read-only; other registries: their own retention job)"
)
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def content_tag_re(target: Target) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(target.id)}-[0-9a-f]{{12}}")


@dataclass(frozen=True, kw_only=True)
class Image:
    """One content tag of a target, with what gc decides by."""

    tag: str
    digest: str
    created: str | None


@dataclass(frozen=True, kw_only=True)
class Decision:
    target: str
    repository: str
    tag: str
    digest: str
    created: str | None
    action: Literal["keep", "delete"]
    why: str

    def to_json(self) -> dict[str, str | None]:
        return {k: getattr(self, k) for k in ("target", "repository", "tag", "digest", "created", "action", "why")}


def decide(target: Target, images: Iterable[Image], others: Mapping[str, list[str]]) -> list[Decision]:
    """Pure: which content tags of ``target`` go. ``others``: digest -> the repository's tags on it
    that are not this target's content tags (readable, last-good, rc, other targets')."""
    # Newest first; an image whose created time is unknown counts as newest: it is never the one dropped.
    ordered = sorted(images, key=lambda i: (_when(i.created) is None, _when(i.created) or _EPOCH, i.tag), reverse=True)
    kept = {i.digest: i.tag for i in ordered[: target.keep_nightlies]}
    decisions = []
    for rank, image in enumerate(ordered):
        also = sorted({*others.get(image.digest, []), *([kept[image.digest]] if image.digest in kept else [])} - {image.tag})
        action, why = _verdict(target, rank, _when(image.created) is None, also)
        decisions.append(
            Decision(
                target=target.id,
                repository=target.repository,
                tag=image.tag,
                digest=image.digest,
                created=image.created,
                action=action,
                why=why,
            )
        )
    return decisions


def _verdict(target: Target, rank: int, unknown: bool, also: list[str]) -> tuple[Literal["keep", "delete"], str]:
    if unknown:
        return "keep", "its created time is unknown"
    if rank < target.keep_nightlies:
        return "keep", f"one of the newest {target.keep_nightlies} (keep_nightlies)"
    if also:
        return "keep", f"also tagged {', '.join(also)}"
    return "delete", f"older than the newest {target.keep_nightlies}"


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _when(created: str | None) -> dt.datetime | None:
    """An image config's ``created`` (RFC 3339, nanoseconds and ``Z`` included), or None."""
    if created is None:
        return None
    try:
        when = dt.datetime.fromisoformat(created)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def plan_gc(registry: Registry, targets: Iterable[Target]) -> list[Decision]:
    """Read the registry and decide for every nightly target; deletes nothing."""
    decisions: list[Decision] = []
    for target in targets:
        if target.lane != "nightly":
            continue
        # A lane's run records (a year of nights: thousands of tags) never name an image: not asked.
        tags = [tag for tag in registry.tags(target.repository) if not runrecord.is_run_tag(tag)]
        digests = {tag: registry.digest(target.repository, tag) for tag in tags}
        pattern = content_tag_re(target)
        images = [
            Image(tag=tag, digest=digest, created=created_at(registry, target.repository, digest))
            for tag, digest in sorted(digests.items())
            if digest is not None and pattern.fullmatch(tag)
        ]
        others: dict[str, list[str]] = {}
        for tag, digest in digests.items():
            if digest is not None and not pattern.fullmatch(tag):
                others.setdefault(digest, []).append(tag)
        decisions += decide(target, images, others)
    return decisions


def created_at(registry: Registry, repository: str, digest: str) -> str | None:
    """The image's ``created`` (RFC 3339, from its config); a multi-platform index: its first image's."""
    body, media_type = registry.manifest(repository, digest)
    manifest = json.loads(body)
    if media_type in INDEX_TYPES or "manifests" in manifest:
        children = manifest.get("manifests") or []
        if not children:
            return None
        manifest = json.loads(registry.manifest(repository, children[0]["digest"])[0])
    config = (manifest.get("config") or {}).get("digest")
    if not config:
        return None
    created = json.loads(registry.blob(repository, config)).get("created")
    return created if isinstance(created, str) else None


def gc(registry: Registry, targets: Iterable[Target], *, dry_run: bool) -> list[Decision]:
    """Decide, print each decision, and (unless ``dry_run``) delete each doomed digest once."""
    decisions = plan_gc(registry, targets)
    for d in decisions:
        log.info(f"  {d.action:<6} {d.repository}:{d.tag}  {d.digest[:19]}  {d.created or '?'}  ({d.why})")
    doomed = sorted({(d.repository, d.digest) for d in decisions if d.action == "delete"})
    if dry_run:
        log.info(f"gc --dry-run: would delete {len(doomed)} image(s); nothing deleted")
        return decisions
    for repository, digest in doomed:
        # What hangs off the image goes with it: its attached documents, their fallback index and
        # cosign's signature; left, they would keep those manifests tagged for ever.
        for extra in followers(registry, repository, digest):
            log.info(f"+ DELETE {registry.host}/{repository}@{extra}  (attached to {digest[:19]})")
            registry.delete(repository, extra)
        log.info(f"+ DELETE {registry.host}/{repository}@{digest}")
        registry.delete(repository, digest)
    log.info(f"gc: deleted {len(doomed)} image(s); {REGISTRY_GC}" if doomed else "gc: nothing to delete")
    return decisions


def followers(registry: Registry, repository: str, digest: str) -> list[str]:
    """The manifests that exist for ``digest`` alone: the documents attached to it (SBOM, provenance,
    verify result), the referrers fallback index (``sha256-<hex>``) and cosign's ``sha256-<hex>.sig``."""
    found = [a.digest for a in referrers.listed(registry, repository, digest)]
    tag = referrers.fallback_tag(digest)
    for name in (tag, f"{tag}.sig"):
        at = registry.digest(repository, name)
        if at is not None:
            found.append(at)
    return list(dict.fromkeys(found))


@dataclass(frozen=True, kw_only=True)
class Move:
    tag: str
    before: str | None
    after: str

    def to_json(self) -> dict[str, str | None]:
        return {"tag": self.tag, "before": self.before, "after": self.after}


def moving(target: Target) -> tuple[str, ...]:
    """The tag templates a rollback moves: those without ``{date}`` (a dated tag names that day's
    image and stays on it)."""
    return tuple(t for t in target.tags if "{date}" not in t)


def find_target(targets: Iterable[Target], target_id: str) -> Target:
    """The nightly target ``target_id`` (an rc target's tags follow its candidate: no rollback)."""
    nightly = {t.id: t for t in targets if t.lane == "nightly"}
    if target_id not in nightly:
        raise ConfigError(
            f"no nightly target '{target_id}' in the matrix.{validate.suggest(target_id, nightly)} Targets: {', '.join(nightly)}"
        )
    return nightly[target_id]


def rollback(registry: Registry, target: Target, tags: tuple[str, ...], to: str | None) -> list[Move]:
    """Point ``tags`` at ``to`` (a digest or a tag of the target's repository; default: last-good)."""
    reference = to or publish.last_good_tag(target.id)
    digest = reference if reference.startswith("sha256:") else registry.digest(target.repository, reference)
    if digest is None:
        hint = "pass --to DIGEST or --to TAG" if to is None else "check the tag, or pass --to sha256:DIGEST"
        raise ConfigError(f"{registry.host}/{target.repository}:{reference} does not exist; {hint}")
    if not tags:
        raise ConfigError(f"{target.where}: every readable tag of {target.id} has {{date}}; a rollback moves none")
    try:
        before = publish.point(registry, target.repository, tags, digest)  # it logs each tag it moves
    except PublishError as exc:
        raise PublishError(f"{exc}; rollback of {target.id} to {digest} did not finish: rerun it") from None
    return [Move(tag=tag, before=before[tag], after=digest) for tag in tags]
