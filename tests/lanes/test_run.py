"""How a user starts an image, on the real local image and engine: the serving defaults the image's
entrypoint adds for the user's own arguments (vLLM's own parser and engine config judge them), and
`sparkbuild run`, whose caches outlive the container so that a second start reuses them."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import requests

from sparkbuild.models import model
from sparkbuild.oci.engine import Container, Engine
from sparkbuild.oci.jitcache import CACHES
from sparkbuild.util.net import free_port
from sparkbuild.verify import verify
from tests.support import ROOT, population

pytestmark = pytest.mark.docker

PROBE = ROOT / "tests" / "data" / "vllm_serve_config.py"


@pytest.fixture(scope="module")
def spark_runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Spark target's runtime stage context as sparkbuild renders it (serve-defaults.json and the entrypoint)."""
    return population.spark_runtime(tmp_path_factory.mktemp("render"))


def entrypoint(engine: Engine, image: str, runtime: Path, model_folder: Path, *user: str) -> dict[str, object]:
    """The Spark image's entrypoint, rendered, run in ``image`` with the user's arguments, where
    vLLM's own `serve` parser and engine config (tests/data/vllm_serve_config.py) take the
    place of the server; what vLLM made of the arguments."""
    mounts = {
        runtime / "serve_defaults.py": "/opt/sparkbuild/serve_defaults.py",
        runtime / "serve-defaults.json": "/opt/sparkbuild/serve-defaults.json",
        PROBE: "/probe.py",
        model_folder: "/model",
    }
    command = ["/opt/sparkbuild/serve_defaults.py", "/opt/sparkbuild/serve-defaults.json", "python3", "/probe.py"]
    container = engine.client.containers.create(
        image,
        [*command, "/model", *user],
        entrypoint=["python3"],
        volumes={str(src): {"bind": dst, "mode": "ro"} for src, dst in mounts.items()},
        network_mode="none",
    )
    try:
        container.start()
        container.wait(timeout=900)
        out = container.logs(stderr=False).decode()
    finally:
        container.remove(force=True)
    # The probe's last line: what vLLM made of the arguments, or vLLM's refusal (exit 1) with its message.
    found: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return found


def test_a_short_context_model_starts_and_the_graphs_follow_the_users_max_num_seqs(
    engine: Engine, local_image: str, spark_runtime: Path, cache: Path
) -> None:
    """`docker run IMAGE MODEL --max-num-seqs 256` with the Spark image's defaults: the alphabet model
    knows 128 positions, so a fixed default length above that made vLLM refuse it; the CUDA graphs
    were capped at 16 (the default batch) though the user asked for 256 sequences."""
    found = entrypoint(engine, local_image, spark_runtime, model.ensure(cache, "alphabet"), "--max-num-seqs", "256")
    assert "error" not in found, found["error"]
    assert found["max_model_len"] == 128  # the model's own: -1 fits the length to it
    assert found["max_num_seqs"] == 256
    sizes = found["cudagraph_capture_sizes"]
    assert isinstance(sizes, list) and {5, 10} <= set(sizes) and max(sizes) == 512  # vLLM's for 256, plus 5 and 10


# --- the entrypoint over a population of users' options -------------------------------------------


@pytest.fixture(scope="module")
def populated(
    engine: Engine, local_image: str, spark_runtime: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The population through vLLM 0.32's own parser and engine config in the local image (its CPU
    platform), with the Spark image's serving defaults and entrypoint code."""
    return population.run(
        engine, local_image, spark_runtime, model.ensure(cache, "alphabet"), tmp_path_factory.mktemp("population")
    )


def test_every_option_users_pass_reaches_vllm_as_they_gave_it_beside_the_images_defaults(populated: dict[str, Any]) -> None:
    """Issue 38: the entrypoint added a compilation config beside ``--cudagraph-capture-sizes``, which
    vLLM refuses ("... are mutually exclusive"). Each case is judged against vLLM itself: what it
    accepts from the user alone it accepts from the entrypoint, and each value the user gave is the
    value in vLLM's engine config. Before the fix, 4 of the 48 cases were refused here (vLLM 0.32's CPU
    platform captures no graphs, so only the refusals show; the rehearsal's run on 0.33 with a GB10
    faked judges the graphs)."""
    wrong = population.wrong(populated)
    assert not wrong, json.dumps(wrong, indent=1)
    # The options the image collided with were judged here, not left out as refused by vLLM alone.
    assert not population.refused_alone(populated), population.refused_alone(populated)
    assert len(populated["cases"]) == len(population.population())


