"""A check served by two nodes (issue 40): the shipped ``moe-alphabet-2node`` check on a cluster of the local
image, formed by vLLM's own multi-node launch (``--nnodes 2``, the second node ``--headless``), tensor parallel
over the two, Gloo in place of NCCL, on this machine's loopback. Its second node runs where a Spark pair's
does: on another machine, reached with ssh (``verify --node HOST --interface IFACE``), its engine driven
through the socket ssh forwards. Here that machine is an SSH server in a container (tests/support/sshnode.py)
whose engine is this one; every other test starts both nodes here, as the local profile does. Each fault
Spark owners meet with two boxes, made for real and caught for its reason:

- a node running another build of the image (a derived image, one layer away): refused before any node
  starts, naming both image IDs;
- a node that dies while the cluster serves (its container killed with SIGKILL during the burn-in, as the
  kernel's OOM killer or a lost box ends it): verify fails naming the node, keeps both nodes' logs, and does
  not wait on the cluster that lost a rank;
- a port the cluster cannot bind (held by another socket): refused before any node starts, naming it;
- a node that has no copy of the check's model at the same path, or that ssh cannot reach: refused before
  any node starts, naming the node and what to do.

Last below, the same check with its cluster formed with Ray (``multi_node: {launch: ray}``, issue 40: "Ray
where a user asks for it"), as vLLM's ``run_cluster.sh`` forms one: ``ray start --block --address
HEAD:PORT`` on node 1, ``ray start --head`` on the head, which waits for every node
(sparkbuild/image/ray_head.py) and then runs the image's own entrypoint with ``--tensor-parallel-size 2
--distributed-executor-backend ray``; vLLM's Ray executor places rank 1 on node 1. Both nodes are
containers on this machine's loopback, each at its own address (127.0.0.2 and 127.0.0.3: vLLM's Ray
executor refuses two nodes at one), with its own ports for Ray's fixed ones.

What the rehearsal swaps, exactly (the image: the local CPU image one layer away, built here):
- Ray 2.60.0 and its one dependency the CPU image lacks (msgpack) installed from PyPI, each wheel checked
  against the index's sha256: the local image carries no Ray (the Spark image does: ray[cgraph]);
- vLLM's CPU platform given a Ray device and a communicator that asks where the ranks run, by a vLLM
  platform plugin (tests/data/ray_cpu: why each), and each Ray node told it has one GPU (``--num-gpus
  1``), a Spark's one. vLLM's CPU platform does not run under Ray at all without it: built without the
  plugin, the same cluster ends with vLLM's "current platform cpu does not support ray".
Everything else is the code a Spark pair runs: sparkbuild's launch, Ray's, vLLM's executor and server.

Faults, made for real: a node whose GPU Ray does not see (its ``ray start`` without the GPU, as a node's
container started without ``--gpus all``) fails the head naming the node; an image without Ray is refused
before any node starts.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparkbuild.config.options import Options
from sparkbuild.errors import EngineError, VerifyError
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.upstream import sources
from sparkbuild.verify import checkmodel, multinode, verify
from tests.support import ROOT, leftovers, sshnode
from tests.support.images import Created, derived_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CHECK = "moe-alphabet-2node"


def shipped() -> matrix.Check:
    return matrix.load(ROOT / "matrix.yaml").checks[CHECK]


@pytest.fixture(scope="module")
def model(cache: Path) -> Path:
    return checkmodel.provide(cache, shipped())


@pytest.fixture(scope="module")
def node_image(engine: Engine, base: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return sshnode.image(engine, base, tmp_path_factory.mktemp("ssh-node-image"))


@contextmanager
def machine(engine: Engine, node_image: str, model: Path, folder: Path, mode: str) -> Iterator[sshnode.SshNode]:
    """A second machine whose models folder (where the head keeps the check's model) is its own disk's,
    empty, writable or not (``mode``): behind it, ``folder / "disk"`` here."""
    (folder / "disk").mkdir(parents=True)
    own = {model.resolve().parent: (folder / "disk", mode)}
    with sshnode.running(engine, node_image, folder, [], own) as found:
        yield found


@pytest.fixture(scope="module")
def node(engine: Engine, node_image: str, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[sshnode.SshNode]:
    with machine(engine, node_image, model, tmp_path_factory.mktemp("ssh-node"), "rw") as found:
        yield found


def peers(node: sshnode.SshNode, host: str | None = None) -> multinode.Peers:
    return multinode.Peers(hosts=(host or node.host,), interface="lo", ssh_config=node.config)


def test_the_shipped_check_passes_on_two_nodes_the_second_on_a_machine_reached_with_ssh(
    engine: Engine, local_image: str, cache: Path, node: sshnode.SshNode, tmp_path: Path
) -> None:
    result_file = tmp_path / "verify.json"
    found = verify.verify_all(engine, local_image, [shipped()], result_file, cache=cache, peers=peers(node))
    assert not found.failures, found.failures
    data = json.loads(result_file.read_text())
    assert data["ok"] and data["cluster"]["nodes"] == 2, data
    assert data["cluster"]["machines"] == ["this machine", node.host]
    # The node had no copy of the check's model: verify made one there, over ssh, file for file.
    model = Path(data["model"]).resolve()
    disk = node.config.parent / "disk" / model.name
    assert sorted(p.relative_to(disk) for p in disk.rglob("*")) == sorted(p.relative_to(model) for p in model.rglob("*"))
    assert all(p.read_bytes() == (model / p.relative_to(disk)).read_bytes() for p in disk.rglob("*") if p.is_file())
    # Node 1 was started through the node's engine socket, which its sshd forwarded to this machine.
    assert "server_request_direct_streamlocal" in sshnode.log(engine, node) and "/var/run/docker.sock" in sshnode.log(
        engine, node
    )
    assert [a["received"] for a in data["answers"]] == [p.expect for p in shipped().prompts]
    assert data["numbers"] and all(n["ok"] for n in data["numbers"])  # held to the model's own reference
    assert [k["kind"] for k in data["kinds"]] == ["burn_in"] and data["kinds"][0]["figures"]["right"] == 42
    head, worker = (tmp_path / verify.MULTI_NODE_DIR / f"node-{rank}.log" for rank in (0, 1))
    master = data["cluster"]["master"]
    # Both ranks met at the head over TCP on the loopback, and their traffic went through it: vLLM's
    # shared-memory communicator, which would join ranks on one host, said it was not used.
    for text, rank in ((head.read_text(), 0), (worker.read_text(), 1)):
        assert f"rank={rank} local_rank=0 distributed_init_method=tcp://{master} backend=gloo" in text
        assert f"TP rank {rank}" in text
        assert "CPU SHM communicator disabled for group tp:0" in text
    # vLLM's message queue to the other node bound the loopback, not the default route's address.
    assert "mq_connect_ip=127.0.0.1" in head.read_text()


@pytest.fixture(scope="module")
def other_build(engine: Engine, local_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("other-build")
    return derived_image(
        engine, local_image, "sparkbuild-test/other-build:node", "RUN echo another build > /etc/another-build", folder
    )


def test_a_node_of_another_build_is_refused_before_any_node_starts(
    engine: Engine, local_image: str, other_build: str, model: Path, tmp_path: Path
) -> None:
    with (
        Created(engine, local_image, other_build, named=multinode.CONTAINER_PREFIX) as created,
        pytest.raises(VerifyError) as caught,
    ):
        verify.serve_cluster(engine, local_image, shipped(), model, tmp_path / "verify.json", images=(local_image, other_build))
    ids = {image: engine.inspect(image)["Id"] for image in (local_image, other_build)}
    assert f"node 1 would run {other_build} ({ids[other_build]}) and the head {local_image} ({ids[local_image]})" in str(
        caught.value
    )
    assert created.events == []


def test_a_port_the_cluster_cannot_bind_is_refused_before_any_node_starts(
    engine: Engine, local_image: str, model: Path, tmp_path: Path
) -> None:
    with socket.socket() as held:
        held.bind((multinode.LOOPBACK, 0))
        held.listen()
        port = held.getsockname()[1]
        layout = multinode.loopback(2, master_port=port)
        with Created(engine, local_image, named=multinode.CONTAINER_PREFIX) as created, pytest.raises(VerifyError) as caught:
            verify.serve_cluster(engine, local_image, shipped(), model, tmp_path / "verify.json", layout=layout)
    assert f"port {port} on 127.0.0.1, where the head meets its nodes (vLLM's --master-port), cannot be bound (in use)" in str(
        caught.value
    )
    assert created.events == []


@pytest.fixture
def killer(engine: Engine) -> Iterator[tuple[multinode.Layout, threading.Thread]]:
    """A cluster's layout, and a thread that kills its node 1 once the head has finished KILL_AFTER requests."""
    layout = multinode.loopback(2)
    url = f"http://{multinode.LOOPBACK}:{layout.api_port}"
    done = threading.Event()

    def kill() -> None:
        while not done.is_set():
            served = verify.served_requests(url)
            if served is not None and served >= KILL_AFTER:
                for container in engine.client.containers.list(filters={"name": multinode.CONTAINER_PREFIX}):
                    if container.name.endswith("-1") and f"{layout.master_port}" in container.attrs["Args"]:
                        container.kill()
                        return
            time.sleep(0.2)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    yield layout, thread
    done.set()
    thread.join()


# The answers, the client probes and the numbers take about 31 requests; the burn-in below 400 more.
KILL_AFTER = 60


def test_a_node_that_dies_while_the_cluster_serves_fails_verify_naming_it(
    engine: Engine, local_image: str, model: Path, tmp_path: Path, killer: tuple[multinode.Layout, threading.Thread]
) -> None:
    layout, thread = killer
    kinds = dataclasses.replace(shipped().kinds, burn_in=matrix.BurnIn(requests=400, concurrency=2))
    check = dataclasses.replace(shipped(), kinds=kinds)
    with pytest.raises(VerifyError) as caught:
        verify.serve_cluster(engine, local_image, check, model, tmp_path / "verify.json", layout=layout)
    error = str(caught.value)
    assert not thread.is_alive(), "the node was never killed: the check ended first"
    assert "node 1, container sparkbuild-node-" in error and "exited with code 137 (SIGKILL)" in error, error
    assert "while verify asked the cluster: burn_in request" in error, error
    logs = [tmp_path / verify.MULTI_NODE_DIR / f"node-{rank}.log" for rank in (0, 1)]
    assert all("TP rank" in path.read_text() for path in logs)
    failure = json.loads((tmp_path / verify.FAILURE).read_text())
    assert "node 1" in failure["error"]


def test_a_node_where_the_model_cannot_be_copied_is_refused_before_any_node_starts(
    engine: Engine, local_image: str, model: Path, node_image: str, tmp_path: Path
) -> None:
    """The node reads the weights itself: where its disk takes no copy (read-only here), nothing starts."""
    with (
        machine(engine, node_image, model, tmp_path / "node", "ro") as read_only,
        Created(engine, local_image, named=multinode.CONTAINER_PREFIX) as created,
        pytest.raises(EngineError) as caught,
    ):
        verify.serve_cluster(engine, local_image, shipped(), model, tmp_path / "verify.json", peers=peers(read_only))
    error = str(caught.value)
    assert f"could not copy {model.resolve()} to {read_only.host}" in error and "Read-only file system" in error, error
    assert created.events == []


@pytest.fixture(scope="module")
def bare_node(
    engine: Engine, node_image: str, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[sshnode.SshNode, Engine]]:
    """A second machine with an engine of its own, empty (tests/support/sshnode.py: ``second_engine``)."""
    with sshnode.second_engine() as socket_path:
        folder = tmp_path_factory.mktemp("bare-node")
        with sshnode.running(engine, node_image, folder, [model.resolve().parent], docker_socket=socket_path) as found:
            its_engine = Engine(base_url=f"unix://{socket_path}", where="the second engine")
            yield found, its_engine
            its_engine.close()


def test_a_node_without_the_image_and_no_digest_to_pull_it_by_is_refused_before_any_node_starts(
    engine: Engine, local_image: str, model: Path, bare_node: tuple[sshnode.SshNode, Engine], tmp_path: Path
) -> None:
    """The node's machine has its own engine, which has never seen the image; a local build names no digest
    (a nightly verifies by digest, and the node pulls it). Nothing starts on either machine."""
    node, its_engine = bare_node
    with Created(engine, local_image, named=multinode.CONTAINER_PREFIX) as created, pytest.raises(VerifyError) as caught:
        verify.serve_cluster(engine, local_image, shipped(), model, tmp_path / "verify.json", peers=peers(node))
    error = str(caught.value)
    assert f"refused before serving: node 1 (on {node.host}) has no image {local_image}, and the reference names no digest" in (
        error
    ), error
    assert f"docker save {local_image} | ssh {node.host} docker load" in error
    assert created.events == [] and its_engine.client.containers.list(all=True) == []


def test_a_node_ssh_cannot_reach_is_refused_naming_it(
    engine: Engine, local_image: str, model: Path, node: sshnode.SshNode, tmp_path: Path
) -> None:
    with Created(engine, local_image, named=multinode.CONTAINER_PREFIX) as created, pytest.raises(EngineError) as caught:
        verify.serve_cluster(engine, local_image, shipped(), model, tmp_path / "verify.json", peers=peers(node, "unreachable"))
    assert "cannot reach unreachable over SSH" in str(caught.value) and "Connection refused" in str(caught.value)
    assert created.events == []


# --- with Ray ------------------------------------------------------------------------------------

RAY = "2.60.0"
# The local image's Python (Debian bookworm's), whose wheels these are.
PYTHON_TAG = "cp311"


def with_ray() -> matrix.Check:
    """The shipped two-node check, its cluster formed with Ray."""
    shipped = matrix.load(ROOT / "matrix.yaml").checks["moe-alphabet-2node"]
    assert shipped.kinds.multi_node is not None
    kinds = dataclasses.replace(shipped.kinds, multi_node=dataclasses.replace(shipped.kinds.multi_node, launch="ray"))
    return dataclasses.replace(shipped, kinds=kinds)


def wheel(project: str, version: str, folder: Path) -> Path:
    """``project``'s wheel for this machine and the image's Python, from PyPI, its sha256 the index's."""
    machine = platform.machine()
    links = sources.index_links(project, suffix=".whl")
    prefix = f"{project}-{version}-{PYTHON_TAG}-{PYTHON_TAG}-"
    names = [n for n in links if n.startswith(prefix) and f"manylinux2014_{machine}" in n]
    assert names, f"no {project} {version} wheel for {PYTHON_TAG} on {machine} in the index"
    found = sources.fetch(links[names[0]], Options.from_env().cache / "downloads")
    return Path(shutil.copy(found, folder / names[0]))


@pytest.fixture(scope="module")
def ray_image(engine: Engine, local_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("ray-image")
    wheel("ray", RAY, folder)
    wheel("msgpack", "1.2.4", folder)
    shutil.copytree(ROOT / "tests" / "data" / "ray_cpu", folder / "ray_cpu")
    steps = (
        "COPY *.whl /tmp/wheels/\n"
        "RUN pip install --no-deps --no-index /tmp/wheels/*.whl && rm -rf /tmp/wheels\n"
        "COPY ray_cpu/ /tmp/ray_cpu/\n"
        'RUN cp -r /tmp/ray_cpu/. "$(python3 -c \'import sysconfig; print(sysconfig.get_paths()["purelib"])\')" '
        "&& rm -rf /tmp/ray_cpu"
    )
    # Its layers' records are kept for the next session (Ray installed: about 20 s to make again each time).
    with leftovers.kept_for_next_session(engine, "ray-image"):
        return derived_image(engine, local_image, f"sparkbuild-test/ray:{RAY}", steps, folder)


def test_the_shipped_check_passes_on_two_nodes_formed_with_ray(
    engine: Engine, ray_image: str, cache: Path, model: Path, tmp_path: Path
) -> None:
    result_file = tmp_path / "verify.json"
    found = verify.verify_all(engine, ray_image, [with_ray()], result_file, cache=cache)
    assert not found.failures, found.failures
    data = json.loads(result_file.read_text())
    assert data["ok"] and data["cluster"]["nodes"] == 2, data
    assert data["cluster"]["launch"].startswith("Ray (ray start on every node"), data["cluster"]
    assert data["cluster"]["master"].startswith("127.0.0.2:")
    assert [a["received"] for a in data["answers"]] == [p.expect for p in with_ray().prompts]
    assert data["numbers"] and all(n["ok"] for n in data["numbers"])  # held to the model's own reference
    assert [k["kind"] for k in data["kinds"]] == ["burn_in"] and data["kinds"][0]["figures"]["right"] == 42
    head, worker = ((tmp_path / verify.MULTI_NODE_DIR / f"node-{rank}.log").read_text() for rank in (0, 1))
    # The head started Ray's head, saw node 1 join with its GPU, then served with vLLM's Ray executor.
    assert "ray_head: 2 of 2 nodes joined: 127.0.0.2 (1 GPU), 127.0.0.3 (1 GPU)" in head
    assert "--tensor-parallel-size 2 --distributed-executor-backend ray" in head
    # Node 1 ran Ray, not vLLM's server, at its own address; vLLM's rank 1 ran there, in its Ray worker
    # (whose log Ray sends to the driver, the head), and the ranks talked over the loopback, not through
    # shared memory.
    assert "Local node IP: 127.0.0.3" in worker and "Ray runtime started" in worker
    assert "ip=127.0.0.3" in head and "TP rank 1" in head
    assert "CPU SHM communicator disabled for group tp:0" in head


def test_a_node_whose_gpu_ray_does_not_see_fails_the_head_naming_it(
    engine: Engine, ray_image: str, model: Path, tmp_path: Path
) -> None:
    """Node 1's ``ray start`` without its GPU, as a node whose container was started without ``--gpus all``:
    the head waits for it (bounded: 20 s here), then ends naming the node and what to do."""
    layout = multinode.loopback(2, launch="ray")
    own = list(layout.ray_own[1])
    del own[own.index("--num-gpus") : own.index("--num-gpus") + 2]
    layout = dataclasses.replace(layout, ray_own=(layout.ray_own[0], tuple(own)), ray_join_s=20)
    with pytest.raises(VerifyError) as caught:
        verify.serve_cluster(engine, ray_image, with_ray(), model, tmp_path / "verify.json", layout=layout)
    error = str(caught.value)  # the watch or the health wait saw the head end first: either names it, with its log
    assert "exited with code 4" in error or "the server exited (code 4)" in error, error
    head = (tmp_path / verify.MULTI_NODE_DIR / "node-0.log").read_text()
    assert "ray_head: 2 of 2 nodes joined: 127.0.0.2 (1 GPU), 127.0.0.3 (0 GPU)" in head
    assert "ray_head: after 20s, no GPU in Ray's resources on 127.0.0.3: vLLM places one rank on each node's GPU" in head
    assert "docker run --gpus all" in head and "ray_head: after 20s, no GPU" in error


def test_an_image_without_ray_is_refused_before_any_node_starts(
    engine: Engine, local_image: str, model: Path, tmp_path: Path
) -> None:
    with Created(engine, local_image, named=multinode.CONTAINER_PREFIX) as created, pytest.raises(VerifyError) as caught:
        verify.serve_cluster(engine, local_image, with_ray(), model, tmp_path / "verify.json")
    error = str(caught.value)
    refused = "refused before serving: the check forms its cluster with Ray (multi_node: launch: ray)"
    assert f"{refused} and {local_image} has no Ray" in error, error
    assert 'exec: "ray": executable file not found' in error, error
    assert created.events == []  # the one container made from it asked for Ray; no node started
