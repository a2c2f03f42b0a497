"""``sparkbuild run IMAGE MODEL --node HOST``: one model served by this machine and other Sparks together.

This machine is the head (node 0, the OpenAI API); each ``--node`` is another, reached with the user's own
``ssh`` (its config, keys and user; never a password prompt: ``BatchMode``). The cluster is vLLM's own
multi-node launch, the same arguments verify's ``multi_node`` check uses (``sparkbuild/verify/multinode.py``:
tensor parallel, one rank a node). Before anything starts, every node is asked, and one clear message
stops the run with nothing started anywhere:

- the node answers over SSH;
- it has the image, and the same build as the head (the image ID of the same reference);
- it runs no other sparkbuild cluster node (a second ``run`` on the same nodes);
- it has an IPv4 address on the interface the nodes share (``--interface``: the QSFP link), which every
  node's ranks use (``VLLM_HOST_IP``, ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``).

Then the head starts, then each node, all detached with the settings ``sparkbuild run`` gives one Spark
(host IPC and network, the GPUs, the caches on volumes); the endpoint is printed and the head's log
followed. Ctrl-C, or the head's end, removes every node's container.

``--launch ray`` forms the cluster with Ray instead, as vLLM's ``run_cluster.sh`` does (the same code as
verify's ``multi_node: {launch: ray}``): ``ray start`` on every node, then ``vllm serve
--distributed-executor-backend ray`` on the head once every node has joined; the image must carry Ray
(sparkbuild's Spark images do), which is asked before anything starts.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sparkbuild.errors import ConfigError, EngineError
from sparkbuild.lanes import launch
from sparkbuild.oci.remote import Node, address, has_folder
from sparkbuild.plan.matrix import cluster_flags
from sparkbuild.util import cmd, log, signals
from sparkbuild.verify import multinode

# Every node's container carries it: a second run finds the first by it.
LABEL = "io.sparkbuild.cluster"
# Every node's container is named so, then the run's ID and the rank (sparkbuild-cluster-ID-RANK).
CONTAINER_PREFIX = "sparkbuild-cluster-"
# Where the nodes meet on the head by default: vLLM's own --master-port; Ray's own head port.
MASTER_PORT = {"vllm": 29501, "ray": 6379}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """What ``run --node`` starts: the launch as for one Spark, the other nodes, the link they share."""

    launch: launch.Launch
    nodes: tuple[Node, ...]
    interface: str
    master_port: int | None = None
    # "vllm" (its own multi-node launch) or "ray".
    launch_with: str = "vllm"

    @property
    def port(self) -> int:
        return self.master_port if self.master_port is not None else MASTER_PORT[self.launch_with]


def image_id(node: Node, image: str) -> str:
    done = node.run([launch.docker(), "image", "inspect", "--format", "{{.Id}}", image], check=False)
    if done.returncode != 0:
        raise EngineError(
            f"{node.name} has no image {image}: pull it there first (docker pull {image}), the same build as on every node"
        )
    return done.stdout.strip()


def running_nodes(node: Node) -> list[str]:
    """The sparkbuild cluster nodes' containers already on ``node``."""
    args = [launch.docker(), "ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"]
    return node.run(args).stdout.split()


def preflight(cluster: Cluster) -> tuple[tuple[Node, ...], multinode.Layout]:
    """Every node asked before any starts (this machine first): reachable, the same image build, no other
    cluster node running, an address on the interface. Returns the nodes and where they meet."""
    nodes = (Node(host=None), *cluster.nodes)
    image = cluster.launch.image
    ids = {node.name: image_id(node, image) for node in nodes}
    head = ids[nodes[0].name]
    for name, found in ids.items():
        if found != head:
            raise EngineError(
                f"{name} has another build of {image} ({found}) than this machine ({head}): every node must run the "
                "same image; pull this machine's build on every node by its digest (docker image inspect --format "
                f"'{{{{index .RepoDigests 0}}}}' {image} names it)"
            )
    for node in nodes:
        if busy := running_nodes(node):
            raise EngineError(
                f"{node.name} already runs a sparkbuild cluster node ({', '.join(busy)}): stop that run first "
                f"(Ctrl-C where it runs, or docker rm --force {' '.join(busy)} on {node.name})"
            )
    folder = Path(cluster.launch.model)
    if folder.is_dir():
        for node in nodes[1:]:
            if not has_folder(node, folder.resolve()):
                raise ConfigError(
                    f"{cluster.launch.model} is a folder here and {node.name} has none at {folder.resolve()}: every node reads "
                    "the weights itself; copy the folder there, to the same path (or serve a Hub id)"
                )
    addresses = tuple(address(node, cluster.interface) for node in nodes)
    if cluster.launch_with == "ray":
        has_ray(image)
    layout = multinode.Layout(
        nodes=len(nodes),
        master_addr=addresses[0],
        master_port=cluster.port,
        api_port=cluster.launch.port,
        interface=cluster.interface,
        addresses=addresses,
        launch=cluster.launch_with,
    )
    return nodes, layout


