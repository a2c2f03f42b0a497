"""A cluster of one container a node serving one model with vLLM's own multi-node launch.

vLLM's multiprocessing executor spans nodes by itself (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``; every node past the head runs ``--headless``): the launch without Ray that the
community Spark build made its default in 2026. sparkbuild writes no distributed code: it starts one
container a node with those arguments, checks what must hold before any of them starts (the same image
build on every node, the ports free), watches every node while the head serves, and keeps each node's log.

The model is split tensor parallel, one rank a node (``--tensor-parallel-size`` = nodes): what Spark
owners run across two Sparks (a model too large for one box, each rank holding its share of every
layer), and what vLLM's CPU backend runs too, so the rehearsal here takes the same path.

Where every node talks is named, never guessed: vLLM binds its message queue to ``VLLM_HOST_IP`` and
otherwise to the address of the default route (a LAN address, not the link between the Sparks), and
Gloo and NCCL pick their interface from ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``. On a Spark pair
that is the QSFP link; here, the loopback (``lo``, 127.0.0.1): every node is a container in the host's
network namespace, and Gloo (vLLM's CPU communicator) stands in for NCCL. vLLM's shared-memory
communicator needs its ranks on one host and says in the log that it falls back to torch.distributed,
so the ranks' traffic goes through the network stack as between two Sparks.

With Ray, where the check asks for it (``multi_node: {launch: ray}``), the cluster is formed as vLLM's own
``examples/online_serving/run_cluster.sh`` forms it: every node past the head runs ``ray start --block
--address HEAD:PORT``, the head runs ``ray start --head``, waits for every node (``image/ray_head.py``,
mounted into the head's container) and then ``vllm serve ... --tensor-parallel-size N
--distributed-executor-backend ray``: vLLM places one rank on each node through Ray. vLLM's Ray executor
refuses two nodes at one address ("Every node should have a unique IP address"), so here each node has a
loopback address of its own (127.0.0.2, 127.0.0.3, ...: Ray registers a node asked to use 127.0.0.1 at the
host's own LAN address, measured), and, sharing one machine, ports of its own for the Ray daemons whose
defaults are fixed.
"""

from __future__ import annotations

import errno
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkbuild.config.options import Options
from sparkbuild.errors import EngineError, VerifyError
from sparkbuild.image import ray_head
from sparkbuild.oci import jitcache
from sparkbuild.oci.engine import Container, Engine, ServerState
from sparkbuild.oci.remote import Node, address, copy_folder, engine_of, has_folder
from sparkbuild.plan.matrix import Check
from sparkbuild.util import log
from sparkbuild.util.net import free_port, free_ports

# This machine's cluster: every node on the loopback.
LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"
# Every node's container is named so, then the cluster's token and the rank.
CONTAINER_PREFIX = "sparkbuild-node-"
# How often the watch looks at every node, and how long a failed request waits for it to see a node stop.
WATCH_S = 0.5
SETTLE_S = 10.0
# Where the head's container finds the Ray launcher, and how long it waits for every node to join.
RAY_HEAD = "/opt/sparkbuild-ray/ray_head.py"
RAY_JOIN_S = 300
# Worker ports a Ray node on a shared machine binds (a Ray worker process holds one each; vLLM runs one
# a node, and Ray starts a few idle ones beside it).
RAY_WORKER_PORTS = 16


@dataclass(frozen=True, kw_only=True)
class Peers:
    """The machines past this one a cluster's nodes run on (``verify --node HOST``, SPARKBUILD_NODES), the
    interface of the link they share with it, and how ssh reaches them. None given: every node is a
    container on this machine's loopback (the rehearsal)."""

    hosts: tuple[str, ...] = ()
    interface: str = ""
    ssh_config: Path | None = None

    def nodes(self) -> list[Node]:
        return [Node(host=host, ssh_config=self.ssh_config) for host in self.hosts]


