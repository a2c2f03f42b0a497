"""Runs side by side and runs that go wrong, for real: two nightlies on one cache (the run lock), a
cache on a 64 MiB tmpfs (the disk check), and a target whose stage hits a real Docker error while
the next target goes on (per-target isolation)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.errors import LaneFailed
from sparkbuild.lanes import pipeline
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import embedded
from sparkbuild.plan import plan
from sparkbuild.plan.plan import TargetPlan
from sparkbuild.publish import attest, provenance, publish
from sparkbuild.verify import layout, verify
from tests.support import ROOT, cli
from tests.support.matrix import CHECKS, local_target

pytestmark = pytest.mark.docker


def matrix(folder: Path, target_id: str, repository: str = "sparkbuild-t17/runs") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{target_id}.yaml"
    path.write_text(CHECKS + "targets:\n" + local_target(id=target_id, repository=repository))
    return path


def plan_of(path: Path, cache: Path, out: Path) -> TargetPlan:
    (p,) = plan.make(Options.from_env(matrix=path, date="20261121", cache=cache, out=out))
    return p


def checked_already(engine: Engine, p: TargetPlan, image: str, matrix_file: Path, folder: Path) -> attest.Evidence:
    """Evidence whose every check's result says it was skipped (this stand-in image serves nothing):
    attached, it counts as the check's result, so a nightly finds nothing to run on the image."""
    files = layout.result_files(folder / "verify.json", p.target.checks)
    identity = str(engine.inspect(image)["Id"])
    for check in p.target.checks:
        verify.write_skipped(files[check.name], check, image, identity, "the run-lock test's stand-in image serves nothing")
    return attest.Evidence(files=provenance.Files(matrix=matrix_file, lock=None), verify=files, local=image)


class Run:
    """``sparkbuild ARGS`` in a new process; its stderr is read as it comes."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.proc = cli.start(*args, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no '{text}' in:\n{''.join(self.lines)[-3000:]}")

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return code

    @property
    def err(self) -> str:
        return "".join(self.lines)


def lock_holder(cache: Path) -> int | None:
    try:
        return int(json.loads((cache / "run.lock").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def test_two_nightlies_on_one_cache_take_turns(engine: Engine, base: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = matrix(tmp_path, "t17-lock")
    p = plan_of(path, cache, tmp_path / "out")
    with embedded(cache / "registry") as registry:  # published already: each nightly moves tags only
        publish.push(engine, registry, p, base, evidence=checked_already(engine, p, base, path, tmp_path / "verified"))
    env = {"SPARKBUILD_CACHE": str(cache), "SPARKBUILD_REGISTRY": "", "SPARKBUILD_DATE": "20261121"}
    first = Run("nightly", "--matrix", str(path), env={**env, "SPARKBUILD_OUT": str(tmp_path / "out1")})
    deadline = time.monotonic() + 60
    while lock_holder(cache) != first.proc.pid and time.monotonic() < deadline:
        time.sleep(0.02)
    # Hold the first one mid-run (a real signal), so the second surely meets it.
    first.proc.send_signal(signal.SIGSTOP)
    try:
        second = Run("nightly", "--matrix", str(path), env={**env, "SPARKBUILD_OUT": str(tmp_path / "out2")})
        waiting = second.wait_for("waiting for the run lock")
        assert f"held by pid {first.proc.pid}" in waiting and "sparkbuild nightly --matrix" in waiting
        at_once = Run("nightly", "--matrix", str(path), "--no-wait", env={**env, "SPARKBUILD_OUT": str(tmp_path / "out3")})
        assert at_once.finish() == 13
        assert f"held by pid {first.proc.pid}" in at_once.err and "Traceback" not in at_once.err
        assert not (tmp_path / "out3" / "summary.json").exists()
    finally:
        first.proc.send_signal(signal.SIGCONT)
    assert first.finish() == 0, first.err[-3000:]
    assert second.finish() == 0, second.err[-3000:]
    assert "got the run lock" in second.err
    # The second started its registry only after the first had stopped its own.
    assert second.err.index("got the run lock") < second.err.index("embedded registry at")
    for out in ("out1", "out2"):
        (row,) = json.loads((tmp_path / out / "summary.json").read_text())
        assert row["status"] == "up to date"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, mounted for this test and removed after it."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_cache_on_a_small_disk_is_one_clear_error_before_any_work(small_disk: Path, tmp_path: Path) -> None:
    path = matrix(tmp_path, "t17-disk")
    env = {"SPARKBUILD_CACHE": str(small_disk), "SPARKBUILD_REGISTRY": "", "SPARKBUILD_OUT": str(tmp_path / "out")}
    run = Run("nightly", "--matrix", str(path), env=env)
    assert run.finish() == 14, run.err[-3000:]
    assert "not enough free disk for this run, nothing was started" in run.err
    assert f"the registry storage ({small_disk / 'registry' / 'storage'}" in run.err and "GB free" in run.err
    assert "Traceback" not in run.err
    for sign_of_work in ("Building stage", "--progress plain", "debootstrap --variant", "Training model", "docker push"):
        assert sign_of_work not in run.err
    (row,) = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert row["status"] == "not run" and "not enough free disk" in row["error"]


def test_a_surprise_in_one_target_is_its_failure_and_the_next_goes_on(engine: Engine, base: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plans = [plan_of(matrix(tmp_path, name), tmp_path / "cache", out) for name in ("t17-missing", "t17-fine")]
    runs = [pipeline.TargetRun(p) for p in plans]
    # The first target's image is not in the engine: the Docker SDK raises ImageNotFound, an error
    # no stage expects. The second's is.
    runs[0].image = "sparkbuild-t17/not-built:1"
    runs[1].image = base
    opts = Options.from_env(matrix=ROOT / "matrix.yaml", cache=tmp_path / "cache", out=out)
    with (
        pytest.raises(LaneFailed, match="1 of 2 target"),
        pipeline.finishing(opts, "nightly", runs, table_to_stderr=True),
        embedded(tmp_path / "registry") as registry,
    ):
        pipeline.run_lane(
            pipeline.Context(opts, registry, tmp_path / "work", patch.folders((ROOT / "patches",))),
            runs,
            (pipeline.publish_image,),
        )
    assert (runs[0].status, runs[0].failed_at) == (pipeline.Status.FAILED, pipeline.Status.PUBLISHING)
    assert runs[0].error is not None and runs[0].error.startswith("unexpected ImageNotFound")
    error_log = (out / "t17-missing" / "error.log").read_text()
    assert "Traceback (most recent call last)" in error_log and "ImageNotFound" in error_log
    assert runs[1].status == pipeline.Status.PUBLISHED
    rows = json.loads((out / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["failed", "published"]
