"""The pure parts of ``sparkbuild run --node`` and ``doctor --node`` (sparkbuild/lanes/nodes.py): what a node's
systemd-logind says of RemoveIPC, read from the outputs ``systemd-analyze cat-config`` gives, and a command
as it travels to a node over ssh. tests/lanes/test_run_nodes.py runs both against a real SSH node."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from sparkbuild.lanes import nodes
from sparkbuild.oci.remote import Node

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
