"""sparkbuild installed as a team installs it: the wheel built from this checkout, installed (not
editable) into a fresh venv, run from a folder that holds only the team's matrix.yaml. Nothing may
come from the checkout: the templates and patches are the wheel's package data.

The venv's dependencies come from PyPI through uv (its cache makes a second run take seconds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, cli
from tests.support.matrix import PATCH_YAML, local_id, quick_checks

SPARK_ID = "vllm-0.33.0-cu130-sm121"
# The checkout's working files that are not sparkbuild's sources.
# Left out of the copy the wheel is built from: anywhere, and at the top only (a package may have a
# folder named build).
NOT_SOURCES = (".git", ".venv", "sparkbuild-out", "*.egg-info", "__pycache__", ".*_cache")
NOT_SOURCES_AT_TOP = ("build", "dist")


def not_sources(folder: str, names: list[str]) -> set[str]:
    ignored = set(shutil.ignore_patterns(*NOT_SOURCES)(folder, names))
    return ignored | ({n for n in names if n in NOT_SOURCES_AT_TOP} if Path(folder) == ROOT else set())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The ``bin`` folder of a fresh venv with the wheel of this checkout installed."""
    from uv import find_uv_bin

    top = tmp_path_factory.mktemp("installed")
    source = top / "source"
    # A copy, so that building the wheel writes nothing (build/, *.egg-info) into the checkout.
    shutil.copytree(ROOT, source, ignore=not_sources)
    wheels = top / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", wheels, source)
    (wheel,) = wheels.glob("sparkbuild-*.whl")
    uv = str(find_uv_bin())
    run(uv, "venv", "--quiet", "--python", sys.executable, top / "venv")
    run(uv, "pip", "install", "--quiet", "--python", top / "venv" / "bin" / "python", wheel)
    yield top / "venv" / "bin"


def run(
    *args: object, cwd: Path | None = None, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKBUILD_", "VIRTUAL_ENV", "PYTHON"))}
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env={**clean, **(env or {})}, capture_output=True, text=True, check=check
    )


