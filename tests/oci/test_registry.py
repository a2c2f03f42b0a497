"""The embedded registry and publishing, against a real registry and engine."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest
import requests

from sparkbuild.config.options import Options
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry, embedded
from sparkbuild.plan import plan
from sparkbuild.publish.publish import push
from tests.support import ROOT, leftovers

pytestmark = pytest.mark.docker


def listening(host: str) -> bool:
    address, port = host.rsplit(":", 1)
    with socket.socket() as sock:
        return sock.connect_ex((address, int(port))) == 0


def test_embedded_registry_listens_on_loopback_only_and_stops(tmp_path: Path) -> None:
    with embedded(tmp_path / "reg") as registry:
        assert registry.host.startswith("127.0.0.1:")
        assert requests.get(f"{registry.base_url}/", timeout=5).status_code == 200
        config = (tmp_path / "reg" / "config.yml").read_text()
        assert f"addr: {registry.host}" in config
        host = registry.host
    assert not listening(host)
    assert (tmp_path / "reg" / "storage").is_dir()


def test_the_embedded_registry_keeps_its_address_so_the_next_push_sends_no_layer_it_holds(
    engine: Engine, base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "reg"
    with embedded(data) as registry:
        host = registry.host
        engine.tag(base, f"{host}/sparkbuild-test/first", "1")
        engine.push(f"{host}/sparkbuild-test/first", "1")
    assert capsys.readouterr().err.count(" layer(s) sent, 0 already in the registry") == 1
    # A later run on the same storage: the same address, so Docker mounts the layers it pushed there.
    with embedded(data) as again:
        assert again.host == host
        engine.tag(base, f"{host}/sparkbuild-test/second", "1")
        engine.push(f"{host}/sparkbuild-test/second", "1")
    assert "  0 layer(s) sent, 1 already in the registry (found or mounted)" in capsys.readouterr().err
    # The port taken by something else: a new one, kept for the next run.
    address, port = host.rsplit(":", 1)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the registry's connections may be in TIME_WAIT
        other.bind((address, int(port)))
        other.listen()
        with embedded(data) as moved:
            assert moved.host != host and requests.get(f"{moved.base_url}/", timeout=5).status_code == 200
    assert (data / "port").read_text().strip() == moved.host.rsplit(":", 1)[1]
    for name in (f"{host}/sparkbuild-test/first:1", f"{host}/sparkbuild-test/second:1"):
        engine.client.images.remove(name)


def test_publish_pushes_by_digest_then_moves_readable_tags(engine: Engine, base: str, registry: Registry, tmp_path: Path) -> None:
    p = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261121"))[0]
    # Publish a small image under the plan's names: pushing the real vLLM image is the nightly test's job.
    engine.tag(base, "sparkbuild-test/publish", "1")
    done = push(engine, registry, p, "sparkbuild-test/publish:1")
    assert done.tags == (p.content_tag, "0.32.0-20261121", "nightly", f"{p.id}-last-good")
    for tag in done.tags:
        assert registry.digest(p.repository, tag) == done.digest
    body, _ = registry.manifest(p.repository, done.digest)
    assert "sha256:" + hashlib.sha256(body).hexdigest() == done.digest
    assert done.reference == f"{registry.host}/{p.repository}@{done.digest}"
    # The name the push needed went after it: the local name holds the image, nothing else does.
    assert leftovers.registry_names(engine, registry.host) == [] and engine.image_exists("sparkbuild-test/publish:1")


def test_an_unverified_publish_leaves_last_good_where_it_was(engine: Engine, base: str, registry: Registry) -> None:
    p = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261121"))[0]
    engine.tag(base, "sparkbuild-test/publish", "1")
    done = push(engine, registry, p, "sparkbuild-test/publish:1", verified=False)
    assert done.tags == (p.content_tag, "0.32.0-20261121", "nightly")
    assert registry.digest(p.repository, f"{p.id}-last-good") is None


def test_a_missing_tag_has_no_digest(registry: Registry) -> None:
    assert registry.digest("sparkbuild/nothing", "nope") is None
