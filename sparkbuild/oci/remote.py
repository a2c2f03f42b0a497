"""Other machines, reached with the user's own ``ssh``: commands run there, and their Docker engine.

A node is this machine (``host`` None) or one ``ssh`` reaches: the user's config, keys and user
(``--ssh-config`` names another config), never a password prompt (``BatchMode``). Two things are
done on a node:

- a command (``Node.run``): ``ip``, ``test``, ``docker`` as a user would type them there;
- its engine (``engine_of``): OpenSSH forwards a socket here to the node's engine socket
  (``ssh -L LOCAL:REMOTE``, the forwarding OpenSSH has had since 6.7), and ``Engine`` drives it
  through that socket exactly as it drives this machine's, so a container there is started, watched,
  read and removed by the same code as one here. Docker's own ``ssh://`` transport would do the same
  by running ``docker system dial-stdio`` there, but neither the docker CLI nor the Python SDK passes
  ``ssh`` a config file (``-F``), and OpenSSH reads ``~/.ssh`` from the password database, not
  ``$HOME``: a runner's second Spark named in a config of its own could not be reached.
"""

from __future__ import annotations

import ipaddress
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.errors import ConfigError, EngineError
from sparkbuild.oci.engine import Engine
from sparkbuild.util import cmd, log

# Where a node's engine listens: Docker's default socket.
REMOTE_SOCKET = "/var/run/docker.sock"
CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True, kw_only=True)
class Node:
    """A machine of a cluster: this one (``host`` None) or one reached with ``ssh``."""

    host: str | None
    ssh_config: Path | None = None

    @property
    def name(self) -> str:
        return self.host or "this machine"

    def ssh(self, *options: str) -> list[str]:
        """``ssh`` to this node with the options every call takes, then ``options``, then the host."""
        if self.host is None:
            raise ValueError("this machine is reached without ssh")
        config = ["-F", str(self.ssh_config)] if self.ssh_config else []
        batch = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
        return ["ssh", *batch, *config, *options, self.host]

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run on this node: as they are here, else through ssh (each argument quoted for the
        remote shell, which ssh hands them to as one line)."""
        if self.host is None:
            return list(args)
        return [*self.ssh(), "--", shlex.join(args)]

    def run(self, args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            done = cmd.run(self.command(args), capture=True, check=False)
        except FileNotFoundError:  # not installed here: as a shell over ssh says it (exit 127)
            done = subprocess.CompletedProcess(list(args), 127, "", f"{self.command(args)[0]}: command not found")
        if done.returncode == 255 and self.host is not None:
            raise self.unreachable(done.stderr.strip()[-500:] or "exit 255")
        if check and done.returncode != 0:
            raise EngineError(f"{shlex.join(args)} failed on {self.name} (exit {done.returncode}): {done.stderr.strip()[-1000:]}")
        return done

    def unreachable(self, why: str) -> EngineError:
        return EngineError(
            f"cannot reach {self.host} over SSH ({why}): check that `ssh {self.host} true` works here without a "
            "password (a key, the host in ~/.ssh/config or the file --ssh-config names)"
        )


def address(node: Node, interface: str) -> str:
    """``node``'s IPv4 address on ``interface``."""
    done = node.run(["ip", "-4", "-o", "addr", "show", "dev", interface], check=False)
    for line in done.stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            return str(ipaddress.ip_interface(fields[fields.index("inet") + 1]).ip)
    raise ConfigError(
        f"--interface {interface}: {node.name} has no IPv4 address on it ({done.stderr.strip() or 'no inet line'}): give "
        "the interface of the link between the nodes (on a Spark pair, the QSFP port's; `ip -4 addr` lists them)"
    )


def has_folder(node: Node, folder: Path) -> bool:
    """Whether ``folder`` is a folder on ``node`` (at the same path)."""
    return node.run(["test", "-d", str(folder)], check=False).returncode == 0


