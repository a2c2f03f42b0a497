"""``sparkbuild run IMAGE MODEL --node HOST`` (issue 40 item 3), with a real ``ssh``: this machine is the head,
and the second node is reached over SSH as a second Spark is (tests/support/sshnode.py: an SSH server in a
container on the loopback whose ``docker`` drives this machine's engine). The local image serves the MoE
check model across both, tensor parallel, every address the loopback (``--interface lo``); Ctrl-C removes
every node. And the faults a user meets, each one message with nothing started anywhere: a node SSH cannot
reach, an interface a node lacks, a second run on the same nodes, a node without the image (its machine
an engine of its own), ``--launch ray`` with an image without Ray."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import requests

from sparkbuild.lanes import nodes
from sparkbuild.models import model
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.jitcache import CACHES
from sparkbuild.util.net import free_port
from tests.support import ROOT, sshnode
from tests.support.images import Created

pytestmark = [pytest.mark.docker, pytest.mark.slow]

VLLM = ["--", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--host", "127.0.0.1"]


@pytest.fixture(scope="module")
def moe(cache: Path) -> Path:
    return model.ensure(cache, "moe-alphabet")


@pytest.fixture(scope="module")
def node(engine: Engine, base: str, moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[sshnode.SshNode]:
    folder = tmp_path_factory.mktemp("ssh-node")
    with sshnode.running(engine, sshnode.image(engine, base, folder / "image"), folder, [moe.resolve().parent]) as found:
        yield found


@pytest.fixture(scope="module")
def own(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """`run`'s options that keep the tests' caches their own: a volume prefix (its volumes removed afterwards)
    and a Hugging Face cache folder."""
    prefix = f"sparkbuild-test-{secrets.token_hex(4)}-"
    yield ["--volume-prefix", prefix, "--hf-cache", str(tmp_path_factory.mktemp("hf"))]
    for cache in CACHES:
        with contextlib.suppress(docker.errors.NotFound):  # a cache no test made
            engine.client.volumes.get(f"{prefix}{cache.name}").remove(force=True)


def cluster_containers(engine: Engine) -> list[str]:
    return [c.name for c in engine.client.containers.list(all=True, filters={"label": nodes.LABEL})]


def run(image: str, moe: Path, node: sshnode.SshNode, own: list[str], *extra: str, host: str = "node-b") -> list[str]:
    config = ["--node", host, "--ssh-config", str(node.config)]
    return [sys.executable, "-m", "sparkbuild", "run", image, str(moe), *config, *own, *extra]


def test_run_serves_across_this_machine_and_a_node_and_ctrl_c_removes_both(
    engine: Engine, local_image: str, moe: Path, node: sshnode.SshNode, own: list[str]
) -> None:
    port = free_port()
    args = run(local_image, moe, node, own, "--interface", "lo", "--port", str(port), "--master-port", str(free_port()), *VLLM)
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if process.poll() is not None:
                break
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        assert process.poll() is None, process.communicate()[0][-3000:]
        running = cluster_containers(engine)
        assert len(running) == 2, running
        body = {"model": str(model_name(url)), "prompt": "f d m n c a m m", "max_tokens": 6, "temperature": 0}
        assert requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == " j d h n j m"
        worker = engine.client.containers.get(next(n for n in running if n.endswith("-1")))
        assert "--headless" in worker.attrs["Args"] and "VLLM_HOST_IP=127.0.0.1" in worker.attrs["Config"]["Env"]
        head = engine.client.containers.get(next(n for n in running if n.endswith("-0")))
        assert head.attrs["HostConfig"]["IpcMode"] == "host"  # the node's own is private: sshnode.DOCKER
    finally:
        os.kill(process.pid, signal.SIGINT)
        out, _ = process.communicate(timeout=120)
    assert cluster_containers(engine) == [], out[-3000:]
    assert f"serving on http://127.0.0.1:{port}/v1 (2 nodes: this machine, node-b)" in out
    assert "ssh -o BatchMode=yes" in out  # each command printed before it runs


def test_a_head_that_stops_ends_the_run_with_its_exit_code_and_removes_every_node(
    engine: Engine, local_image: str, moe: Path, node: sshnode.SshNode, own: list[str]
) -> None:
    """vLLM refuses the arguments on every node (a context length that is no number): the head's log ends, and
    run fails with the head's exit code instead of ending as if it had served, leaving no node behind."""
    args = run(local_image, moe, node, own, "--interface", "lo", "--port", str(free_port()), "--master-port", str(free_port()))
    error = failing([*args, "--", "--max-model-len", "lots"])
    assert re.search(r"the head \(sparkbuild-cluster-\w+-0\) stopped with exit code [1-9]", error), error[-3000:]
    assert cluster_containers(engine) == []


def model_name(url: str) -> object:
    return requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def failing(args: list[str]) -> str:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stderr


