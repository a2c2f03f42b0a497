"""Commands sparkbuild runs: printed before they run, and never writing into sparkbuild's stdout,
which holds results alone (``--json``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparkbuild.util import cmd

CHATTY = ["sh", "-c", "echo chatter on stdout; echo chatter on stderr >&2"]


def test_a_commands_output_goes_to_stderr_and_stdout_stays_empty(capfd: pytest.CaptureFixture[str]) -> None:
    # debootstrap, making a base, wrote its progress into stdout: `rehearse --json` then printed it
    # before the JSON, and a script reading the JSON failed (bench/from_nothing.py, 2026-11-29).
    cmd.run(CHATTY)
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [cmd.show(CHATTY), "chatter on stdout", "chatter on stderr"]


def test_a_captured_commands_output_is_returned_apart() -> None:
    done = cmd.run(CHATTY, capture=True)
    assert (done.stdout, done.stderr) == ("chatter on stdout\n", "chatter on stderr\n")


def test_a_program_that_prints_json_after_running_commands_prints_only_json() -> None:
    # The way a script reads `sparkbuild ... --json`: its own process, stdout on a pipe.
    program = f"from sparkbuild.util import cmd; import json; cmd.run({CHATTY!r}); print(json.dumps({{'ok': True}}))"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == {"ok": True}
    assert "chatter on stdout" in done.stderr
