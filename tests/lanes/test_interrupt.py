"""Ctrl-C (a real SIGINT to a real ``sparkbuild`` process) at chosen moments leaves no container, no
registry process and no half-written cache entry.

The moments are made exact with the fault injector (``tests/support/faults.py``) between sparkbuild and the
Docker engine's socket (``DOCKER_HOST`` on loopback): it holds the create, the start or the push
request until the signal is sent, then lets it through, so the signal lands while that call is in
flight, the window where a container used to be left serving.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkbuild.config.options import Options
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from tests.support import cli
from tests.support.faults import FaultProxy, Rule
from tests.support.matrix import CHECKS, LOCAL_PLATFORM, local_target
from tests.support.procs import pids_where

pytestmark = pytest.mark.docker

SLEEPER = "sparkbuild-t17/sleeper:1"


@pytest.fixture(scope="module")
def sleeper(engine: Engine, base: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image whose server never answers: it sleeps, whatever arguments verify gives it."""
    context = tmp_path_factory.mktemp("sleeper")
    (context / "Dockerfile").write_text(f'FROM {base}\nENTRYPOINT ["sh", "-c", "sleep 600", "sleeper"]\n')
    engine.build(
        context=context,
        tag=SLEEPER,
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=context / "build.log",
    )
    return SLEEPER


@pytest.fixture
def docker_proxy() -> Iterator[FaultProxy]:
    with FaultProxy("/var/run/docker.sock") as proxy:
        yield proxy


def containers_of(engine: Engine, image: str) -> list[str]:
    return [c.name for c in engine.client.containers.list(all=True, filters={"ancestor": image})]


def registries_in(folder: Path) -> list[int]:
    """docker-registry processes serving a config under ``folder``."""
    return pids_where(lambda argv: argv[0].endswith(b"docker-registry") and any(str(folder).encode() in a for a in argv))


def start(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return cli.start(*args, env=env)


def reached(proc: subprocess.Popen[str], gate: Rule, moment: str) -> None:
    """Wait until ``proc`` is held at ``gate``; fail at once if it ended first."""
    deadline = time.monotonic() + 120
    while not gate.arrived.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = proc.communicate()
            raise AssertionError(f"sparkbuild did not reach the moment '{moment}':\n{err[-3000:]}")


def interrupt(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "error: interrupted" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("moment", "rule"),
    [
        ("as the container is created", Rule("gate", method="POST", path=r"/containers/create")),
        ("as the container starts", Rule("gate", method="POST", path=r"/containers/[0-9a-f]+/start")),
    ],
)
def test_ctrl_c_as_the_verify_container_starts_leaves_none(
    moment: str, rule: Rule, docker_proxy: FaultProxy, engine: Engine, sleeper: str, tmp_path: Path
) -> None:
    docker_proxy.add(rule)
    env = {"DOCKER_HOST": f"tcp://{docker_proxy.address}", "SPARKBUILD_OUT": str(tmp_path / "out")}
    proc = start("verify", sleeper, "--check", "alphabet", "--model", str(tmp_path), env=env)
    reached(proc, rule, moment)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the signal is in; now the engine answers the call it was waiting on
    rule.release.set()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert containers_of(engine, sleeper) == []


def test_ctrl_c_while_waiting_for_the_server_leaves_no_container(engine: Engine, sleeper: str, tmp_path: Path) -> None:
    proc = start("verify", sleeper, "--check", "alphabet", "--model", str(tmp_path), env={"SPARKBUILD_OUT": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not containers_of(engine, sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert containers_of(engine, sleeper)
    interrupt(proc)
    assert containers_of(engine, sleeper) == []


def publish_setup(engine: Engine, base: str, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "matrix.yaml"
    path.write_text(CHECKS + "targets:\n" + local_target(id="t17-interrupt", repository="sparkbuild-t17/interrupt"))
    cache = tmp_path / "cache"
    (p,) = plan.make(Options.from_env(matrix=path, cache=cache, date="20261121"))
    engine.tag(base, p.repository, p.content_tag)
    return path, {"SPARKBUILD_CACHE": str(cache), "SPARKBUILD_REGISTRY": "", "SPARKBUILD_OUT": str(tmp_path / "out")}


def test_ctrl_c_during_a_push_stops_the_embedded_registry(
    docker_proxy: FaultProxy, engine: Engine, base: str, tmp_path: Path
) -> None:
    path, env = publish_setup(engine, base, tmp_path)
    gate = docker_proxy.add(Rule("gate", method="POST", path=r"/images/.+/push"))
    proc = start("publish", "--matrix", str(path), "--unverified", env={**env, "DOCKER_HOST": f"tcp://{docker_proxy.address}"})
    reached(proc, gate, "the push")
    assert registries_in(tmp_path / "cache")  # the embedded registry is serving
    threading.Timer(1.0, gate.release.set).start()
    interrupt(proc)
    assert registries_in(tmp_path / "cache") == []


def test_ctrl_c_as_the_embedded_registry_starts_leaves_no_process(engine: Engine, base: str, tmp_path: Path) -> None:
    path, env = publish_setup(engine, base, tmp_path)
    proc = start("publish", "--matrix", str(path), "--unverified", env=env)
    deadline = time.monotonic() + 60
    while not registries_in(tmp_path / "cache") and time.monotonic() < deadline:
        time.sleep(0.005)
    interrupt(proc)
    assert registries_in(tmp_path / "cache") == []


def test_kill_9_leaves_no_registry_process_either(engine: Engine, base: str, tmp_path: Path) -> None:
    path, env = publish_setup(engine, base, tmp_path)
    proc = start("publish", "--matrix", str(path), "--unverified", env=env)
    deadline = time.monotonic() + 60
    while not registries_in(tmp_path / "cache") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 10
    while registries_in(tmp_path / "cache") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert registries_in(tmp_path / "cache") == []  # it dies with its parent (PR_SET_PDEATHSIG)
