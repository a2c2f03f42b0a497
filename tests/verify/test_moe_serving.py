"""Which MoE check models the local vLLM CPU image serves, on the real image and engine.

vLLM 0.32's CPU build serves an unquantized MoE: the shipped local target's second check,
``moe-alphabet``, serves it in every nightly through the kernel-path gate (``moe: CPU``;
tests/lanes/test_nightly.py), and here, in float32, its answers and logprobs are held to the
reference the model recorded when it was made: vLLM reads the checkpoint as transformers does.

Its MXFP4 MoE experts (CPUExpertsMxfp4) and its FP8 block linear and MoE kernels
(CPUFp8BlockScaledMMKernel, CPUExpertsFp8) need Intel AMX tiles; without them it refuses those formats
at startup, and it has no NVFP4 linear kernel at all. verify skips those checks before any server
starts, with the reasons of sparkbuild/resources/cpu-serving.yaml; here each refusal is served for real
and quoted from the server's log, and the table's reason is held to it. With AMX, vLLM starts the FP8
and MXFP4 models and its worker dies on the first request (seen on an AMX Xeon, issue 26): those
refusal tests are about CPUs without AMX and skip on one with it, saying so.
"""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from sparkbuild.errors import VerifyError
from sparkbuild.models import model
from sparkbuild.models.moe import reference
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix, runnable
from sparkbuild.util import host
from sparkbuild.util.net import free_port
from sparkbuild.verify import verify
from tests.support import ROOT

pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    # Making a quantized model here (the first test to need it, in a whole run) meets transformers'
    # "saving offloaded modules" chatter, as tests/models/test_moe_models.py does.
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
AMX = host.read_cpu().amx
REFUSALS = {
    "moe-nvfp4": "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer",
    "gptoss-mxfp4": "NotImplementedError: No MXFP4 MoE backend supports the deployment configuration",
    # Refused before its experts: the attention's FP8 block linear has no kernel without AMX either.
    "moe-fp8": "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer",
}


@pytest.fixture(scope="module")
def image(local_image: str) -> str:
    return local_image


def serve(engine: Engine, image: str, folder: Path, dtype: str) -> tuple[list[dict[str, Any]] | None, str]:
    """The server's greedy answers to the check prompts with their top logprobs (None when it did not start), and its log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ["/model", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"]
    command += ["--dtype", dtype, "--max-model-len", "128", "--enforce-eager"]
    name = f"sparkbuild-moe-{secrets.token_hex(4)}"
    prompts = json.loads((folder / "sparkbuild-model.json").read_text())["prompts"]
    # Logprobs as any client asks for them: vLLM ranks them with a torch.compile'd function, which
    # the image's g++ builds (before issue 26 the engine died here).
    with engine.run(image, command, name=name, mounts={folder: "/model"}) as container:
        try:
            verify.wait_healthy(container, url, 600)
        except VerifyError:
            return None, container.logs(2000)
        answers = []
        for p in prompts:
            body = {
                "model": "m",
                "prompt": p["prompt"],
                "max_tokens": p["max_tokens"],
                "temperature": 0,
                "logprobs": reference.TOP,
            }
            answers.append(requests.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0])
        return answers, container.logs(2000)


@pytest.fixture(scope="module")
def served(engine: Engine, image: str, cache: Path) -> dict[str, tuple[list[dict[str, Any]] | None, str]]:
    """moe-alphabet in float32, and each quantized model this CPU has no kernel for, served at once (a server
    start is mostly Python imports, and several side by side take little longer than one)."""
    names = ["moe-alphabet", *(n for n in sorted(REFUSALS) if not AMX or n == "moe-nvfp4")]
    folders = {n: model.ensure(cache, n) for n in names}
    with ThreadPoolExecutor(max_workers=len(folders)) as pool:
        futures = {
            n: pool.submit(serve, engine, image, f, "float32" if n == "moe-alphabet" else "bfloat16") for n, f in folders.items()
        }
        return {n: f.result() for n, f in futures.items()}


def test_the_cpu_image_answers_moe_alphabet_as_its_reference_says(
    served: dict[str, tuple[list[dict[str, Any]] | None, str]], cache: Path
) -> None:
    answers, logs = served["moe-alphabet"]
    assert answers is not None, logs[-3000:]
    meta = json.loads((model.ensure(cache, "moe-alphabet") / "sparkbuild-model.json").read_text())
    assert [a["text"] for a in answers] == [p["expect"] for p in meta["prompts"]]
    got = reference.Reading(
        expected=[a["logprobs"]["token_logprobs"] for a in answers],
        margin=[[_margin(top) for top in a["logprobs"]["top_logprobs"]] for a in answers],
        top=[],
        routed=[],
    )
    want = reference.Reading(
        expected=[[t["logprob"] for t in p["tokens"]] for p in meta["prompts"]],
        margin=[[t["margin"] for t in p["tokens"]] for p in meta["prompts"]],
        top=[],
        routed=[],
    )
    tolerance = reference.Tolerance(**{k: meta["tolerance"][k] for k in ("format", "logprob_abs", "margin_fraction")})
    assert tolerance.violations(want, got) == []


def _margin(top: dict[str, float]) -> float:
    """Top-1 minus top-2 logprob of one position (the served token is top-1 once the text matches)."""
    first, second = sorted(top.values(), reverse=True)[:2]
    return first - second


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_the_cpu_image_refuses_each_quantized_moe_it_has_no_kernel_for(
    served: dict[str, tuple[list[dict[str, Any]] | None, str]], name: str
) -> None:
    if AMX and name != "moe-nvfp4":
        pytest.skip(
            "about CPUs without AMX: with AMX, vLLM 0.32 starts the FP8 and MXFP4 models and its worker dies on the first "
            "request (cpu-serving.yaml); verify skips them on this CPU"
        )
    answer, logs = served[name]
    assert answer is None, f"vLLM's CPU image now serves {name} ({answer!r}): move it to the served tests"
    assert REFUSALS[name] in logs, logs[-3000:]
    # verify skips this check before serving it, and its reason quotes what vLLM said here.
    check = matrix.load(ROOT / "matrix.yaml").checks[name]
    labels = {runnable.CUDA_LABEL: "none", runnable.VERSION_LABEL: "0.32.0"}
    reason = runnable.skip_reason(check, runnable.Serving.of(labels, host.read_cpu()))
    assert reason is not None and REFUSALS[name].split(": ", 1)[1] in reason
