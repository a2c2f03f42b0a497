"""Documents attached to an image in its registry: OCI artifacts whose ``subject`` is the image.

Each document (an SBOM, a provenance statement, a verify result) is one OCI image manifest with
``artifactType``, the empty config and the document as its one layer, pushed by its own digest
(OCI distribution spec 1.1, "Pushing manifests with subject"). A registry with the referrers API
indexes it itself and says so (``OCI-Subject``); for one without (distribution 2.x), the fallback
tag schema is kept here: the tag ``sha256-<hex>`` holds an image index of the image's referrers,
read, added to and put back. ``oras discover`` and ``cosign tree`` read both.

The calls go through ``sparkbuild.oci.registry`` (retries with tenacity, credentials only to the
registry's own host): oras-py, the maintained Python client, pushes a manifest with a subject but
has no referrers listing and no fallback tag, and brings its own retries and credential handling.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sparkbuild.errors import PublishError
from sparkbuild.oci.registry import Registry
from sparkbuild.util import log

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
EMPTY_CONFIG = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
# The annotation sparkbuild puts on each attached document: what it is, for a person's `oras discover`.
KIND = "io.sparkbuild.attached"
CREATED = "org.opencontainers.image.created"
TITLE = "org.opencontainers.image.title"


@dataclass(frozen=True, kw_only=True)
class Attached:
    """One document attached to an image: its manifest's descriptor in the referrers index."""

    digest: str
    artifact_type: str
    size: int
    annotations: dict[str, str]

    @property
    def kind(self) -> str:
        return self.annotations.get(KIND, self.artifact_type)

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "artifactType": self.artifact_type, "size": self.size, "annotations": self.annotations}

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": OCI_MANIFEST, **self.to_json()}


def fallback_tag(digest: str) -> str:
    """The referrers tag of the fallback schema: ``<alg>-<hex>``."""
    algorithm, _, value = digest.partition(":")
    return f"{algorithm}-{value}"[:128]


@dataclass(frozen=True, kw_only=True)
class Document:
    """What to attach: the bytes, their media type, the file name `oras pull` saves them as."""

    payload: bytes
    artifact_type: str
    filename: str
    annotations: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class Layer:
    """A blob already in the repository, as one file of an artifact (``oras pull`` saves it as ``filename``)."""

    digest: str
    size: int
    media_type: str
    filename: str

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, "annotations": {TITLE: self.filename}}


def attach(registry: Registry, repository: str, subject: str, document: Document) -> Attached:
    """Push ``document`` as an artifact whose subject is the manifest ``subject`` (in ``repository``),
    and index it in the fallback tag where the registry does not index it itself."""
    payload = document.payload
    layer = Layer(
        digest=registry.upload_blob(repository, payload),
        size=len(payload),
        media_type=document.artifact_type,
        filename=document.filename,
    )
    return attach_layers(
        registry, repository, subject, artifact_type=document.artifact_type, layers=(layer,), annotations=document.annotations
    )


def attach_layers(
    registry: Registry,
    repository: str,
    subject: str,
    *,
    artifact_type: str,
    layers: tuple[Layer, ...],
    annotations: dict[str, str],
) -> Attached:
    """An artifact of several files (uploaded already) whose subject is ``subject``: one manifest,
    one layer per file, indexed like ``attach``."""
    subject_body, subject_type = registry.manifest(repository, subject)
    config = registry.upload_blob(repository, EMPTY)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": {"mediaType": EMPTY_CONFIG, "digest": config, "size": len(EMPTY), "data": "e30="},
        "layers": [layer.descriptor() for layer in layers],
        "subject": {"mediaType": subject_type, "digest": subject, "size": len(subject_body)},
        "annotations": annotations,
    }
    body = json.dumps(manifest, indent=2, sort_keys=True).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    stored = registry.put_manifest(repository, digest, body, OCI_MANIFEST)
    attached = Attached(digest=digest, artifact_type=artifact_type, size=len(body), annotations=annotations)
    if stored.subject != subject:
        _add_to_fallback(registry, repository, subject, attached)
    log.info(f"  attached {attached.kind} {digest[:19]} to {repository}@{subject[:19]}")
    return attached


def _add_to_fallback(registry: Registry, repository: str, subject: str, attached: Attached) -> None:
    """Read the fallback index, add the descriptor (once), put it back under the fallback tag."""
    tag = fallback_tag(subject)
    index = _fallback_index(registry, repository, subject)
    manifests = [m for m in index.get("manifests") or () if m.get("digest") != attached.digest]
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [*manifests, attached.descriptor()]}
    registry.put_tag(repository, tag, json.dumps(index, indent=2, sort_keys=True).encode(), OCI_INDEX)


def _fallback_index(registry: Registry, repository: str, subject: str) -> dict[str, Any]:
    at = registry.digest(repository, fallback_tag(subject))
    if at is None:
        return {}
    body, _ = registry.manifest(repository, at)
    try:
        index = json.loads(body)
    except ValueError:
        index = None
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        raise PublishError(
            f"{registry.host}/{repository}:{fallback_tag(subject)} is not an image index; it is the referrers tag of "
            f"{subject} (OCI distribution 1.1): delete it, then publish again to attach the documents anew"
        )
    return index


def subject_digest(registry: Registry, repository: str, reference: str) -> str:
    """The digest of the image named by a tag or a digest, for reading what is attached to it."""
    digest = reference if reference.startswith("sha256:") else registry.digest(repository, reference)
    if digest is None:
        raise PublishError(
            f"{registry.host}/{repository} has no tag '{reference}'; check the name (sparkbuild plan lists the tags)"
        )
    return digest


def created_now() -> str:
    """The ``CREATED`` annotation of a document attached now (RFC 3339, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def newest(attached: list[Attached], key: Callable[[Attached], str] = lambda a: a.kind) -> dict[str, Attached]:
    """The newest attached document of each kind (or each ``key``), by its ``CREATED`` annotation."""
    return {key(a): a for a in sorted(attached, key=lambda a: a.annotations.get(CREATED, ""))}


def listed(registry: Registry, repository: str, subject: str) -> list[Attached]:
    """What is attached to ``subject``: from the referrers API, else the fallback tag."""
    found = registry.referrers(repository, subject)
    if found is None:
        found = list(_fallback_index(registry, repository, subject).get("manifests") or ())
    return [
        Attached(
            digest=str(m["digest"]),
            artifact_type=str(m.get("artifactType", "")),
            size=int(m.get("size", 0)),
            annotations=dict(m.get("annotations") or {}),
        )
        for m in found
        if m.get("digest")
    ]


def read(registry: Registry, repository: str, attached: Attached) -> bytes:
    """The document an artifact carries (its first layer), checked against its digest."""
    return registry.blob(repository, layers_of(registry, repository, attached)[0].digest)


def layers_of(registry: Registry, repository: str, attached: Attached) -> list[Layer]:
    """The files an attached artifact carries, from its manifest (read by digest, so checked)."""
    body, _ = registry.manifest(repository, attached.digest)
    found = json.loads(body).get("layers") or []
    if not found:
        raise PublishError(f"{registry.host}/{repository}@{attached.digest}: an attached artifact with no layer")
    return [
        Layer(
            digest=str(layer["digest"]),
            size=int(layer.get("size", 0)),
            media_type=str(layer.get("mediaType", "")),
            filename=str((layer.get("annotations") or {}).get(TITLE, "")),
        )
        for layer in found
    ]
