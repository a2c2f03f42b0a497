"""How an image is served, on the real local image and engine: serving defaults applied by the
entrypoint unless the user gave them, what verify asks Docker for a GPU image, and `sparkbuild accept`."""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path

import pytest
import requests
import yaml

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import EngineError
from sparkbuild.models import model
from sparkbuild.oci import engine as engine_mod
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from sparkbuild.util.net import free_port
from sparkbuild.verify import verify
from tests.support import ROOT, cli
from tests.support.matrix import local_id, quick_checks

pytestmark = pytest.mark.docker


def local_matrix(tmp_path: Path, serve: dict[str, int]) -> Path:
    """The shipped matrix's local target alone, with serving defaults."""
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    (local,) = [t for t in shipped["targets"] if t.get("profile") == "local"]
    shipped["targets"] = [{**local, "serve": serve}]
    del shipped["rehearsal"]
    (tmp_path / "matrix.yaml").write_text(yaml.safe_dump(shipped, sort_keys=False))
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    return tmp_path / "matrix.yaml"


def test_the_image_adds_each_serving_default_the_user_did_not_give(
    engine: Engine, base: str, cache: Path, tmp_path: Path
) -> None:
    opts = Options.from_env(matrix=local_matrix(tmp_path, {"max_num_seqs": 3, "max_model_len": 64}), cache=cache, out=tmp_path)
    (p,) = plan.make(opts)
    image = build.build(engine, p, opts).image
    folder = model.ensure(cache, "alphabet")
    port = free_port()
    # The user names the model and their own max model length; the image's max_num_seqs default stays.
    command = [
        "/model",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "128",
    ]
    with engine.run(image, command, name=f"sparkbuild-serve-{secrets.token_hex(4)}", mounts={folder: "/model"}) as container:
        verify.wait_healthy(container, f"http://127.0.0.1:{port}", 600)
        served = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]
        logs = container.logs(2000)
    assert served["max_model_len"] == 128  # the user's value, not the default 64
    started = next(line for line in logs.splitlines() if "non-default args:" in line)
    assert "'max_num_seqs': 3" in started and "'max_model_len': 128" in started
    assert "--max-num-seqs 3" in next(line for line in logs.splitlines() if line.startswith("+ vllm serve"))


def test_a_gpu_image_asks_docker_for_every_gpu_and_the_host_ipc(engine: Engine, base: str) -> None:
    """What verify asks Docker for a Spark image, read back from the container's host config (no GPU here)."""
    every_gpu = [{"Driver": "", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}]
    for gpus, devices, ipc in ((True, every_gpu, ("host",)), (False, None, ("private", "shareable", ""))):
        container = engine.client.containers.create(base, ["true"], **engine_mod.gpu_options(gpus))
        try:
            host = container.attrs["HostConfig"]
            assert host["DeviceRequests"] == devices
            assert host["IpcMode"] in ipc
        finally:
            container.remove(force=True)


def test_starting_a_gpu_image_where_docker_has_no_gpu_says_what_to_do(engine: Engine, base: str) -> None:
    with (
        pytest.raises(EngineError, match="NVIDIA Container Toolkit"),
        engine.run(base, ["true"], name=f"sparkbuild-gpu-{secrets.token_hex(4)}", gpus=True),
    ):
        pass
    assert not engine.client.containers.list(all=True, filters={"name": "sparkbuild-gpu-"})  # removed


def test_accept_builds_verifies_and_writes_a_report_to_attach(base: str, tmp_path: Path) -> None:
    # The local target with its alphabet check alone, benchmarked at one level: the nightly test runs
    # both shipped checks in full; here the subject is the report.
    matrix = tmp_path / "matrix.yaml"
    shutil.copy(ROOT / "matrix.yaml", matrix)
    matrix.write_text(matrix.read_text().replace("check: [alphabet, moe-alphabet]", "check: alphabet", 1))
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    args = ("accept", "--only", "vllm-0.32.0-cpu-amd64", "--matrix", str(quick_checks(matrix)), "--json")
    done = cli.run(*args, env={"SPARKBUILD_OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and [s["name"] for s in report["steps"]] == ["build", "verify"]
    assert report["image_size_gb"] > 1 and report["installed"]["torch"] == "2.13.0+cpu"
    (first,) = report["checks"]
    assert first["ok"] and first["answers"][0]["received"] == " g h i j" and first["benchmark"]["levels"]
    text = (tmp_path / local_id() / "accept.md").read_text()
    assert "PASSED" in text and "| image_size_gb |" in text and "### Answers, kernel paths and speed" in text