def peers_of(opts: Options) -> Peers | None:
    """The other machines the options name (SPARKBUILD_NODES, --node), or None."""
    if not opts.nodes:
        return None
    return Peers(hosts=opts.nodes, interface=opts.node_interface, ssh_config=opts.ssh_config)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where the nodes meet: the head's address and port for vLLM's ranks, the API's port, the
    interface NCCL and Gloo use, and each node's own address on it."""

    nodes: int
    master_addr: str
    master_port: int
    api_port: int
    interface: str
    addresses: tuple[str, ...]
    # "vllm" (its own launch) or "ray"; with Ray, master_port is the head's Ray port (GCS).
    launch: str = "vllm"
    # Ray with every node on this machine: each node's own ``ray start`` options (shared_machine).
    ray_own: tuple[tuple[str, ...], ...] = ()
    # Ray: how long the head waits for every node to join with a GPU before it gives up, naming what is missing.
    ray_join_s: float = RAY_JOIN_S


def loopback(nodes: int, *, master_port: int | None = None, api_port: int | None = None, launch: str = "vllm") -> Layout:
    """The layout of a cluster on this machine's loopback, with free ports unless given. With Ray, each node
    its own loopback address (vLLM's Ray executor refuses two nodes at one) and Ray ports."""
    ray = launch == "ray"
    addresses = tuple(f"127.0.0.{rank + 2}" for rank in range(nodes)) if ray else (LOOPBACK,) * nodes
    # Every port the cluster takes here, all different (Ray refuses a port two of its parts name).
    ports = free_ports(2 + (nodes * (1 + RAY_WORKER_PORTS) if ray else 0))
    own = [ports[2 + rank * (1 + RAY_WORKER_PORTS) :][: 1 + RAY_WORKER_PORTS] for rank in range(nodes)] if ray else []
    return Layout(
        nodes=nodes,
        master_addr=addresses[0],
        master_port=master_port if master_port is not None else ports[0],
        api_port=api_port if api_port is not None else ports[1],
        interface=LOOPBACK_INTERFACE,
        addresses=addresses,
        launch=launch,
        ray_own=tuple(shared_machine(node) for node in own),
    )


def shared_machine(ports: Sequence[int]) -> tuple[str, ...]:
    """``ray start`` options for a node that shares this machine with the others: its own free ``ports``
    where Ray's are fixed (the dashboard agent's 52365, then the worker range 10002-19999), so two nodes
    do not both take them; and one GPU declared, the one a Spark's Ray finds on it, which vLLM places a
    rank on (here a CPU rank stands in for it: docs/multi-node.md)."""
    workers = ",".join(str(port) for port in ports[1:])
    return ("--dashboard-agent-listen-port", str(ports[0]), "--worker-port-list", workers, "--num-gpus", "1")


def node_args(layout: Layout, rank: int) -> list[str]:
    """The arguments vLLM takes on node ``rank`` (after the model and serve args): its multi-node launch's,
    or, with Ray, the head's (the other nodes run Ray, not vLLM)."""
    if layout.launch == "ray":
        return ["--tensor-parallel-size", str(layout.nodes), "--distributed-executor-backend", "ray"]
    out = ["--tensor-parallel-size", str(layout.nodes), "--nnodes", str(layout.nodes), "--node-rank", str(rank)]
    out += ["--master-addr", layout.master_addr, "--master-port", str(layout.master_port)]
    return out if rank == 0 else [*out, "--headless"]


def ray_start_args(layout: Layout, rank: int, *, dashboard: bool | None = False) -> list[str]:
    """``ray start``'s options on node ``rank`` past ``--head`` (the head) or ``start --block`` (the others):
    its address on the shared link, where the head listens, its own ports on a shared machine. ``dashboard``
    None leaves it to Ray: on where the image has its packages (``ray[default]``); Ray refuses to start
    when asked for it without them ("Cannot include dashboard with missing packages"), and the Spark image
    carries ``ray[cgraph]``."""
    out = ["--node-ip-address", layout.addresses[rank], "--disable-usage-stats"]
    if rank == 0:
        out += ["--port", str(layout.master_port)]
        out += [] if dashboard is None else [f"--include-dashboard={str(dashboard).lower()}"]
    else:
        out += ["--address", f"{layout.master_addr}:{layout.master_port}"]
    return out + list(layout.ray_own[rank] if layout.ray_own else ())


def ray_head_file() -> Path:
    """The launcher the head's container runs (mounted at RAY_HEAD)."""
    return Path(ray_head.__file__)


