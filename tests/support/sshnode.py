"""A second "Spark" reached over SSH, on this machine: an SSH server in a container on the loopback.

``sparkbuild run --node HOST`` reaches each node with the user's own ``ssh`` and runs ``docker`` and ``ip``
there. Here the node is a container of the local Debian base with Debian's openssh-server, iproute2 and
systemd (its files only: ``doctor --node`` reads logind's configuration as on a Spark; nothing runs it),
in the host's network namespace, its sshd listening on 127.0.0.1 alone, with keys made for the session;
the engine's socket and the host's docker client are mounted into it, so the ``docker`` a session runs
there drives this machine's engine, as the ``docker`` on a second Spark drives that Spark's, with one swap
(``DOCKER``: its host IPC namespace is its own). Or, where a test asks, a second engine of its own
(``second_engine``: another dockerd on this machine, empty), as a Spark that lacks the image.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkbuild.oci.engine import Engine
from sparkbuild.util.net import free_port
from tests.support.images import derived_image

# The one thing the node changes in what it is asked to run: a second Spark's host IPC namespace is its own,
# and this node's host is the head's, so `docker run --ipc host` there gets a private one instead. Measured:
# two nodes of one cluster in one IPC namespace hang at start-up (vLLM's shared-memory names meet), which two
# Sparks never do. The node's `docker` is this script, in front of the host's client.
DOCKER = """#!/bin/bash
args=()
for a in "$@"; do
  if [ "${args[-1]:-}" = --ipc ] && [ "$a" = host ]; then args+=(private --shm-size 1g); else args+=("$a"); fi
done
exec /usr/local/lib/docker-client "${args[@]}"
"""
STEPS = (
    "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
    "openssh-server iproute2 systemd && rm -rf /var/lib/apt/lists/* && mkdir -p /run/sshd"
)


@dataclass(frozen=True)
class SshNode:
    host: str
    config: Path
    # The SSH server's container: its log is sshd's.
    container: str


def log(engine: Engine, node: SshNode) -> str:
    """What the node's sshd has logged."""
    return str(engine.client.containers.get(node.container).logs().decode(errors="replace"))


def image(engine: Engine, base: str, folder: Path) -> str:
    return derived_image(engine, base, "sparkbuild-test/ssh-node:bookworm", STEPS, folder)