def copy_folder(node: Node, folder: Path) -> None:
    """``folder`` copied to ``node`` at the same path: a tar stream over ssh (tar is on every machine; rsync
    need not be), written to a new folder beside it and renamed into place, so a copy cut short is never
    taken for the folder."""
    if node.host is None:
        raise ValueError("this machine has the folder already")
    parent, name = folder.parent, folder.name
    partial = f".{name}.partial"
    remote = (
        f"rm -rf {shlex.quote(partial)} && mkdir -p {shlex.quote(partial)} && tar -C {shlex.quote(partial)} -xf - && "
        f"mv {shlex.quote(partial)} {shlex.quote(name)}"
    )
    unpack = [*node.ssh(), "--", f"mkdir -p {shlex.quote(str(parent))} && cd {shlex.quote(str(parent))} && {remote}"]
    pack = ["tar", "-C", str(folder), "-cf", "-", "."]
    log.info(f"{cmd.show(pack)} | {cmd.show(unpack)[2:]}")
    # Leaving the block closes this end of the pipe before waiting on tar: a tar the remote side stopped
    # reading ends on SIGPIPE instead of waiting on a full pipe.
    with subprocess.Popen(pack, stdout=subprocess.PIPE) as tar:
        done = subprocess.run(unpack, stdin=tar.stdout, capture_output=True, text=True, check=False)
    if done.returncode == 255:
        raise node.unreachable(done.stderr.strip()[-500:] or "exit 255")
    if done.returncode != 0 or tar.returncode != 0:
        raise EngineError(
            f"could not copy {folder} to {node.host} (tar exit {tar.returncode}, remote exit {done.returncode}: "
            f"{done.stderr.strip()[-500:]}): make {parent} writable there, or copy the folder there yourself"
        )


@contextmanager
def engine_of(node: Node) -> Iterator[Engine]:
    """``node``'s Docker engine, driven from here: this machine's own where ``node`` is this machine,
    else through a socket OpenSSH forwards to the node's ``REMOTE_SOCKET`` for as long as it is used."""
    if node.host is None:
        yield Engine()
        return
    with tempfile.TemporaryDirectory(prefix="sparkbuild-ssh-") as tmp:
        local = Path(tmp) / "docker.sock"
        args = node.ssh("-o", "ExitOnForwardFailure=yes", "-N", "-T", "-L", f"{local}:{REMOTE_SOCKET}")
        log.info(cmd.show(args))
        errors = Path(tmp) / "ssh.err"
        with errors.open("w") as stderr:
            tunnel = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
        engine: Engine | None = None
        try:
            _wait_forwarded(node, tunnel, local, errors)
            engine = Engine(base_url=f"unix://{local}", where=f"{node.host}'s engine ({REMOTE_SOCKET}, forwarded over ssh)")
            yield engine
        finally:
            if engine is not None:
                engine.close()
            tunnel.terminate()
            tunnel.wait()


def _wait_forwarded(node: Node, tunnel: subprocess.Popen[bytes], local: Path, errors: Path) -> None:
    """Until ssh listens on ``local`` (it forwards from then on); ssh's own words if it ended first."""
    end = time.monotonic() + CONNECT_TIMEOUT_S + 5
    while not local.is_socket():
        code = tunnel.poll()
        if code is not None:
            why = errors.read_text(errors="replace").strip()[-500:] or f"exit {code}"
            if code == 255 and "forward" not in why.lower():
                raise node.unreachable(why)
            raise EngineError(
                f"ssh could not forward {node.host}'s Docker engine ({REMOTE_SOCKET}) here: {why}; the node's sshd must "
                "allow socket forwarding (AllowStreamLocalForwarding, its default) and its user reach the engine "
                "(the docker group)"
            )
        if time.monotonic() > end:
            tunnel.terminate()
            raise node.unreachable(f"no forwarded socket after {CONNECT_TIMEOUT_S + 5} s")
        time.sleep(0.05)