def ray_command(layout: Layout, rank: int, serve: Sequence[str], *, dashboard: bool | None = False) -> tuple[str, list[str]]:
    """The entrypoint and command of node ``rank`` with Ray: the head's launcher (Ray's head, every node
    joined, then ``serve``: the image's entrypoint and the vLLM arguments), or ``ray start --block``."""
    own = ray_start_args(layout, rank, dashboard=dashboard)
    if rank == 0:
        return "python3", [RAY_HEAD, str(layout.nodes), f"{layout.ray_join_s:g}", "--", *own, "--", *serve]
    return "ray", ["start", "--block", *own]


def node_environment(layout: Layout, rank: int) -> dict[str, str]:
    """What every rank on node ``rank`` talks through: its own address (vLLM's message queue) and the
    interface (Gloo's and NCCL's sockets). With Ray, every worker's line in the head's log: Ray's
    driver folds lines of different workers that differ only in numbers ("TP rank 0", "TP rank 1")
    into one "[repeated 2x across cluster]", so the log verify keeps and a user reads would not say
    which rank, on which node, logged what (RAY_DEDUP_LOGS, Ray's own switch; seen in a warm run)."""
    environment = {
        "VLLM_HOST_IP": layout.addresses[rank],
        "GLOO_SOCKET_IFNAME": layout.interface,
        "NCCL_SOCKET_IFNAME": layout.interface,
    }
    if layout.launch == "ray":
        environment["RAY_DEDUP_LOGS"] = "0"
    return environment


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where one node runs: the machine (this one, or one reached over ssh), its engine, the image there."""

    node: Node
    engine: Engine
    image: str

    def where(self, rank: int) -> str:
        who = "the head" if rank == 0 else f"node {rank}"
        return who if self.node.host is None else f"{who} (on {self.node.host})"


def present_everywhere(places: Sequence[Place]) -> None:
    """The image on every machine: pulled there by its digest where the reference names one (the image
    verify pulled from the registry here; the registry's credentials go from this machine's client with
    the request), refused before serving where it does not (a local build has no digest to pull by)."""
    head = places[0]
    for rank, place in enumerate(places):
        if place.node.host is None or place.engine.image_exists(place.image):
            continue
        repository, at, digest = place.image.partition("@")
        if not at:
            raise VerifyError(
                f"refused before serving: {place.where(rank)} has no image {place.image}, and the reference names no "
                f"digest to pull it by: push it to a registry and verify it by digest, or load it there (docker save "
                f"{place.image} | ssh {place.node.host} docker load)"
            )
        found = head.engine.inspect(head.image)
        place.engine.pull(repository, digest, platform=f"{found['Os']}/{found['Architecture']}")


def same_build(places: Sequence[Place]) -> str:
    """The image ID every node would run; refused, naming both, where a node's differs from the head's."""
    ids = [str(place.engine.inspect(place.image)["Id"]) for place in places]
    head = places[0]
    for rank, (place, found) in enumerate(zip(places, ids, strict=True)):
        if found != ids[0]:
            raise VerifyError(
                f"refused before serving: {place.where(rank)} would run {place.image} ({found}) and {head.where(0)} "
                f"{head.image} ({ids[0]}): every node must run the same image build; pull the head's digest on every node"
            )
    return ids[0]


def has_ray(head: Place) -> None:
    """The image carries Ray's ``ray`` command (every node runs the same build: asked of the head's)."""
    try:
        head.engine.output(head.image, ["ray", "--version"], timeout_s=120)
    except EngineError as exc:
        raise VerifyError(
            f"refused before serving: the check forms its cluster with Ray (multi_node: launch: ray) and {head.image} has "
            f"no Ray ({exc}): install Ray in the image (the version vLLM asks for: ray[cgraph]>=2.48), or serve the check "
            "with vLLM's own launch (launch: vllm)"
        ) from None


def model_everywhere(places: Sequence[Place], model: Path) -> None:
    """Every node reads the model itself, from the same path: copied to a machine that has none there (a
    check model is made on the head; it is a few MB)."""
    for rank, place in enumerate(places):
        if place.node.host is not None and not has_folder(place.node, model):
            log.info(f"multi_node: {place.where(rank)} has no {model}: copying the check's model there")
            copy_folder(place.node, model)


def port_free(address: str, port: int, what: str) -> None:
    """Refuse a port the cluster cannot bind, before any node starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise VerifyError(
                f"refused before serving: port {port} on {address}, {what}, cannot be bound ({why}): "
                "free it, or give the cluster another port"
            ) from None