def keys(folder: Path) -> tuple[Path, Path]:
    """A host key and a client key pair, the client's public key authorized."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    shutil.copy(folder / "client_key.pub", folder / "authorized_keys")
    return folder / "host_key", folder / "client_key"


def config(folder: Path, hosts: dict[str, int], key: Path) -> Path:
    """An ssh config naming each host with its loopback port."""
    text = "".join(
        f"Host {host}\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        for host, port in hosts.items()
    )
    path = folder / "ssh_config"
    path.write_text(text)
    return path


@contextmanager
def running(
    engine: Engine,
    node_image: str,
    folder: Path,
    shared: list[Path],
    own: dict[Path, tuple[Path, str]] | None = None,
    docker_socket: Path = Path("/var/run/docker.sock"),
) -> Iterator[SshNode]:
    """The node serving SSH on a loopback port; ``shared``: host folders it sees at the same paths (a
    model folder); ``own``: paths where it sees a folder of its own instead (path -> (the host folder
    behind it, "rw" or "ro")), as a second machine has its own disk; ``docker_socket``: the engine its
    ``docker`` drives (this machine's, or ``second_engine``'s). The config also names ``unreachable``: a
    port nothing listens on."""
    _, client_key = keys(folder / "keys")
    port = free_port()
    docker = shutil.which("docker") or "/usr/bin/docker"
    volumes = {str(folder / "keys"): {"bind": "/keys", "mode": "ro"}}
    volumes[str(docker_socket)] = {"bind": "/var/run/docker.sock", "mode": "rw"}
    volumes[str(Path(docker).resolve())] = {"bind": "/usr/local/lib/docker-client", "mode": "ro"}
    (folder / "docker").write_text(DOCKER)
    (folder / "docker").chmod(0o755)
    volumes[str(folder / "docker")] = {"bind": "/usr/local/bin/docker", "mode": "ro"}
    volumes.update({str(p.resolve()): {"bind": str(p.resolve()), "mode": "ro"} for p in shared})
    volumes.update({str(behind): {"bind": str(path), "mode": mode} for path, (behind, mode) in (own or {}).items()})
    sshd = ["/usr/sbin/sshd", "-D", "-e", "-p", str(port), "-h", "/keys/host_key"]
    sshd += ["-o", "ListenAddress=127.0.0.1", "-o", "AuthorizedKeysFile=/keys/authorized_keys", "-o", "StrictModes=no"]
    sshd += ["-o", "PasswordAuthentication=no", "-o", "PermitRootLogin=prohibit-password"]
    # DEBUG1: sshd logs each channel it opens (a forwarded socket among them), which the tests read.
    sshd += ["-o", "LogLevel=DEBUG1"]
    # create, then start: the SDK's run pulls an image it does not find, from Docker Hub.
    container = engine.client.containers.create(
        node_image, sshd, name=f"sparkbuild-test-ssh-node-{secrets.token_hex(4)}", init=True, network_mode="host",
        volumes=volumes,
    )  # fmt: skip
    try:
        container.start()
        wait_listening(port, lambda: container.logs().decode(errors="replace"))
        yield SshNode(
            host="node-b",
            config=config(folder, {"node-b": port, "unreachable": free_port()}, client_key),
            container=container.name,
        )
    finally:
        container.remove(force=True)


@contextmanager
def second_engine() -> Iterator[Path]:
    """A second Docker engine on this machine, empty: Debian's dockerd with a data root, exec root and socket
    of its own (and so its own containerd), no bridge or iptables, as scripts/setup starts the first. A
    node whose ``docker`` drives it is a Spark without the image. Yields its socket; stopped and removed
    after. Skips where no second engine can start here (no dockerd, not root)."""
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip("a second Docker engine needs dockerd and root on this machine")
    # Short: containerd's socket under the exec root must fit a unix socket's 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="sb-d2-", dir="/var/tmp"))
    socket_path = root / "docker.sock"
    args = [dockerd, "--host", f"unix://{socket_path}", "--data-root", str(root / "data"), "--exec-root", str(root / "x")]
    args += ["--pidfile", str(root / "docker.pid"), "--bridge=none", "--iptables=false", "--ip-masq=false"]
    with (root / "dockerd.log").open("w") as out:
        daemon = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_answering(socket_path, daemon, root / "dockerd.log")
        yield socket_path
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        unmount_under(root)
        shutil.rmtree(root)


def unmount_under(root: Path) -> None:
    """What dockerd left mounted under ``root`` (its data root, bind-mounted onto itself), deepest first."""
    with open("/proc/self/mounts") as table:
        points = [line.split()[1] for line in table]
    for point in sorted((p for p in points if p == str(root) or p.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", point], check=True)


def wait_answering(socket_path: Path, daemon: subprocess.Popen[bytes], log_file: Path) -> None:
    for _ in range(300):
        if daemon.poll() is not None:
            break
        if answers(socket_path):
            return
        time.sleep(0.1)
    pytest.skip(f"a second Docker engine did not start here: {log_file.read_text()[-1000:]}")


def answers(socket_path: Path) -> bool:
    """Whether the engine at ``socket_path`` answers its API's ping (asked by hand: the SDK's client, made
    while the daemon starts, leaves its socket open when its first request fails)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(socket_path))
            probe.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in probe.recv(1024).split(b"\r\n", 1)[0]
        except OSError:
            return False


def wait_listening(port: int, logs: object) -> None:
    for _ in range(100):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"the SSH node never listened on 127.0.0.1:{port}: {logs() if callable(logs) else ''}")