def has_ray(image: str) -> None:
    """The image carries Ray's ``ray`` command (the same build runs on every node, asked above)."""
    done = cmd.run([launch.docker(), "run", "--rm", "--network", "none", "--entrypoint", "ray", image, "--version"],
                   capture=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise ConfigError(
            f"--launch ray: {image} has no Ray (`ray --version` in it: {done.stderr.strip()[-300:] or done.returncode}); "
            "serve it with vLLM's own launch (leave --launch out), or use an image with Ray (sparkbuild's Spark images carry it)"
        )


def entrypoint_of(image: str) -> list[str]:
    """The image's own entrypoint (the serve wrapper), which Ray's head runs once every node has joined."""
    done = cmd.run([launch.docker(), "image", "inspect", "--format", "{{json .Config.Entrypoint}}", image], capture=True)
    return [str(part) for part in json.loads(done.stdout or "null") or []]


def node_command(
    cluster: Cluster, layout: multinode.Layout, rank: int, name: str, gpus: bool, entrypoint: Sequence[str] = ()
) -> list[str]:
    """The ``docker run`` of node ``rank``: sparkbuild run's options for one Spark, the node's addresses, its
    label; with Ray, ``ray start`` (the head's launcher runs the image's ``entrypoint`` once every node joined)."""
    spec = replace(cluster.launch, name=name, detach=True)
    options, model = launch.options_and_model(spec, gpus, multinode.node_environment(layout, rank))
    options += ["--label", f"{LABEL}={name.rsplit('-', 1)[0]}"]
    api = ["--port", str(layout.api_port)] if rank == 0 else []
    serve = [model, *api, *spec.args, *multinode.node_args(layout, rank)]
    if layout.launch != "ray":
        return [*options, spec.image, *serve]
    program, command = multinode.ray_command(layout, rank, [*entrypoint, *serve], dashboard=None)
    if rank == 0:
        options += ["--volume", f"{multinode.ray_head_file()}:{multinode.RAY_HEAD}:ro"]
    return [*options, "--entrypoint", program, spec.image, *command]


def start(cluster: Cluster, *, follow: bool = True) -> list[str]:
    """Check every node, start them all, print the endpoint; with ``follow``, follow the head's log until
    Ctrl-C or its end, then remove every node. Returns the containers' names."""
    if cluster.launch.name:
        raise ConfigError("--name: a cluster names its nodes' containers itself (sparkbuild-cluster-ID-RANK); leave it out")
    if own := cluster_flags(cluster.launch.args):
        raise ConfigError(f"{own[0]}: `sparkbuild run --node` sets it on each node (tensor parallel over them); leave it out")
    nodes, layout = preflight(cluster)
    gpus = cluster.launch.gpus if cluster.launch.gpus is not None else launch.has_cuda(cluster.launch.image)
    entrypoint = entrypoint_of(cluster.launch.image) if layout.launch == "ray" else []
    run_id = f"{CONTAINER_PREFIX}{secrets.token_hex(4)}"
    started: list[tuple[Node, str]] = []
    try:
        for rank, node in enumerate(nodes):
            name = f"{run_id}-{rank}"
            held = signals.Held()  # Ctrl-C waits until the node is started and on the list to remove
            with held:
                node.run(node_command(cluster, layout, rank, name, gpus, entrypoint))
                started.append((node, name))
            held.deliver()
        who = ", ".join(n.name for n in nodes)
        log.info(f"serving on http://{layout.master_addr}:{layout.api_port}/v1 ({len(nodes)} nodes: {who})")
        if follow:
            follow_head(started[0][1])
    except BaseException:
        stop(started)
        raise
    if follow:
        code = head_exit(started[0][1])
        stop(started)
        if code != 0:
            raise EngineError(f"the head ({started[0][1]}) stopped with exit code {code} (its log is above); every node removed")
    return [name for _, name in started]


def follow_head(name: str) -> None:
    """The head's log on the terminal until it ends or Ctrl-C."""
    cmd.run([launch.docker(), "logs", "--follow", name], check=False)


def head_exit(name: str) -> int:
    """How the head ended, once its log has: its exit code (Docker's record)."""
    done = cmd.run([launch.docker(), "wait", name], capture=True, check=False)
    return int(done.stdout.strip() or 1) if done.returncode == 0 else 1


def stop(started: Sequence[tuple[Node, str]]) -> None:
    """Every started node's container removed, the last first; each failure said, none hiding the others."""
    for node, name in reversed(started):
        try:
            node.run([launch.docker(), "rm", "--force", name])
        except EngineError as exc:
            log.error(f"{exc}; remove it by hand: docker rm --force {name} on {node.name}")


# --- sparkbuild doctor --node ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One thing a node has or lacks for a multi-node run: ``ok`` True (has it), False (a run would fail
    on it), None (a run starts, and may break later: a warning)."""

    ok: bool | None
    what: str
    text: str

    def line(self) -> str:
        mark = {True: "ok", False: "MISSING", None: "WARNING"}[self.ok]
        return f"  {self.what}: {self.text} [{mark}]"


def remove_ipc(found: subprocess.CompletedProcess[str]) -> Finding:
    """systemd-logind's ``RemoveIPC`` from its merged configuration (``systemd-analyze cat-config``): when it
    is yes, its default, logind removes a user's shared memory and semaphores as the user's last session
    ends, so a multi-node run started from an SSH session that then closes loses NCCL's shared memory."""
    if found.returncode != 0:
        return Finding(
            ok=True, what="RemoveIPC", text="no systemd-logind configuration (systemd-analyze absent): nothing removes IPC"
        )
    value = "yes (its default)"
    for raw in found.stdout.splitlines():
        line = raw.strip()
        if line.startswith("RemoveIPC="):
            value = line.split("=", 1)[1].strip()
    if value.lower() in ("no", "false", "0", "off"):
        return Finding(ok=True, what="RemoveIPC", text="no: logind leaves shared memory alone")
    return Finding(
        ok=None,
        what="RemoveIPC",
        text=f"{value}: systemd-logind removes a user's shared memory when their last session ends, which kills a "
        "multi-node run's NCCL shared memory; set RemoveIPC=no in /etc/systemd/logind.conf and restart systemd-logind",
    )


