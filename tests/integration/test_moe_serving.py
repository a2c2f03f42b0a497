"""Which MoE check models the local vLLM CPU image serves, on the real image and engine.

vLLM 0.32's CPU build serves an unquantized MoE: the shipped local target's second check,
``moe-alphabet``, serves it in every nightly through the kernel-path gate (``moe: CPU``;
tests/integration/test_nightly.py). Its MXFP4 MoE experts (CPUExpertsMxfp4) and its FP8
block linear and MoE kernels (CPUFp8BlockScaledMMKernel, CPUExpertsFp8) need Intel AMX tiles; without
them it refuses those formats at startup, and it has no NVFP4 linear kernel at all. A refusal is the
expected result here, quoted from the server's log: the quantized models are for the Spark targets,
and these tests say when the CPU image's support changes.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml

from builder import build, model, plan, verify
from builder.engine import Engine
from builder.errors import VerifyError
from builder.moe.recipe import PROMPT
from builder.net import free_port
from builder.options import Options
from tests.support import ROOT

pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    # Making a quantized model here (the first test to need it, in a whole run) meets transformers'
    # "saving offloaded modules" chatter, as tests/unit/test_moe_models.py does.
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
AMX = "amx_tile" in Path("/proc/cpuinfo").read_text()
REFUSALS = {
    "moe-nvfp4": "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer",
    "gptoss-mxfp4": "NotImplementedError: No MXFP4 MoE backend supports the deployment configuration",
    # Refused before its experts: the attention's FP8 block linear has no kernel without AMX either.
    "moe-fp8": "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer",
}


@pytest.fixture(scope="module")
def image(engine: Engine, base: str, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shipped matrix's local target, built (or found by content) as the nightly builds it."""
    out = tmp_path_factory.mktemp("moe-serving")
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    shipped["targets"] = [t for t in shipped["targets"] if t.get("profile") == "local"]
    del shipped["rehearsal"]
    (out / "matrix.yaml").write_text(yaml.safe_dump(shipped, sort_keys=False))
    (out / "patches").symlink_to(ROOT / "patches")
    opts = Options.from_env(matrix=out / "matrix.yaml", cache=cache, out=out)
    (p,) = plan.make(opts)
    return build.build(engine, p, opts).image


def serve(engine: Engine, image: str, folder: Path) -> tuple[str | None, str]:
    """The server's greedy answer to the prompt (None when it did not start) and its log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ["/model", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"]
    command += ["--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager"]
    name = f"sparkbuild-moe-{secrets.token_hex(4)}"
    with engine.run(image, command, name=name, mounts={folder: "/model"}) as container:
        try:
            verify.wait_healthy(container, url, 600)
        except VerifyError:
            return None, container.logs(2000)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        answer = requests.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        return str(answer), container.logs(2000)


@pytest.fixture(scope="module")
def served(engine: Engine, image: str, cache: Path) -> dict[str, tuple[str | None, str]]:
    """Each quantized model this CPU has no kernel for, served at once (a server start is mostly
    Python imports, and three side by side take little longer than one)."""
    names = [n for n in sorted(REFUSALS) if not AMX or n == "moe-nvfp4"]
    folders = {n: model.ensure(cache, n) for n in names}
    with ThreadPoolExecutor(max_workers=len(folders)) as pool:
        futures = {n: pool.submit(serve, engine, image, folder) for n, folder in folders.items()}
        return {n: f.result() for n, f in futures.items()}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_the_cpu_image_refuses_each_quantized_moe_it_has_no_kernel_for(
    served: dict[str, tuple[str | None, str]], name: str
) -> None:
    if AMX and name != "moe-nvfp4":
        pytest.skip("this CPU has AMX: vLLM's CPU build has MXFP4 and FP8 MoE experts for it (not yet seen served here)")
    answer, logs = served[name]
    assert answer is None, f"vLLM's CPU image now serves {name} ({answer!r}): move it to the served tests"
    assert REFUSALS[name] in logs, logs[-3000:]
