"""`sparkbuild doctor` on the real host, held to what this test finds of the host itself (so it holds
on any machine), and the README's first command on a host that lacks what it needs: the report, one
error saying what to do, its exit code, and no work started."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from sparkbuild.plan import matrix
from sparkbuild.util import host
from sparkbuild.util.net import free_port
from tests.support import ROOT
from tests.support.cli import run as run_sparkbuild
from tests.support.matrix import LOCAL_PLATFORM, local_id


def engine_answers() -> bool:
    try:
        docker.from_env(timeout=10).ping()
    except docker.errors.DockerException:
        return False
    return True


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = run_sparkbuild("doctor", "--json", env={})
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def test_doctor_says_what_this_host_is(report: dict[str, Any]) -> None:
    facts = report["host"]
    assert facts["machine"] == platform.machine() and facts["platform"] == LOCAL_PLATFORM
    flags = host.cpu_flags(Path("/proc/cpuinfo").read_text())
    assert set(facts["cpu"]["features"]) <= flags
    assert facts["cpu"]["amx"] == ({"amx_tile", "amx_bf16"} <= flags)
    assert facts["cpu"]["avx512"] == ("avx512f" in flags)
    assert facts["platforms"][LOCAL_PLATFORM]["runs"] is True
    assert facts["engine"]["reachable"] is engine_answers()
    assert facts["registry"]["binary"] == shutil.which("docker-registry")
    assert facts["disks"][0]["what"] == "the cache" and facts["disks"][0]["free_gb"] > 0


def test_doctor_lists_the_gpus_nvidia_smi_lists(report: dict[str, Any]) -> None:
    gpus = report["host"]["gpus"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        assert gpus["found"] == [] and "nvidia-smi is not installed" in gpus["error"]
        return
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
    assert len(gpus["found"]) == sum(line.startswith("GPU ") for line in listed.splitlines())


def test_doctor_judges_every_target_and_check_of_the_matrix(report: dict[str, Any]) -> None:
    m = matrix.load(ROOT / "matrix.yaml")
    targets = {t["id"]: t for t in report["matrix"]["targets"]}
    assert list(targets) == [t.id for t in m.targets]
    for t in m.targets:
        assert [c["name"] for c in targets[t.id]["checks"]] == [c.name for c in t.checks]
    local = targets[local_id()]
    assert local["platform"] == LOCAL_PLATFORM
    # The local profile runs wherever the engine answers (setup's own machine, a Spark, a Xeon).
    can = report["host"]["engine"]["reachable"] and report["host"]["buildkit"]["command"] is not None
    assert local["runnable"] is bool(can and report["host"]["registry"]["binary"])
    spark = [t for t in targets.values() if t["profile"] == "spark"]
    has_spark_gpu = any(g["compute_cap"] == "12.1" for g in report["host"]["gpus"]["found"])
    if not has_spark_gpu:
        assert not any(t["runnable"] for t in spark)
    assert report["matrix"]["profiles"]["local"]["targets"] == 1


def test_doctor_text_is_a_short_table() -> None:
    done = run_sparkbuild("doctor", env={})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "sparkbuild doctor: this host"
    names = [line.split()[0] for line in lines[1:] if line.startswith("  ") and not line.startswith("   ")]
    assert names[:6] == ["machine", "CPU", "disk", "engine", "BuildKit", "runs"]
    assert any(line.strip().startswith(f"{local_id()} ") for line in lines)


def test_doctor_on_a_broken_matrix_reports_the_host_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "matrix.yaml").write_text("targets: [\n")
    done = run_sparkbuild("doctor", "--json", "--matrix", str(tmp_path / "matrix.yaml"), env={})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    found = json.loads(done.stdout)
    assert found["host"]["platform"] == LOCAL_PLATFORM and "YAML syntax error" in found["matrix"]["error"]


def test_doctor_where_there_is_no_matrix_yet_reports_the_host(tmp_path: Path) -> None:
    """Before `sparkbuild init`: the host alone, exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "SPARKBUILD_MATRIX"}
    done = subprocess.run(
        [sys.executable, "-m", "sparkbuild", "doctor", "--json"], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["matrix"] == {"file": None, "error": None, "profiles": {}, "targets": []}
    assert found["host"]["platform"] == LOCAL_PLATFORM


def nightly_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"SPARKBUILD_OUT": str(tmp_path / "out"), "SPARKBUILD_CACHE": str(tmp_path / "cache"), **extra}


def assert_nothing_started(done: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert "Traceback" not in done.stderr
    assert "sparkbuild doctor: this host" in done.stderr  # the report, then the one error
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "nothing was started" in error[0] and "`sparkbuild doctor`" in error[0]
    for sign_of_work in ("Building stage", "--progress plain", "debootstrap --variant", "Training model", "docker push"):
        assert sign_of_work not in done.stderr
    assert not (tmp_path / "cache" / "registry").exists() and not (tmp_path / "out" / "summary.json").exists()


def test_the_readme_command_with_no_engine_prints_the_report_and_exits_4(tmp_path: Path) -> None:
    nowhere = f"tcp://127.0.0.1:{free_port()}"  # a port nothing listens on: an engine that is not there
    done = run_sparkbuild("nightly", "--profile", "local", env=nightly_env(tmp_path, DOCKER_HOST=nowhere))
    assert done.returncode == 4, done.stderr[-3000:]
    assert_nothing_started(done, tmp_path)
    assert f"no Docker engine answers at {nowhere} ([Errno 111] Connection refused)" in done.stderr
    assert "NOT REACHABLE" in done.stderr


def test_a_local_target_for_a_platform_this_host_cannot_run_is_refused_before_any_work(tmp_path: Path) -> None:
    other = next(p for p in host.PLATFORM_MACHINES if p != LOCAL_PLATFORM)
    # A host without a handler for it: an empty binfmt_misc folder, since unregistering this host's
    # own handler (the arm64 tests register one) would change the host under every other test.
    (tmp_path / "binfmt_misc").mkdir()
    text = (ROOT / "matrix.yaml").read_text().replace("  - profile: local\n", f"  - profile: local\n    platform: {other}\n", 1)
    (tmp_path / "matrix.yaml").write_text(text)
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    for command in (("nightly", "--profile", "local"), ("build", "--profile", "local")):
        env = nightly_env(tmp_path, SPARKBUILD_BINFMT_MISC=str(tmp_path / "binfmt_misc"))
        done = run_sparkbuild(*command, "--matrix", str(tmp_path / "matrix.yaml"), env=env)
        assert done.returncode == 3, done.stderr[-3000:]
        assert_nothing_started(done, tmp_path)
        assert f"{other} images cannot run on this {LOCAL_PLATFORM} host: no binfmt_misc handler" in done.stderr
        assert "install qemu-user-static (QEMU >= 8" in done.stderr


def test_doctor_itself_never_fails_for_a_missing_engine(tmp_path: Path) -> None:
    done = run_sparkbuild("doctor", "--json", env={"DOCKER_HOST": f"tcp://127.0.0.1:{free_port()}"})
    assert done.returncode == 0 and "Traceback" not in done.stderr
    found = json.loads(done.stdout)
    assert found["host"]["engine"]["reachable"] is False
    assert all(not t["runnable"] for t in found["matrix"]["targets"])
