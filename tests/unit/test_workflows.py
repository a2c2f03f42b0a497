"""The GitHub workflows, checked offline: the workflow schema (check-jsonschema's vendored copy),
and the properties the lanes rely on."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from builder.cli import cli
from tests.conftest import ROOT

WORKFLOWS = ROOT / ".github" / "workflows"


def load(name: str) -> dict[Any, Any]:
    data: dict[Any, Any] = yaml.safe_load((WORKFLOWS / name).read_text())
    return data


def steps(workflow: dict[Any, Any]) -> list[dict[str, Any]]:
    return [s for job in workflow["jobs"].values() for s in job["steps"]]


def test_every_workflow_passes_the_github_workflow_schema() -> None:
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert [f.name for f in files] == ["ci.yml", "nightly.yml", "rc.yml"]
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.github-workflows", *map(str, files)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    runs = " ".join(s.get("run", "") for s in steps(load("ci.yml")))
    assert ".ci/run" in runs
    assert "scripts/setup && .venv/bin/pytest" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup && .venv/bin/pytest" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", ["nightly.yml", "rc.yml"])
def test_lanes_run_on_the_arm64_runner_one_at_a_time_and_are_never_cancelled(name: str) -> None:
    workflow = load(name)
    (job,) = workflow["jobs"].values()
    assert set(job["runs-on"]) >= {"self-hosted", "Linux", "ARM64"}
    assert workflow["concurrency"]["cancel-in-progress"] is False
    assert workflow["concurrency"]["group"] == f"sparkbuild-{name.removesuffix('.yml')}"
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    artifact = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert artifact["if"] == "always()" and artifact["with"]["path"] == "sparkbuild-out/"


@pytest.mark.parametrize("name", ["ci.yml", "nightly.yml", "rc.yml"])
def test_secrets_stay_out_of_commands_and_actions_are_pinned(name: str) -> None:
    workflow = load(name)
    for step in steps(workflow):
        assert "secrets." not in step.get("run", ""), step
        if "uses" in step:
            assert re.fullmatch(r"[\w-]+/[\w-]+@[0-9a-f]{40}", step["uses"]), step["uses"]
    for value in (workflow["jobs"][j].get("env", {}) for j in workflow["jobs"]):
        for key, expr in value.items():
            if "secrets." in str(expr):
                assert key.startswith("SPARKBUILD_REGISTRY"), key
    text = (WORKFLOWS / name).read_text()
    assert "--password-stdin" in text or "secrets." not in text
    assert "--password " not in text and "-p $" not in text


@pytest.mark.parametrize("name", ["nightly.yml", "rc.yml"])
def test_every_sparkbuild_command_in_the_lanes_exists_with_its_options(name: str) -> None:
    commands = [
        shlex.split(line.split("sparkbuild", 1)[1].replace('${ONLY:+--only "$ONLY"}', "").replace("$DRY_RUN", "--dry-run"))
        for step in steps(load(name))
        for line in step.get("run", "").splitlines()
        if ".venv/bin/sparkbuild " in line
    ]
    assert [c[0] for c in commands] == (["resolve", "nightly"] if name == "nightly.yml" else ["resolve", "rc"])
    for command, *args in commands:
        group = cli.commands[command]
        known = {o for p in group.params if isinstance(p, click.Option) for o in p.opts}
        assert {a for a in args if a.startswith("--")} <= known, (command, args)
