"""A lane's run, kept in the registry beside the images it made: what ``sparkbuild report`` reads.

A published image carries its own documents (``sparkbuild.publish.attest``), but a night is more
than its images: a target that failed at its build has no image to attach anything to, and a
held-back image has no readable tag saying why. So at its end a lane pushes one OCI artifact per
repository it published to: an image manifest (artifactType ``RUN``, the empty config) whose first
layer is ``run.json`` (the lane, its night, when it ran, and the ``summary.json`` rows of that
repository's targets) and whose further layers are the logs of each failed target (``error.log``, the
server log of each failed check), tagged ``run-<lane>-<when>``. The registry stays the only store:
``oras pull`` reads a run back like any artifact, and a registry's retention of tags governs it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sparkbuild import __version__
from sparkbuild.errors import PublishError
from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry
from sparkbuild.util import log

RUN = "application/vnd.sparkbuild.run.v1+json"
LOG = "text/plain; charset=utf-8"
TAG_PREFIX = "run-"
SCHEMA = 1
# A log's last part is kept (its end says why it failed); a server log can be hundreds of MB.
LOG_TAIL_BYTES = 256 * 1024
# run.json holds a lane's rows: far below this (a manifest's own limit is 4 MiB in distribution).
MAX_RUN_BYTES = 16 * 1024 * 1024
_TAG = re.compile(r"run-([a-z]+)-(\d{8}T\d{6}\d{6}Z)")


@dataclass(frozen=True, kw_only=True)
class Run:
    """One lane's run in one repository, read back."""

    tag: str
    lane: str
    # The night (YYYYMMDD, the readable tags' date) and when the lane started (UTC, ISO 8601).
    night: str
    started: str
    rows: tuple[dict[str, Any], ...]
    # By target: each log's name (``error.log``, ``checks/<check>/server.log``) -> its layer's digest.
    logs: dict[str, dict[str, str]]


def tag_for(lane: str, started: datetime) -> str:
    """``run-<lane>-<UTC to the microsecond>``: unique per run, and sorted by time as text."""
    return f"{TAG_PREFIX}{lane}-{started.strftime('%Y%m%dT%H%M%S%fZ')}"


def is_run_tag(tag: str) -> bool:
    return _TAG.fullmatch(tag) is not None


def push(
    registry: Registry,
    repository: str,
    *,
    lane: str,
    night: str,
    started: datetime,
    rows: Sequence[Mapping[str, Any]],
    out: Path,
) -> str:
    """Push one run of ``lane`` for ``repository``'s ``rows``, with the logs of its failed targets
    (read under ``out``); return the tag."""
    layers: list[referrers.Layer] = []
    logs: dict[str, dict[str, str]] = {}
    for row in rows:
        for name, path in _failure_logs(row, out):
            layer = _upload(registry, repository, _tail(path), f"{row['target']}/{name}", LOG)
            logs.setdefault(str(row["target"]), {})[name] = layer.digest
            layers.append(layer)
    document = {
        "schema": SCHEMA,
        "lane": lane,
        "night": night,
        "started": started.isoformat(),
        "sparkbuild": __version__,
        "rows": list(rows),
        "logs": logs,
    }
    first = _upload(registry, repository, json.dumps(document, indent=1).encode(), "run.json", RUN)
    tag = tag_for(lane, started)
    manifest = {
        "schemaVersion": 2,
        "mediaType": referrers.OCI_MANIFEST,
        "artifactType": RUN,
        "config": {"mediaType": referrers.EMPTY_CONFIG, "digest": _upload_empty(registry, repository), "size": 2, "data": "e30="},
        "layers": [layer.descriptor() for layer in (first, *layers)],
        "annotations": {referrers.CREATED: started.isoformat(), referrers.KIND: "run"},
    }
    registry.put_manifest(repository, tag, json.dumps(manifest, indent=2, sort_keys=True).encode(), referrers.OCI_MANIFEST)
    log.info(f"recorded the {lane} run as {registry.host}/{repository}:{tag} ({len(rows)} target(s), {len(layers)} log(s))")
    return tag


def _failure_logs(row: Mapping[str, Any], out: Path) -> list[tuple[str, Path]]:
    """The logs a person reads to see why ``row``'s target failed: its error.log, and the server
    log of each check that failed (only those that exist)."""
    if row.get("status") not in ("failed", "interrupted"):
        return []
    found = [("error.log", out / str(row["target"]) / "error.log")]
    for check in row.get("checks") or ():
        if check.get("log"):
            found.append((f"checks/{check['check']}/server.log", Path(str(check["log"]))))
    return [(name, path) for name, path in found if path.is_file()]


def _tail(path: Path) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        if size > LOG_TAIL_BYTES:
            f.seek(size - LOG_TAIL_BYTES)
            return f"[... the first {size - LOG_TAIL_BYTES} bytes left out]\n".encode() + f.read()
        return f.read()


def _upload(registry: Registry, repository: str, data: bytes, filename: str, media_type: str) -> referrers.Layer:
    return referrers.Layer(
        digest=registry.upload_blob(repository, data), size=len(data), media_type=media_type, filename=filename
    )


def _upload_empty(registry: Registry, repository: str) -> str:
    return registry.upload_blob(repository, referrers.EMPTY)


def manifest_layers(body: bytes, where: str) -> list[dict[str, Any]]:
    """A run's manifest's layers; the first is run.json."""
    try:
        manifest = json.loads(body)
        layers = list(manifest["layers"])
        if manifest.get("artifactType") != RUN or not layers or layers[0].get("mediaType") != RUN:
            raise ValueError("not a sparkbuild run")
    except (ValueError, KeyError, TypeError) as exc:
        raise PublishError(
            f"{where}: not a run that sparkbuild recorded ({exc}); remove the tag or leave it to retention"
        ) from None
    return layers


def parse(tag: str, data: bytes, where: str) -> Run:
    """run.json's bytes -> a ``Run``; a ``PublishError`` naming ``where`` for anything else."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    try:
        if len(data) > MAX_RUN_BYTES:
            raise ValueError(f"{len(data)} bytes")
        document = json.loads(data)
        rows = tuple(dict(r) for r in document["rows"])
        if any(not isinstance(r.get("target"), str) for r in rows):
            raise ValueError("a row with no target")
        return Run(
            tag=tag,
            lane=str(document["lane"]),
            night=str(document["night"]),
            started=str(document["started"]),
            rows=rows,
            logs={str(t): {str(k): str(v) for k, v in names.items()} for t, names in (document.get("logs") or {}).items()},
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PublishError(f"{where} (run.json {digest[:19]}): unreadable ({exc})") from None