@dataclass(frozen=True, kw_only=True)
class Down:
    """A node that stopped while the cluster served, and how."""

    rank: int
    name: str
    # How it ended, or None where its machine's engine no longer answers (``lost`` says how).
    state: ServerState | None
    lost: str = ""

    def text(self) -> str:
        who = "the head (node 0)" if self.rank == 0 else f"node {self.rank}"
        return f"{who}, container {self.name}, {self.state.text() if self.state else self.lost}"


class Watch:
    """Looks at every node every WATCH_S seconds; the first that stops is kept (by the time Docker
    says it finished, so a node that brought the others down is the one named), and the others are
    stopped then, so no request waits on a cluster that lost a rank."""

    def __init__(self, nodes: Sequence[Container]) -> None:
        self._nodes = list(nodes)
        self._down: Down | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def down(self) -> Down | None:
        return self._down

    def settle(self, grace_s: float = SETTLE_S) -> Down | None:
        """After a request failed: the node that stopped, if one did, waiting up to ``grace_s`` for Docker
        to see it (the head answers 500 as soon as it loses a rank, before the dead node's container ends)."""
        end = time.monotonic() + grace_s
        while (down := self._look()) is None and time.monotonic() < end:
            time.sleep(WATCH_S)
        return down

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            if self._look() is not None:
                return

    def _look(self) -> Down | None:
        with self._lock:
            if self._down is None:
                self._down = self._first_down()
                if self._down is not None:
                    log.error(f"multi_node: {self._down.text()}: stopping the other nodes")
                    for node in self._nodes:
                        try:
                            node.kill()
                        except EngineError as exc:  # the watch goes on: the node named is the finding
                            log.error(str(exc))
            return self._down

    def _first_down(self) -> Down | None:
        """The node that stopped first; or one whose machine's engine no longer answers (a Spark lost)."""
        stopped = []
        for rank, node in enumerate(self._nodes):
            try:
                if not node.running():
                    stopped.append((rank, node))
            except EngineError as exc:
                return Down(rank=rank, name=node.name, state=None, lost=str(exc))
        return first_down(stopped) if stopped else None


def first_down(stopped: Sequence[tuple[int, Container]]) -> Down:
    """The node Docker saw finish first."""
    rank, node = min(stopped, key=lambda item: item[1].finished_at())
    return Down(rank=rank, name=node.name, state=node.state())


