"""The pure parts of ``sparkbuild run --node`` and ``doctor --node`` (sparkbuild/lanes/nodes.py): what a node's
systemd-logind says of RemoveIPC, read from the outputs ``systemd-analyze cat-config`` gives, and a command
as it travels to a node over ssh. tests/lanes/test_run_nodes.py runs both against a real SSH node."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from sparkbuild.image import ray_head
from sparkbuild.lanes import launch, nodes
from sparkbuild.oci.remote import Node
from sparkbuild.verify import multinode

# Debian bookworm's logind.conf, as `systemd-analyze cat-config systemd/logind.conf` prints it (abridged).
DEBIAN = """\
# /etc/systemd/logind.conf
#  This file is part of systemd.
[Login]
#NAutoVTs=6
#KillUserProcesses=no
#RemoveIPC=yes
#InhibitorsMax=8192
"""
DROP_IN = DEBIAN + "\n# /etc/systemd/logind.conf.d/90-multi-node.conf\n[Login]\nRemoveIPC=no\n"


def analyzed(text: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["systemd-analyze"], code, stdout=text, stderr="")


def test_remove_ipc_at_its_default_is_a_warning_saying_what_to_set() -> None:
    found = nodes.remove_ipc(analyzed(DEBIAN))
    assert found.ok is None and found.text.startswith("yes (its default): ")
    assert "set RemoveIPC=no in /etc/systemd/logind.conf" in found.text


def test_remove_ipc_set_to_no_anywhere_later_is_fine() -> None:
    assert nodes.remove_ipc(analyzed(DROP_IN)).ok is True
    assert nodes.remove_ipc(analyzed(DROP_IN + "\n# /etc/systemd/logind.conf.d/99.conf\n[Login]\nRemoveIPC=yes\n")).ok is None


def test_a_node_without_systemd_has_nothing_that_removes_ipc() -> None:
    found = nodes.remove_ipc(analyzed("", code=127))
    assert found.ok is True and "nothing removes IPC" in found.text


def test_a_command_reaches_a_node_as_its_arguments_quoted_for_the_remote_shell(tmp_path: Path) -> None:
    node = Node(host="spark-b", ssh_config=tmp_path / "config")
    args = ["docker", "run", "--env", "A=b c", "img", "--chat-template", "{{ x }}; rm -rf /"]
    sent = node.command(args)
    assert sent[:2] == ["ssh", "-o"] and sent[sent.index("-F") + 1] == str(tmp_path / "config")
    assert sent[-2:] == ["--", shlex.join(args)] and shlex.split(sent[-1]) == args
    assert Node(host=None).command(args) == args  # this machine: as they are


def test_a_program_this_machine_lacks_answers_as_a_shell_over_ssh_would() -> None:
    """`ip` or `systemd-analyze` missing here: exit 127 as on a node over ssh, so doctor says what lacks it."""
    done = Node(host=None).run(["sparkbuild-no-such-program", "--version"], check=False)
    assert done.returncode == 127 and "command not found" in done.stderr
    assert nodes.remove_ipc(done).ok is True


# --- Ray (``run --node --launch ray``; verify's ``multi_node: {launch: ray}``) ----------------------------

SERVE_WRAPPER = ["python3", "/opt/sparkbuild/serve_defaults.py", "/opt/sparkbuild/serve-defaults.json", "vllm", "serve"]


def spark_pair(launch_with: str = "ray") -> tuple[nodes.Cluster, multinode.Layout]:
    spec = launch.Launch(image="ghcr.io/o/vllm-spark@sha256:" + "a" * 64, model="org/model", args=("--max-model-len", "8192"))
    cluster = nodes.Cluster(launch=spec, nodes=(Node(host="spark-b"),), interface="enp1s0f1np1", launch_with=launch_with)
    layout = multinode.Layout(
        nodes=2,
        master_addr="192.168.100.10",
        master_port=cluster.port,
        api_port=8000,
        interface="enp1s0f1np1",
        addresses=("192.168.100.10", "192.168.100.11"),
        launch=launch_with,
    )
    return cluster, layout


def test_with_ray_the_head_starts_rays_head_then_the_images_own_entrypoint_with_rays_executor() -> None:
    cluster, layout = spark_pair()
    assert cluster.port == 6379  # Ray's own head port; vLLM's launch meets on 29501
    assert nodes.Cluster(launch=cluster.launch, nodes=(), interface="x").port == 29501
    args = nodes.node_command(cluster, layout, 0, "sparkbuild-cluster-1-0", True, SERVE_WRAPPER)
    image = args.index(cluster.launch.image)
    assert args[image - 2 : image] == ["--entrypoint", "python3"]
    assert f"{multinode.ray_head_file()}:{multinode.RAY_HEAD}:ro" in args and "--gpus" in args
    assert args[image + 1 : image + 4] == [multinode.RAY_HEAD, "2", f"{multinode.RAY_JOIN_S:g}"]
    start, serve = args[image + 5 : args.index("--", image + 5)], args[args.index("--", image + 5) + 1 :]
    # The dashboard is Ray's own choice: asked for without ray[default] (the Spark image has ray[cgraph]), Ray refuses to start.
    assert start == ["--node-ip-address", "192.168.100.10", "--disable-usage-stats", "--port", "6379"]
    assert serve == [*SERVE_WRAPPER, "org/model", "--port", "8000", "--max-model-len", "8192",
                     "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]  # fmt: skip
    environment = [args[i + 1] for i, a in enumerate(args) if a == "--env"]
    assert {"VLLM_HOST_IP=192.168.100.10", "NCCL_SOCKET_IFNAME=enp1s0f1np1", "GLOO_SOCKET_IFNAME=enp1s0f1np1"} <= set(environment)
    # Every rank's lines in the head's log, each with its node's address: Ray's driver would fold rank 1's
    # "TP rank 1" into rank 0's "TP rank 0 [repeated 2x across cluster]" (seen in a warm run).
    assert "RAY_DEDUP_LOGS=0" in environment
    assert "RAY_DEDUP_LOGS" not in multinode.node_environment(spark_pair("vllm")[1], 0)


def test_with_ray_every_other_node_runs_ray_alone_joined_to_the_head() -> None:
    cluster, layout = spark_pair()
    args = nodes.node_command(cluster, layout, 1, "sparkbuild-cluster-1-1", True, SERVE_WRAPPER)
    image = args.index(cluster.launch.image)
    assert args[image - 2 : image] == ["--entrypoint", "ray"]
    assert args[image + 1 :] == ["start", "--block", "--node-ip-address", "192.168.100.11", "--disable-usage-stats",
                                 "--address", "192.168.100.10:6379"]  # fmt: skip
    assert not any(multinode.RAY_HEAD in a for a in args)  # the launcher is the head's alone
    assert "VLLM_HOST_IP=192.168.100.11" in args


def test_on_one_machine_each_ray_node_has_its_own_address_ports_and_one_gpu() -> None:
    """Two Ray nodes on this machine's loopback (the rehearsal): vLLM's Ray executor refuses two nodes at one
    address, and Ray's dashboard agent port and worker range are fixed by default."""
    layout = multinode.loopback(2, launch="ray")
    assert layout.addresses == ("127.0.0.2", "127.0.0.3") and layout.master_addr == "127.0.0.2"
    assert multinode.loopback(2).addresses == ("127.0.0.1", "127.0.0.1")  # vLLM's own launch: one address is fine
    head, worker = (multinode.ray_start_args(layout, rank) for rank in (0, 1))
    assert head[:6] == ["--node-ip-address", "127.0.0.2", "--disable-usage-stats", "--port", str(layout.master_port),
                        "--include-dashboard=false"]  # fmt: skip
    meet = f"127.0.0.2:{layout.master_port}"
    assert worker[:5] == ["--node-ip-address", "127.0.0.3", "--disable-usage-stats", "--address", meet]
    for own in (head, worker):
        assert own[own.index("--num-gpus") + 1] == "1"
        assert len(own[own.index("--worker-port-list") + 1].split(",")) == multinode.RAY_WORKER_PORTS
    agents = {own[own.index("--dashboard-agent-listen-port") + 1] for own in (head, worker)}
    assert len(agents) == 2 and "52365" not in agents
    # Every port the cluster takes is its own: Ray refuses a port two of its parts name (seen in a run: ports
    # asked one at a time came back twice).
    taken = [layout.master_port, layout.api_port]
    for own in (head, worker):
        taken += [int(own[own.index("--dashboard-agent-listen-port") + 1])]
        taken += [int(p) for p in own[own.index("--worker-port-list") + 1].split(",")]
    assert len(taken) == len(set(taken)) == 2 + 2 * (1 + multinode.RAY_WORKER_PORTS)
    assert multinode.node_args(layout, 0) == ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]


def test_the_ray_head_names_what_kept_the_cluster_from_serving() -> None:
    """ray_head.py's two endings after its bound (the one with a GPU missing is served for real in
    tests/verify/test_multi_node.py): a node that never joined, and the usage it refuses."""
    never = ray_head.missing(2, {"127.0.0.2": 1.0}, [])
    assert never.startswith("only 1 of 2 nodes joined the Ray cluster: every other node runs `ray start --address")
    assert ray_head.missing(2, {"127.0.0.2": 1.0, "127.0.0.3": 0.0}, ["127.0.0.3"]).startswith(
        "no GPU in Ray's resources on 127.0.0.3"
    )
    assert ray_head.main(["2", "300", "--", "--port", "6379"]) == ray_head.USAGE  # no serve command
    found = ray_head.parse(["2", "30", "--", "--port", "1", "--", "vllm", "serve"])
    assert found == (2, 30.0, ["--port", "1"], ["vllm", "serve"])