def link(node: Node, interface: str) -> Finding:
    """The interface's address and whether its link is up."""
    try:
        where = address(node, interface)
    except ConfigError as exc:
        return Finding(ok=False, what=f"interface {interface}", text=str(exc))
    state = node.run(["ip", "-o", "link", "show", "dev", interface]).stdout
    up = "LOWER_UP" in state or "state UP" in state
    text = f"{where}, link {'up' if up else 'DOWN'}"
    return Finding(ok=up, what=f"interface {interface}", text=text)


def examine(node: Node, *, interface: str | None, image: str | None, head_id: str | None = None) -> tuple[Finding, ...]:
    """What ``node`` has and lacks for ``sparkbuild run --node``: SSH, the engine, the image (the head's
    build), an address on the interface with its link up, and systemd-logind's RemoveIPC."""
    try:
        node.run(["true"])
    except EngineError as exc:
        return (Finding(ok=False, what="ssh", text=str(exc)),)
    found = [Finding(ok=True, what="ssh", text="answers") if node.host else Finding(ok=True, what="host", text="this machine")]
    engine = node.run([launch.docker(), "version", "--format", "{{.Server.Version}}"], check=False)
    if engine.returncode != 0:
        found.append(Finding(ok=False, what="docker", text=f"no engine answers: {engine.stderr.strip()[-300:]}"))
    else:
        found.append(Finding(ok=True, what="docker", text=f"engine {engine.stdout.strip()}"))
        if image:
            found.append(_image(node, image, head_id))
    if interface:
        found.append(link(node, interface))
    found.append(remove_ipc(node.run(["systemd-analyze", "cat-config", "systemd/logind.conf"], check=False)))
    return tuple(found)


def _image(node: Node, image: str, head_id: str | None) -> Finding:
    try:
        found = image_id(node, image)
    except EngineError as exc:
        return Finding(ok=False, what="image", text=str(exc))
    if head_id is not None and found != head_id:
        return Finding(ok=False, what="image", text=f"{image} is {found} here, {head_id} on this machine: another build")
    return Finding(ok=True, what="image", text=f"{image} ({found})")