def sparkbuild(
    bin_dir: Path, folder: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return cli.run(*args, command=(bin_dir / "sparkbuild",), cwd=folder, check=check, env=env, inherit=False)


def plan_json(bin_dir: Path, folder: Path, *args: str) -> dict[str, Any]:
    plans: list[dict[str, Any]] = json.loads(sparkbuild(bin_dir, folder, "plan", "--json", *args).stdout)
    return {p["id"]: p for p in plans}


def packaged_resources(bin_dir: Path) -> Path:
    """The installed package's resources/ folder (stage templates, patches, defaults)."""
    return site_packages(bin_dir) / cli.PACKAGE / "resources"


def site_packages(bin_dir: Path) -> Path:
    (found,) = (bin_dir.parent / "lib").glob("python3*/site-packages")
    return found


@pytest.fixture
def team(installed: Path, tmp_path: Path) -> Path:
    """A team's repository: an empty folder, then ``sparkbuild init``'s matrix.yaml."""
    folder = tmp_path / "team"
    folder.mkdir()
    sparkbuild(installed, folder, "init")
    assert sorted(p.name for p in folder.iterdir()) == ["matrix.yaml"]
    return folder


def test_plan_in_a_folder_with_only_a_matrix_uses_the_packaged_templates_and_patches(installed: Path, team: Path) -> None:
    plans = plan_json(installed, team)
    packaged = packaged_resources(installed)
    for p in plans.values():
        templates = p["found"]["templates"]
        assert templates == {"path": str(packaged / "dockerfiles" / p["profile"]), "origin": "packaged"}
    assert plans[SPARK_ID]["found"]["patches"] == {
        name: {"path": str(packaged / "patches" / name), "origin": "packaged"} for name in ("cmake-arch-sm121", "e2m1-software")
    }
    text = sparkbuild(installed, team, "plan").stdout
    assert str(ROOT) not in text and f"templates: {packaged / 'dockerfiles' / 'spark'} (packaged)" in text


def test_a_patch_of_the_team_is_used_and_moves_the_tag(installed: Path, team: Path) -> None:
    before = plan_json(installed, team)[SPARK_ID]
    extra = team / "patches" / "extra"
    extra.mkdir(parents=True)
    (extra / "patch.yaml").write_text(PATCH_YAML.format(name="extra"))
    (extra / "fix.diff").write_text("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n")
    matrix = team / "matrix.yaml"
    shipped = "patches: [cmake-arch-sm121, e2m1-software]"
    matrix.write_text(matrix.read_text().replace(shipped, shipped.replace("]", ", extra]")))
    with_extra = plan_json(installed, team)[SPARK_ID]
    assert with_extra["found"]["patches"]["extra"] == {"path": str(extra), "origin": "the matrix's patches"}
    assert with_extra["found"]["patches"]["e2m1-software"]["origin"] == "packaged"
    assert with_extra["content_tag"] != before["content_tag"]
    (extra / "fix.diff").write_text("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+c\n")
    assert plan_json(installed, team)[SPARK_ID]["content_tag"] != with_extra["content_tag"]
    assert f"extra ({extra} (the matrix's patches))" in sparkbuild(installed, team, "plan").stdout
    # The render holds the team's patch beside the packaged ones and the packaged patch engine.
    sparkbuild(installed, team, "render", "--only", SPARK_ID, "--out", "rendered")
    contexts = {p.relative_to(team / "rendered" / SPARK_ID).as_posix() for p in (team / "rendered").rglob("*") if p.is_file()}
    assert any(c.endswith("/patches/extra/fix.diff") for c in contexts)
    assert any(c.endswith(f"/sparkbuild/{cli.PACKAGE}/patch/__main__.py") for c in contexts)


def test_a_profile_of_the_team_wins_over_the_packaged_one(installed: Path, team: Path) -> None:
    before = plan_json(installed, team)["vllm-0.32.0-cpu-amd64"]
    shutil.copytree(packaged_resources(installed) / "dockerfiles" / "local", team / "dockerfiles" / "local")
    runtime = team / "dockerfiles" / "local" / "90-runtime.Dockerfile.j2"
    runtime.write_text(runtime.read_text() + "# the team's own line\n")
    after = plan_json(installed, team)
    assert after[local_id()]["found"]["templates"] == {
        "path": str(team / "dockerfiles" / "local"),
        "origin": "beside the matrix",
    }
    assert after[local_id()]["content_tag"] != before["content_tag"]
    assert after[SPARK_ID]["found"]["templates"]["origin"] == "packaged"  # no dockerfiles/spark here


def test_init_refuses_to_replace_a_matrix(installed: Path, team: Path) -> None:
    written = (team / "matrix.yaml").read_text()
    again = sparkbuild(installed, team, "init", check=False)
    assert again.returncode == 2 and "exists" in again.stderr and "never replaces" in again.stderr
    assert (team / "matrix.yaml").read_text() == written


def test_no_matrix_says_how_to_make_one(installed: Path, tmp_path: Path) -> None:
    result = sparkbuild(installed, tmp_path, "plan", check=False)
    assert result.returncode == 2
    assert f"{tmp_path / 'matrix.yaml'}: no such file" in result.stderr and "sparkbuild init" in result.stderr


def test_the_installed_tool_plans_what_the_checkout_plans(installed: Path, tmp_path: Path) -> None:
    """Every file that reaches a build context (templates, patches, the patch engine, image scripts)
    is in the wheel as it is here: the same matrix gives the same stage images and content tags."""
    shutil.copy(ROOT / "matrix.yaml", tmp_path / "matrix.yaml")
    here = cli.run("plan", "--json", env={"SPARKBUILD_DATE": "20261121"})
    assert here.returncode == 0
    there = json.loads(sparkbuild(installed, tmp_path, "plan", "--json", env={"SPARKBUILD_DATE": "20261121"}).stdout)

    def images(plans: list[dict[str, Any]]) -> dict[str, list[str]]:
        return {p["id"]: [p["content_tag"], *(s["ref"] for s in p["stages"])] for p in plans}

    assert images(there) == images(json.loads(here.stdout))


@pytest.mark.docker
@pytest.mark.slow
def test_the_installed_tool_runs_the_local_nightly_in_a_team_folder(
    installed: Path, team: Path, cache: Path, tmp_path: Path
) -> None:
    """The README's main job, from the wheel: build (or find) the image, verify it, publish it."""
    # The installed venv has no torch (that is sparkbuild[model]): the checkout makes the check model
    # in the session's cache, and the team's run gets a copy in a cache of its own. Its registry is
    # the session's storage (the image's layers pushed once per session), under a repository of its
    # own, so the local nightly test still publishes a fresh image to sparkbuild/vllm-cpu.
    made = cli.run("model", "alphabet", env={"SPARKBUILD_CACHE": str(cache)})
    assert made.returncode == 0
    model = Path(made.stdout.strip())
    own = tmp_path / "cache"
    shutil.copytree(model, own / model.relative_to(cache))
    (cache / "registry").mkdir(exist_ok=True)
    (own / "registry").symlink_to(cache / "registry")
    env = {"SPARKBUILD_CACHE": str(own), "SPARKBUILD_DATE": "20261121"}
    matrix = quick_checks(team / "matrix.yaml")
    matrix.write_text(matrix.read_text().replace("repository: sparkbuild/vllm-cpu", "repository: sparkbuild-test/team-vllm-cpu"))
    assert "sparkbuild-test/team-vllm-cpu" in matrix.read_text()
    done = sparkbuild(installed, team, "nightly", "--profile", "local", "--json", env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)
    assert row["status"] == "published" and row["digest"].startswith("sha256:")
    verified = json.loads((team / "sparkbuild-out" / row["target"] / "verify.json").read_text())
    assert verified["ok"] is True and {a["received"] for a in verified["answers"]} == {" g h i j", " q r s t"}