LAUNCH_TEXT = {
    "vllm": "vLLM's multi-node launch (--nnodes, --node-rank, --master-addr, --headless)",
    "ray": "Ray (ray start on every node, vllm serve --distributed-executor-backend ray on the head)",
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    url: str
    nodes: tuple[Container, ...]
    watch: Watch
    layout: Layout
    # The image every node runs, by its ID.
    image_id: str
    # The machine each node ran on ("this machine", or the ssh host).
    machines: tuple[str, ...] = ()

    def stopped(self) -> str | None:
        """Why the cluster cannot serve while it starts: a node that stopped, with its last log lines where its
        engine still answers (None while every node runs)."""
        down = self.watch.down
        if down is None:
            return None
        why = f"a node stopped before the cluster served: {down.text()}"
        return why if down.state is None else f"{why}; its last log lines:\n{self.nodes[down.rank].logs(40)}"

    def describe(self, logs: Path) -> dict[str, Any]:
        """The cluster in the check's result."""
        n = self.layout.nodes
        return {
            "nodes": n,
            "launch": LAUNCH_TEXT[self.layout.launch],
            "parallel": f"tensor parallel, {n} ranks, one a node",
            "master": f"{self.layout.master_addr}:{self.layout.master_port}",
            "interface": self.layout.interface,
            "machines": list(self.machines),
            "containers": [node.name for node in self.nodes],
            "logs": [str(path) for path in logs_of(logs, n).values()],
        }


def over_ssh(nodes: int, hosts: Sequence[Node], interface: str, *, launch: str = "vllm") -> tuple[Layout, list[Node]]:
    """The layout of a cluster whose head is this machine and whose other nodes are ``hosts`` (the first
    ``nodes - 1``), meeting on ``interface``: each node's address there, the head's the master's (with
    Ray, each node a machine of its own: Ray's default ports)."""
    if len(hosts) < nodes - 1:
        raise VerifyError(f"a cluster of {nodes} nodes needs {nodes - 1} other machine(s) besides this one; {len(hosts)} given")
    every = [Node(host=None), *hosts[: nodes - 1]]
    addresses = tuple(address(node, interface) for node in every)
    layout = Layout(
        nodes=nodes,
        master_addr=addresses[0],
        master_port=free_port(),
        api_port=free_port(),
        interface=interface,
        addresses=addresses,
        launch=launch,
    )
    return layout, every


@contextmanager
def places(engine: Engine, image: str, nodes: Sequence[Node], images: Sequence[str] = ()) -> Iterator[list[Place]]:
    """Where each node runs: this machine's ``engine`` for this machine, each other node's engine over
    ssh (kept open while the cluster runs); ``images``: each node's image where they differ."""
    refs = list(images) or [image] * len(nodes)
    with ExitStack() as stack:
        yield [
            Place(node=node, engine=engine if node.host is None else stack.enter_context(engine_of(node)), image=ref)
            for node, ref in zip(nodes, refs, strict=True)
        ]


@contextmanager
def cluster(
    check: Check,
    model: Path,
    folder: Path,
    *,
    places: Sequence[Place],
    model_name: str,
    layout: Layout,
    gpus: bool = False,
) -> Iterator[Cluster]:
    """Every node started, the watch on (the caller waits for the head: verify.wait_healthy, asking the
    cluster's ``stopped``); on the way out every node's log is kept in ``folder`` (``node-RANK.log``) and
    every node removed."""
    present_everywhere(places)
    identity = same_build(places)
    if layout.launch == "ray":
        has_ray(places[0])
    model_everywhere(places, model.resolve())
    meets = "Ray's head port, ray start --port" if layout.launch == "ray" else "vLLM's --master-port"
    port_free(layout.master_addr, layout.master_port, f"where the head meets its nodes ({meets})")
    port_free(LOOPBACK, layout.api_port, "the head's OpenAI API")
    caches = jitcache.for_image(identity)
    token = secrets.token_hex(4)
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        nodes: list[Container] = []
        for rank, place in enumerate(places):
            command = ["/model", *check.serve_args, *node_args(layout, rank)]
            if rank == 0:
                command[1:1] = ["--host", LOOPBACK, "--port", str(layout.api_port), "--served-model-name", model_name]
            entrypoint, mounts = None, {model.resolve(): "/model"}
            if layout.launch == "ray":
                serve = [*place.engine.inspect(place.image)["Config"]["Entrypoint"], *command]
                entrypoint, command = ray_command(layout, rank, serve)
                if rank == 0:
                    mounts[ray_head_file()] = RAY_HEAD
            environment = {**jitcache.environment(), **node_environment(layout, rank)}
            node = stack.enter_context(
                place.engine.run(
                    place.image,
                    command,
                    name=f"{CONTAINER_PREFIX}{token}-{rank}",
                    mounts=mounts,
                    caches=caches,
                    environment=environment,
                    gpus=gpus,
                    entrypoint=entrypoint,
                )
            )
            stack.callback(_keep_log, node, logs_of(folder, len(places))[rank])
            nodes.append(node)
        watch = stack.enter_context(Watch(nodes))
        yield Cluster(
            url=f"http://{LOOPBACK}:{layout.api_port}",
            nodes=tuple(nodes),
            watch=watch,
            layout=layout,
            image_id=identity,
            machines=tuple(place.node.name for place in places),
        )


def _keep_log(node: Container, path: Path) -> None:
    path.write_text(node.logs(tail=None))


def logs_of(folder: Path, nodes: int) -> Mapping[int, Path]:
    """Where each node's log is kept."""
    return {rank: folder / f"node-{rank}.log" for rank in range(nodes)}
