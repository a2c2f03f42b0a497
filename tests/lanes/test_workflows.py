"""The GitHub workflows, checked offline: the workflow schema (check-jsonschema's vendored copy),
and the properties the lanes rely on."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbuild.cli import cli
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.plan import plan
from tests.support import ROOT
from tests.support.cli import in_process as sparkbuild

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


LANES = ["nightly.yml", "rc.yml"]
RUNNERS = """${{ fromJSON(vars.SPARKBUILD_RUNNER_LABELS || '["self-hosted","Linux","ARM64"]') }}"""


def runner_default(runs_on: str) -> list[str]:
    """The labels a ``runs-on`` expression gives when the repository variable is not set."""
    found = re.fullmatch(r"\$\{\{ fromJSON\(vars\.SPARKBUILD_RUNNER_LABELS \|\| '(.*)'\) \}\}", runs_on)
    assert found, runs_on
    labels: list[str] = json.loads(found.group(1))
    return labels


@pytest.mark.parametrize("name", LANES)
def test_lanes_fan_out_over_the_arm64_runners_one_run_at_a_time_and_are_never_cancelled(name: str) -> None:
    workflow = load(name)
    jobs = workflow["jobs"]
    # The nightly also writes the report site from the registry and hands it to GitHub Pages.
    assert list(jobs) == ["plan", "build", "summary", *(["report"] if name == "nightly.yml" else [])]
    for job in jobs.values():
        assert set(runner_default(job["runs-on"])) >= {"self-hosted", "Linux", "ARM64"}
    assert workflow["concurrency"]["cancel-in-progress"] is False
    assert workflow["concurrency"]["group"] == f"sparkbuild-{name.removesuffix('.yml')}"
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    build = jobs["build"]
    assert build["needs"] == "plan" and build["if"] == "needs.plan.outputs.targets != '[]'"
    assert build["strategy"] == {
        "fail-fast": False,
        "max-parallel": "${{ fromJSON(vars.SPARKBUILD_MAX_PARALLEL || '2') }}",
        "matrix": {"target": "${{ fromJSON(needs.plan.outputs.targets) }}"},
    }
    lane = name.removesuffix(".yml")
    artifact = next(s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert artifact["if"] == "always()" and artifact["with"]["path"] == "sparkbuild-out/"
    assert artifact["with"]["name"] == f"{lane}-${{{{ github.run_id }}}}-${{{{ matrix.target }}}}"
    assert build["steps"][-1] == {"name": "Log out", "if": "always()", "run": 'docker logout "$SPARKBUILD_REGISTRY"'}
    summary = jobs["summary"]
    assert summary["needs"] == ["plan", "build"] and summary["if"].startswith("always()")
    download = next(s for s in summary["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"]["pattern"] == f"{lane}-${{{{ github.run_id }}}}-*"
    assert f'--prefix "{lane}-$GITHUB_RUN_ID-"' in summary["steps"][-1]["run"]


@pytest.mark.parametrize("name", LANES)
def test_every_target_job_builds_with_the_plan_jobs_lock(name: str) -> None:
    jobs = load(name)["jobs"]
    (upload,) = (s for s in jobs["plan"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    (download,) = (s for s in jobs["build"]["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert upload["with"]["name"] == download["with"]["name"]
    assert upload["with"]["path"] == "sparkbuild-out/matrix.lock.json" and download["with"]["path"] == "sparkbuild-out/"
    for job in ("plan", "build"):
        assert jobs[job]["env"]["SPARKBUILD_LOCK"] == "${{ github.workspace }}/sparkbuild-out/matrix.lock.json"
    assert "resolve" not in " ".join(s.get("run", "") for s in jobs["build"]["steps"])


@pytest.mark.parametrize("name", LANES)
def test_no_expression_is_pasted_into_a_script(name: str) -> None:
    # An expression in `run:` text becomes shell code before the shell runs (script injection); the
    # target, the inputs and the planned ids reach scripts through `env:` only.
    for step in steps(load(name)):
        assert "${{" not in step.get("run", ""), step
    build = load(name)["jobs"]["build"]
    assert build["env"]["TARGET"] == "${{ matrix.target }}"
    assert any('--only "$TARGET"' in s.get("run", "") for s in build["steps"])
    assert load(name)["jobs"]["summary"]["env"]["TARGETS"] == "${{ needs.plan.outputs.targets }}"


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
                assert key.startswith(("SPARKBUILD_REGISTRY", "SPARKBUILD_COSIGN_KEY")) or key == "COSIGN_PASSWORD", key
    text = (WORKFLOWS / name).read_text()
    assert "--password-stdin" in text or "secrets." not in text
    assert "--password " not in text and "-p $" not in text


# What the shell gives the lanes' commands in place of their variables.
SHELL_VALUES = {
    '${ONLY:+--only "$ONLY"}': "--only vllm-*",
    "$DRY_RUN": "--dry-run",
    "$SPARKBUILD_LOCK": "matrix.lock.json",
    "$TARGETS": '["vllm-0.33.0-cu130-sm121"]',
    "$TARGET": "vllm-0.33.0-cu130-sm121",
    "$GITHUB_RUN_ID": "4242",
}


def sparkbuild_commands(name: str, job: str | None = None) -> list[list[str]]:
    """Each ``.venv/bin/sparkbuild`` command line of a workflow (of one job), as the shell splits it."""
    jobs = [load(name)["jobs"][job]] if job else load(name)["jobs"].values()
    lines = [line for j in jobs for s in j["steps"] for line in s.get("run", "").splitlines() if ".venv/bin/sparkbuild " in line]
    commands = []
    for line in lines:
        text = line.split(".venv/bin/sparkbuild ", 1)[1].removesuffix(")")  # `$(...)`: the command inside
        for variable, value in SHELL_VALUES.items():
            text = text.replace(variable, value)
        commands.append(shlex.split(text))
    return commands


@pytest.mark.parametrize("name", LANES)
def test_every_sparkbuild_command_in_the_lanes_exists_with_its_options(name: str) -> None:
    commands = sparkbuild_commands(name)
    lane = name.removesuffix(".yml")
    # The nightly's target job runs gc after publishing, for its own target; its last job writes the report.
    gc, report = (["gc"], ["report"]) if lane == "nightly" else ([], [])
    assert [c[0] for c in commands] == ["resolve", "plan", lane, *gc, "summary", *report]
    for command, *args in commands:
        # click parses them as it would on the runner: an unknown option or a bad choice raises.
        cli.commands[command].make_context(command, list(args))


@pytest.mark.parametrize("name", LANES)
def test_the_plan_jobs_targets_give_one_build_job_per_target_that_only_selects(name: str) -> None:
    lane = name.removesuffix(".yml")
    (plan_cmd,) = (c for c in sparkbuild_commands(name, "plan") if c[0] == "plan")
    assert plan_cmd[plan_cmd.index("--lock") + 1] == SHELL_VALUES["$SPARKBUILD_LOCK"]
    # As on the runner, less the lock file (this checkout has none) and the dispatch's `only`.
    args = [a for i, a in enumerate(plan_cmd) if "--lock" not in (a, plan_cmd[i - 1]) and "--only" not in (a, plan_cmd[i - 1])]
    done = sparkbuild(*args, "--matrix", str(ROOT / "matrix.yaml"))
    assert done.code == 0, done.err
    output = done.out.strip()
    assert "\n" not in output  # one `targets=<json>` line of $GITHUB_OUTPUT
    # Actions: matrix.target takes each value of fromJSON(needs.plan.outputs.targets), one job each.
    jobs = [{"target": value} for value in json.loads(output)]
    m = plan.load_matrix(Options.from_env(matrix=ROOT / "matrix.yaml"))
    expected = [t.id for t in m.targets if t.lane == lane and t.profile == "spark"]
    assert [j["target"] for j in jobs] == expected and expected
    for job in jobs:
        one = sparkbuild(*args, "--matrix", str(ROOT / "matrix.yaml"), "--only", job["target"])
        assert json.loads(one.out) == [job["target"]], one.err
    # Each job selects its target as the plan did: the same profile, --only the id.
    build_cmd, *after = sparkbuild_commands(name, "build")
    assert build_cmd[0] == lane and build_cmd[build_cmd.index("--only") + 1] == SHELL_VALUES["$TARGET"]
    for command in after:  # gc keeps to the job's own target too
        assert command[command.index("--only") + 1] == SHELL_VALUES["$TARGET"]
    assert build_cmd[build_cmd.index("--profile") + 1] == plan_cmd[plan_cmd.index("--profile") + 1]


def test_an_empty_selection_stops_the_plan_job_and_no_empty_matrix_is_started() -> None:
    done = sparkbuild("plan", "--ids", "--matrix", str(ROOT / "matrix.yaml"), "--only", "no-such-target")
    assert done.code == ConfigError.exit_code and "no target matches --only no-such-target" in done.err
    for name in LANES:
        assert load(name)["jobs"]["build"]["if"] == "needs.plan.outputs.targets != '[]'"


def test_the_nightly_publishes_the_report_site_to_github_pages() -> None:
    job = load("nightly.yml")["jobs"]["report"]
    assert job["needs"] == ["plan", "build"] and job["if"] == "always() && needs.plan.result == 'success'"
    # Pages takes a deployment only from a job with these, in the github-pages environment.
    assert job["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    assert job["environment"]["name"] == "github-pages"
    (command,) = sparkbuild_commands("nightly.yml", "report")
    site = command[command.index("--site") + 1]
    (upload,) = (s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact@"))
    assert upload["with"]["path"].rstrip("/") == site
    assert job["steps"][-1]["uses"].startswith("actions/deploy-pages@") and job["steps"][-1]["id"] == "deployment"


@pytest.mark.parametrize("name", LANES)
def test_a_target_job_outlives_the_build_bound_so_a_hung_step_is_named_first(name: str) -> None:
    """A step that hangs is stopped by sparkbuild's build bound, which names it (engine ``Bound``),
    well before GitHub ends the job, which names nothing (the job's limit is twice the bound)."""
    defaults = yaml.safe_load((ROOT / "sparkbuild/resources/defaults.yaml").read_text(encoding="utf-8"))
    bound = defaults["target"]["build_timeout_minutes"]
    assert load(name)["jobs"]["build"]["timeout-minutes"] >= 2 * bound


@pytest.mark.parametrize("name", ["nightly.yml", "rc.yml"])
def test_the_target_jobs_take_the_runner_pairs_second_spark_from_the_repositorys_variables(name: str) -> None:
    """verify starts a check's second node on the Spark SPARKBUILD_NODES names (sparkbuild/verify/multinode.py);
    the variables come from the repository's settings, never written into the workflow."""
    jobs = load(name)["jobs"]
    env = jobs["build"]["env"]
    assert env["SPARKBUILD_NODES"] == "${{ vars.SPARKBUILD_NODES }}"
    assert env["SPARKBUILD_NODE_INTERFACE"] == "${{ vars.SPARKBUILD_NODE_INTERFACE }}"