def test_a_node_ssh_cannot_reach_is_one_message_and_nothing_starts(
    engine: Engine, local_image: str, moe: Path, node: sshnode.SshNode, own: list[str]
) -> None:
    with Created(engine, local_image, named=nodes.CONTAINER_PREFIX) as created:
        error = failing(run(local_image, moe, node, own, "--interface", "lo", host="unreachable"))
    assert "cannot reach unreachable over SSH" in error and "works here without a password" in error, error
    assert created.events == []


def test_an_interface_a_node_lacks_is_one_message_and_nothing_starts(
    engine: Engine, local_image: str, moe: Path, node: sshnode.SshNode, own: list[str]
) -> None:
    with Created(engine, local_image, named=nodes.CONTAINER_PREFIX) as created:
        error = failing(run(local_image, moe, node, own, "--interface", "nosuch0"))
    assert "--interface nosuch0: this machine has no IPv4 address on it" in error, error
    assert created.events == []


def test_ray_with_an_image_without_ray_is_one_message_and_no_node_starts(
    engine: Engine, local_image: str, moe: Path, node: sshnode.SshNode, own: list[str]
) -> None:
    """``--launch ray``: the image is asked for Ray (one container, this machine's) before any node starts."""
    error = failing(run(local_image, moe, node, own, "--interface", "lo", "--launch", "ray", *VLLM))
    assert f"--launch ray: {local_image} has no Ray" in error and 'exec: "ray": executable file not found' in error, error
    assert "serve it with vLLM's own launch (leave --launch out)" in error
    assert cluster_containers(engine) == []


def test_a_node_without_the_image_is_one_message_and_nothing_starts(
    engine: Engine, base: str, local_image: str, moe: Path, own: list[str], tmp_path: Path
) -> None:
    """The node's machine has an engine of its own that has never seen the image (sshnode.second_engine)."""
    with sshnode.second_engine() as socket_path:
        image = sshnode.image(engine, base, tmp_path / "image")
        with sshnode.running(engine, image, tmp_path, [moe.resolve().parent], docker_socket=socket_path) as bare:
            error = failing(run(local_image, moe, bare, own, "--interface", "lo", *VLLM))
            its_engine = Engine(base_url=f"unix://{socket_path}")
            assert its_engine.client.containers.list(all=True) == []
            its_engine.close()
    assert f"node-b has no image {local_image}: pull it there first (docker pull {local_image})" in error, error
    assert cluster_containers(engine) == []


def test_a_second_run_on_the_same_nodes_is_refused_naming_the_first(
    engine: Engine, local_image: str, moe: Path, node: sshnode.SshNode, own: list[str]
) -> None:
    first = ["--interface", "lo", "--detach", "--port", str(free_port()), "--master-port", str(free_port()), *VLLM]
    done = subprocess.run(run(local_image, moe, node, own, *first), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    names = done.stdout.split()
    try:
        assert sorted(names) == sorted(cluster_containers(engine))
        with Created(engine, local_image, named=nodes.CONTAINER_PREFIX) as created:
            error = failing(run(local_image, moe, node, own, "--interface", "lo", *VLLM))
        assert "this machine already runs a sparkbuild cluster node" in error and names[0] in error, error
        assert created.events == []
    finally:
        engine.client.api.remove_container(names[0], force=True)
        engine.client.api.remove_container(names[1], force=True)


# --- sparkbuild doctor --node ----------------------------------------------------------------------


def doctor(node: sshnode.SshNode, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "sparkbuild", "doctor", "--node", "node-b", "--ssh-config", str(node.config), *extra]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_doctor_says_what_a_node_has_and_warns_of_loginds_remove_ipc(local_image: str, node: sshnode.SshNode) -> None:
    done = doctor(node, "--interface", "lo", "--image", local_image, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    found = {f["what"]: f for f in json.loads(done.stdout)["node-b"]}
    assert found["ssh"]["ok"] and found["docker"]["ok"] and found["image"]["ok"], found
    assert found["interface lo"]["ok"] and found["interface lo"]["text"] == "127.0.0.1, link up"
    # Debian's own logind.conf leaves RemoveIPC at its default: a warning, not a failure.
    assert found["RemoveIPC"]["ok"] is None and "set RemoveIPC=no" in found["RemoveIPC"]["text"]


def test_doctor_names_what_a_node_lacks_and_fails(local_image: str, node: sshnode.SshNode) -> None:
    done = doctor(node, "--interface", "nosuch0", "--image", "sparkbuild-test/no-such-image:none")
    assert done.returncode == 4, done.stderr[-3000:]
    assert "node-b:\n" in done.stdout and "interface nosuch0: --interface nosuch0: node-b has no IPv4 address" in done.stdout
    assert "this machine: image" in done.stderr and "node-b: interface nosuch0" in done.stderr, done.stderr
