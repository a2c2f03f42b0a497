"""The registry client and publish against the real registry (Debian's docker-registry) behind a
fault injector on loopback (``tests/support/faults.py``): transient faults are survived, refusals fail at
once with what to do, credentials stay with their registry, a stalled push ends with exit 7, and
kill -9 at three moments of a publish leaves readable tags that a rerun finishes moving.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from sparkbuild.config.options import Limits, Options, default_limits
from sparkbuild.errors import PublishError
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry, embedded
from sparkbuild.plan import plan
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.publish import publish
from tests.support import cli
from tests.support.faults import FaultProxy, Rule, wait_for
from tests.support.matrix import CHECKS, LOCAL_PLATFORM, local_target

pytestmark = pytest.mark.docker

# Quick tries, so a test of six tries takes a second, not a minute.
FAST = dataclasses.replace(
    default_limits(), backoff_initial_s=0.05, backoff_max_s=0.2, retry_after_max_s=2, timeout_s=2, give_up_after_s=30
)
REPOSITORY = "sparkbuild-t17/faults"


def local_matrix(folder: Path, repository: str, build_arg: str = "1") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "matrix.yaml"
    path.write_text(CHECKS + "targets:\n" + local_target(repository=repository, build_args={"IMAGE": build_arg}))
    return path


def plan_of(matrix: Path, cache: Path) -> TargetPlan:
    (p,) = plan.make(Options.from_env(matrix=matrix, date="20261121", cache=cache))
    return p


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with embedded(tmp_path_factory.mktemp("registry"), FAST) as registry:
        yield registry


@pytest.fixture(scope="module")
def published(upstream: Registry, engine: Engine, base: str, tmp_path_factory: pytest.TempPathFactory) -> TargetPlan:
    """The base image published straight to the registry (no faults): a manifest to read and tag."""
    p = plan_of(local_matrix(tmp_path_factory.mktemp("m"), REPOSITORY), tmp_path_factory.mktemp("c"))
    publish.push(engine, upstream, p, base)
    return p


@pytest.fixture
def proxy(upstream: Registry) -> Iterator[FaultProxy]:
    host, port = upstream.host.rsplit(":", 1)
    with FaultProxy((host, int(port))) as faults:
        yield faults


def through(proxy: FaultProxy, limits: Limits = FAST) -> Registry:
    return Registry(proxy.address, limits=limits)


# --- sparkbuild's own calls: retried on what may pass, refused at once otherwise ----------------

KINDS: dict[str, dict[str, Any]] = {
    "500": {"kind": "status", "status": 500},
    "502": {"kind": "status", "status": 502},
    "503": {"kind": "status", "status": 503},
    "504": {"kind": "status", "status": 504},
    "408": {"kind": "status", "status": 408},
    "429": {"kind": "status", "status": 429, "headers": {"Retry-After": "1"}},
    "reset": {"kind": "reset"},
    "timeout": {"kind": "stall"},
}
CALLS = {"HEAD digest": ("HEAD", "/manifests/"), "GET manifest": ("GET", "/manifests/sha256:"), "PUT tag": ("PUT", "/manifests/")}


@pytest.mark.parametrize("kind", KINDS)
def test_every_call_survives_two_faults_of_each_transient_kind(kind: str, proxy: FaultProxy, published: TargetPlan) -> None:
    registry = through(proxy)
    digest = publish.move_tags(registry, published, published_digest(registry, published)).digest
    for call, (method, path) in CALLS.items():
        proxy.add(Rule(path=path, method=method, agent="sparkbuild", times=2, **KINDS[kind]))
        start = time.monotonic()
        if call == "HEAD digest":
            assert registry.digest(REPOSITORY, published.content_tag) == digest
        elif call == "GET manifest":
            body, _ = registry.manifest(REPOSITORY, digest)
            assert "sha256:" + hashlib.sha256(body).hexdigest() == digest
        else:
            body, media_type = registry.manifest(REPOSITORY, digest)
            registry.put_tag(REPOSITORY, f"retried-{kind}", body, media_type)
        if kind == "429":
            assert time.monotonic() - start >= 2  # it waited as Retry-After asked, twice
    assert proxy.injected[(KINDS[kind].get("status") and str(KINDS[kind]["status"])) or str(KINDS[kind]["kind"])] == 6


def published_digest(registry: Registry, p: TargetPlan) -> str:
    digest = registry.digest(p.repository, p.content_tag)
    assert digest is not None
    return digest


@pytest.mark.parametrize(
    ("status", "meaning"),
    [(400, "malformed"), (401, "SPARKBUILD_REGISTRY_USER"), (403, "forbidden"), (404, "not found")],
)
def test_a_refusal_fails_at_once_saying_what_to_do(status: int, meaning: str, proxy: FaultProxy, published: TargetPlan) -> None:
    registry = through(proxy)
    body, media_type = registry.manifest(REPOSITORY, published_digest(registry, published))
    proxy.seen.clear()
    proxy.add(Rule("status", method="PUT", path="/manifests/", status=status))
    with pytest.raises(PublishError, match=meaning) as info:
        registry.put_tag(REPOSITORY, "refused", body, media_type)
    assert f"gave HTTP {status}" in str(info.value)
    assert [s.method for s in proxy.seen] == ["PUT"]  # one request: not retried


def test_a_registry_that_keeps_failing_is_given_up_on_within_the_bound(proxy: FaultProxy, published: TargetPlan) -> None:
    proxy.add(Rule("status", status=503, times=-1))
    with pytest.raises(PublishError, match=r"still gave HTTP 503 after 6 tries") as info:
        through(proxy).digest(REPOSITORY, published.content_tag)
    assert "rerun later" in str(info.value)
    assert proxy.injected["503"] == 6


def test_a_404_after_a_push_says_the_tag_is_missing(proxy: FaultProxy, published: TargetPlan, engine: Engine, base: str) -> None:
    proxy.add(Rule("status", method="HEAD", path="/manifests/", agent="sparkbuild", status=404))
    with pytest.raises(PublishError, match="the registry has no such tag") as info:
        publish.push(engine, through(proxy), published, base)
    assert "None" not in str(info.value)


# --- the daemon's pushes -----------------------------------------------------------------------


def test_publish_survives_one_request_in_five_faulted_at_random(
    proxy: FaultProxy, engine: Engine, base: str, tmp_path: Path
) -> None:
    """Every request, sparkbuild's and the daemon's (blobs, manifests), may fail: 20 % at random."""
    for i in range(3):
        p = plan_of(local_matrix(tmp_path / str(i), f"{REPOSITORY}-random", str(i)), tmp_path / "cache")
        for kind in ("500", "503", "reset"):
            proxy.add(Rule(**KINDS[kind], times=-1, probability=0.07))
        done = publish.push(engine, through(proxy), p, base)
        proxy.clear()
        for tag in done.tags:
            assert Registry(proxy.address, limits=FAST).digest(p.repository, tag) == done.digest
    faulted = Counter(s.fault for s in proxy.seen if s.fault)
    assert sum(faulted.values()) > 0, "the seed gave no fault: change it"


def test_a_push_the_daemon_gives_up_on_is_pushed_again_whole(
    proxy: FaultProxy, engine: Engine, base: str, tmp_path: Path
) -> None:
    p = plan_of(local_matrix(tmp_path, f"{REPOSITORY}-again"), tmp_path / "cache")
    # The daemon's own manifest PUT: the daemon does not retry it, so its push fails once.
    proxy.add(Rule("status", method="PUT", path="/manifests/", agent="docker/", status=500))
    done = publish.push(engine, through(proxy), p, base)
    assert proxy.injected["500"] == 1
    assert sum(1 for s in proxy.seen if s.method == "PUT" and "/manifests/" in s.path and "docker/" in s.agent) == 2
    assert done.digest.startswith("sha256:")


def run_cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return cli.start(*args, env=env, stdout=subprocess.PIPE)


def test_a_stalled_push_ends_at_its_deadline_with_exit_7(upstream: Registry, engine: Engine, base: str, tmp_path: Path) -> None:
    host, port = upstream.host.rsplit(":", 1)
    matrix = local_matrix(tmp_path, f"{REPOSITORY}-stall")
    p = plan_of(matrix, tmp_path / "cache")
    engine.tag(base, p.repository, p.content_tag)
    # A proxy of its own: the daemon keeps a stalled upload open, and keys it by registry and layer.
    with FaultProxy((host, int(port))) as proxy:
        proxy.add(Rule("stall", method="PATCH", path="/blobs/uploads/", times=-1))
        env = {"SPARKBUILD_CACHE": str(tmp_path / "cache"), "SPARKBUILD_OUT": str(tmp_path / "out")}
        env |= {"SPARKBUILD_PUSH_STALL_S": "4", "SPARKBUILD_PUSH_DEADLINE_S": "60", "SPARKBUILD_DATE": "20261121"}
        cli = run_cli("publish", "--matrix", str(matrix), "--registry", proxy.address, "--unverified", env=env)
        _, err = cli.communicate(timeout=300)
        assert cli.returncode == 7, err[-3000:]
        assert "stalled: no progress for 4s" in err and "nothing was tagged" in err
        assert "Traceback" not in err
        assert proxy.injected["stall"] >= 1


# --- credentials stay with their registry --------------------------------------------------------


class TokenService(BaseHTTPRequestHandler):
    """A token service on another port of this machine; it records what it is sent."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        TokenService.seen.append(self.headers.get("Authorization"))
        body = json.dumps({"token": "not-a-real-token"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def token_service() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), TokenService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    TokenService.seen = []
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def challenge(realm: str) -> Rule:
    """The registry's 401 with a Bearer challenge, as Docker Hub or a token-auth registry sends it."""
    header = f'Bearer realm="{realm}",service="registry",scope="repository:{REPOSITORY}:pull"'
    return Rule("status", status=401, agent="sparkbuild", headers={"WWW-Authenticate": header})


def test_credentials_never_go_to_a_token_realm_on_another_port(
    proxy: FaultProxy, published: TargetPlan, token_service: str, capfd: pytest.CaptureFixture[str]
) -> None:
    registry = dataclasses.replace(through(proxy), username="runner", password="s3cret")
    proxy.add(challenge(f"http://{token_service}/token"))
    assert registry.digest(REPOSITORY, published.content_tag) is not None
    assert TokenService.seen == [None]  # asked, but without the registry's credentials
    assert "SPARKBUILD_TOKEN_REALMS=127.0.0.1" in capfd.readouterr().err
    # Allowed by name, the same service gets them.
    allowed = dataclasses.replace(registry, token_hosts=(token_service,))
    proxy.add(challenge(f"http://{token_service}/token"))
    allowed.digest(REPOSITORY, published.content_tag)
    assert TokenService.seen[-1] is not None and TokenService.seen[-1].startswith("Basic ")


@pytest.mark.parametrize("realm", ["http://localhost.evil.example:1/token", "http://127.0.0.1.nip.io:1/token", "ftp://x/t"])
def test_a_token_realm_over_plain_http_off_loopback_is_refused(realm: str, proxy: FaultProxy, published: TargetPlan) -> None:
    registry = dataclasses.replace(through(proxy), username="runner", password="s3cret")
    proxy.add(challenge(realm))
    with pytest.raises(PublishError, match=r"plain HTTP only on loopback|not an http\(s\) URL"):
        registry.digest(REPOSITORY, published.content_tag)


# --- kill -9 during a publish: readable tags move together or visibly not at all ------------------

MOMENTS = {
    "during blobs": Rule("gate", method="PATCH", path="/blobs/uploads/", drop=True),
    "after the content tag": Rule("gate", method="PUT", path="/manifests/0.32.0-", agent="sparkbuild", drop=True),
    "between readable tags": Rule("gate", method="PUT", path="/manifests/nightly", agent="sparkbuild", drop=True),
}


def test_kill_9_at_three_moments_and_a_rerun_finishes_the_move(
    proxy: FaultProxy, engine: Engine, base: str, tmp_path: Path
) -> None:
    repository = f"{REPOSITORY}-kill"
    old = plan_of(local_matrix(tmp_path / "old", repository, "old"), tmp_path / "cache")
    old_digest = publish.push(engine, through(proxy), old, base).digest
    # The new image has a layer of its own, so its push uploads a blob.
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(f"FROM {base}\nRUN echo new > /new\n")
    new_image = "sparkbuild-t17/kill-new:1"
    engine.build(
        context=tmp_path / "ctx",
        tag=new_image,
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=tmp_path / "build.log",
    )
    matrix = local_matrix(tmp_path / "new", repository, "new")
    new = plan_of(matrix, tmp_path / "cache")
    engine.tag(new_image, new.repository, new.content_tag)
    env = {"SPARKBUILD_CACHE": str(tmp_path / "cache"), "SPARKBUILD_OUT": str(tmp_path / "out"), "SPARKBUILD_DATE": "20261121"}
    args = ("publish", "--matrix", str(matrix), "--registry", proxy.address, "--unverified")
    registry = Registry(proxy.address, limits=FAST)
    for moment, rule in MOMENTS.items():
        publish.move_tags(registry, old, old_digest)  # readable tags back on the old image
        gate = proxy.add(dataclasses.replace(rule, arrived=threading.Event(), release=threading.Event()))
        cli = run_cli(*args, env=env)
        wait_for(gate.arrived, f"the publish reaching the moment '{moment}'")
        cli.kill()
        cli.communicate()
        gate.release.set()
        proxy.clear()
        tags = {tag: registry.digest(repository, tag) for tag in new.tags}
        if moment == "between readable tags":
            assert tags == {"0.32.0-20261121": registry.digest(repository, new.content_tag), "nightly": old_digest}
        else:
            assert set(tags.values()) == {old_digest}, moment  # nothing moved yet
        rerun = run_cli(*args, env=env)
        _, err = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, err[-3000:]
        new_digest = registry.digest(repository, new.content_tag)
        assert new_digest is not None and new_digest != old_digest
        assert {registry.digest(repository, tag) for tag in new.tags} == {new_digest}, moment
        # The rerun says which tags it moves, from where to where.
        for tag, at in tags.items():
            if at is not None and at != new_digest:
                assert re.search(rf"{tag}: {at[:19]} -> {new_digest[:19]}", err), err[-2000:]
        if moment == "between readable tags":
            assert "readable tags point at different images" in err