# --- sparkbuild run -------------------------------------------------------------------------------


@pytest.fixture
def prefix(engine: Engine) -> Iterator[str]:
    """A volume prefix of this test's own; its volumes are removed afterwards."""
    name = f"sparkbuild-test-{secrets.token_hex(4)}-"
    yield name
    for cache in CACHES:
        with contextlib.suppress(docker.errors.NotFound):  # a cache the test never made
            engine.client.volumes.get(f"{name}{cache.name}").remove(force=True)


def sparkbuild_run(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "sparkbuild", "run", *args], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def start(engine: Engine, image: str, folder: Path, prefix: str, hf: Path) -> tuple[Container, dict[str, object]]:
    """`sparkbuild run IMAGE MODEL --detach` serving the alphabet model, healthy; its container's config."""
    name, port = f"sparkbuild-run-{secrets.token_hex(4)}", free_port()
    options = ["--detach", "--name", name, "--port", str(port), "--volume-prefix", prefix, "--hf-cache", str(hf)]
    vllm = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--host", "127.0.0.1"]
    sparkbuild_run(image, str(folder), *options, "--", *vllm)
    sdk = engine.client.containers.get(name)
    container = Container(sdk)
    try:
        verify.wait_healthy(container, f"http://127.0.0.1:{port}", 900)
        served = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]
        assert served["id"] == f"/models/{folder.name}" and served["max_model_len"] == 128
    except BaseException:
        sys.stderr.write(container.logs(60))
        sdk.remove(force=True)
        raise
    attrs: dict[str, object] = sdk.attrs
    return container, attrs


def stop(engine: Engine, container: Container) -> None:
    engine.client.containers.get(container.name).remove(force=True)


def modelinfo_stamp(engine: Engine, image: str, prefix: str) -> str:
    """The model-info files vLLM keeps in its cache volume, with their modification times."""
    out: bytes = engine.client.containers.run(
        image,
        ["sh", "-c", "cd /v/modelinfos && stat -c '%n %Y' *"],
        entrypoint=[],
        volumes={f"{prefix}vllm": {"bind": "/v", "mode": "ro"}},
        network_mode="none",
        remove=True,
    )
    return out.decode().strip()


def test_sparkbuild_run_serves_with_host_ipc_and_caches_that_a_second_start_reuses(
    engine: Engine, local_image: str, cache: Path, prefix: str, tmp_path: Path
) -> None:
    folder = model.ensure(cache, "alphabet")
    first, attrs = start(engine, local_image, folder, prefix, tmp_path / "hf")
    stop(engine, first)
    host = attrs["HostConfig"]
    assert isinstance(host, dict) and host["IpcMode"] == "host" and host["NetworkMode"] == "host"
    assert host["DeviceRequests"] is None  # the CPU image says it has no CUDA: no GPU asked for
    mounts = {m["Destination"]: m for m in attrs["Mounts"]}  # type: ignore[attr-defined]
    for c in CACHES:
        assert mounts[c.path]["Type"] == "volume" and mounts[c.path]["Name"] == f"{prefix}{c.name}"
    assert mounts["/root/.cache/huggingface"]["Source"] == str(tmp_path / "hf")
    assert mounts[f"/models/{folder.name}"]["RW"] is False
    # vLLM keeps what it learnt of the model class in its cache (a file per class, saved on a miss).
    before = modelinfo_stamp(engine, local_image, prefix)
    assert "LlamaForCausalLM" in before

    second, _ = start(engine, local_image, folder, prefix, tmp_path / "hf")
    stop(engine, second)
    # The second container read it from the volume: a miss would have saved it again.
    assert modelinfo_stamp(engine, local_image, prefix) == before


def test_the_printed_command_asks_for_the_gpus_of_a_cuda_image(tmp_path: Path) -> None:
    """--print starts nothing; --gpus is what an image with CUDA gets (no GPU needed to print it)."""
    done = sparkbuild_run("example/vllm:spark", "openai/gpt-oss-120b", "--print", "--json", "--gpus", "--hf-cache", str(tmp_path))
    args = json.loads(done.stdout)
    assert args[:2] == ["docker", "run"] and args[args.index("--gpus") + 1] == "all"
    assert args[args.index("example/vllm:spark") + 1 :] == ["openai/gpt-oss-120b", "--port", "8000"]
    assert "CUDA_CACHE_MAXSIZE=4294967296" in args
