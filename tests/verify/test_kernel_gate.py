"""The kernel-path gate and `verify --url` on the real local image (vLLM 0.32.0 CPU), against
servers started here as a deployment would be (verify's own serving is tested by the nightly tests).

The MoE model here is a tiny Mixtral with random weights, made in the test from the alphabet
model's tokenizer: serving it makes vLLM choose and log its MoE backend (on CPU: "CPU"). Its
answers are wrong by design (it was never trained); the gate is what these tests look at, and
verify reports both.

The alphabet server also answers the check kinds (sparkbuild/verify/checkkinds.py) as `verify --url` runs them
against a deployment: a few dozen requests more on a server already up, where a server of its own would
take minutes to start.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from sparkbuild.errors import VerifyError
from sparkbuild.models import model
from sparkbuild.oci import jitcache
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.util.net import free_port
from sparkbuild.verify import verify
from tests.support import ROOT
from tests.support.cli import in_process as sparkbuild

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def shipped_check() -> matrix.Check:
    return next(t.check for t in matrix.load(ROOT / "matrix.yaml").targets if t.profile == "local")


@pytest.fixture(scope="module")
def mixtral(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Mixtral (4 experts, 2 per token), random weights, the alphabet tokenizer."""
    tf: Any = importlib.import_module("transformers")
    torch: Any = importlib.import_module("torch")
    tokenizer = tf.AutoTokenizer.from_pretrained(model.ensure(cache, "alphabet"))
    config = tf.MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mixtral")
    tf.MixtralForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # the server in the container may run as another user
    return out


def moe_check(shipped: matrix.Check, *backends: str) -> matrix.Check:
    return replace(shipped, name="moe", kernels=(("moe", backends),), concurrency=())


@dataclass(frozen=True)
class Served:
    url: str
    log: str


@pytest.fixture(scope="module")
def served(
    engine: Engine, local_image: str, cache: Path, mixtral: Path, shipped_check: matrix.Check
) -> Iterator[dict[str, Served]]:
    """The local image serving the Mixtral and the alphabet Llama at once (as deployments would:
    started here, not by verify, with what they compile kept in the image's own volumes, as
    `sparkbuild run` keeps it), with their startup logs."""
    folders = {"mixtral": mixtral, "alphabet": model.ensure(cache, "alphabet")}
    caches = jitcache.for_image(verify.image_id(engine, local_image))
    with contextlib.ExitStack() as stack:
        started = {}
        for name, folder in folders.items():
            port = free_port()
            command = ["/model", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", f"team-{name}"]
            container = stack.enter_context(
                engine.run(
                    local_image,
                    [*command, *shipped_check.serve_args],
                    name=f"sparkbuild-{name}-{secrets.token_hex(4)}",
                    mounts={folder: "/model"},
                    caches=caches,
                    environment=jitcache.environment(),
                )
            )
            started[name] = (container, f"http://127.0.0.1:{port}")
        for container, url in started.values():
            verify.wait_healthy(container, url, 600)
        yield {name: Served(url, container.logs(tail=None)) for name, (container, url) in started.items()}


def gate_matrix(folder: Path, kernels: str) -> Path:
    """The shipped matrix, its alphabet check expecting ``kernels`` and benchmarking nothing."""
    body = (ROOT / "matrix.yaml").read_text()
    body = body.replace("    concurrency: [1, 2, 5, 10]\n", f"    concurrency: []\n    kernels: {kernels}\n", 1)
    (folder / "matrix.yaml").write_text(body)
    (folder / "patches").symlink_to(ROOT / "patches")
    return folder / "matrix.yaml"


def test_the_gate_reads_the_cpu_images_moe_backend_from_its_log(
    served: dict[str, Served], local_image: str, shipped_check: matrix.Check, tmp_path: Path
) -> None:
    moe = served["mixtral"]
    server = verify.Server(url=moe.url, model="team-mixtral", read_log=lambda: moe.log)
    result = verify.run_check(
        server, moe_check(shipped_check, "CPU"), image=local_image, model="mixtral", startup=0, result_file=tmp_path / "v.json"
    )
    assert result.vllm_version == "0.32.0"
    (chosen,) = result.kernels
    assert chosen.ok and [b for b, _ in chosen.found] == ["CPU"]
    assert "Using CPU Unquantized MoE backend out of potential backends" in chosen.found[0][1]
    assert "Using CPU Unquantized MoE backend" in (tmp_path / "server.log").read_text()
    # The untrained model's answers are wrong; the kernel path is the one expected.
    with pytest.raises(VerifyError) as failed:
        verify.require(result, tmp_path / "v.json")
    assert "wrong answer" in str(failed.value) and "kernel-path gate" not in str(failed.value)
    assert json.loads((tmp_path / "v.json").read_text())["kernels"][0]["chosen"][0]["backend"] == "CPU"


def test_a_check_that_expects_a_gpu_moe_backend_fails_on_the_cpu_image_quoting_the_line(
    served: dict[str, Served], tmp_path: Path
) -> None:
    (tmp_path / "start.log").write_text(served["mixtral"].log)
    path = gate_matrix(tmp_path, "{moe: [FLASHINFER_CUTLASS, VLLM_CUTLASS]}")
    args = (
        "--check",
        "alphabet",
        "--matrix",
        str(path),
        "--result",
        str(tmp_path / "r.json"),
        "--log",
        str(tmp_path / "start.log"),
    )
    done = sparkbuild("verify", "--url", served["mixtral"].url, *args)
    assert done.code == 6
    assert "kernel-path gate failed:" in done.err
    assert "moe: expected FLASHINFER_CUTLASS or VLLM_CUTLASS, vLLM chose CPU: " in done.err
    assert "[unquantized.py:364] Using CPU Unquantized MoE backend" in done.err
    assert f"the server's log: {tmp_path / 'server.log'}" in done.err


def test_verify_url_checks_a_running_server_and_gates_it_from_a_log_file(served: dict[str, Served], tmp_path: Path) -> None:
    url = served["alphabet"].url
    done = sparkbuild("verify", "--url", url, "--check", "alphabet", "--result", str(tmp_path / "r.json"), "--json")
    assert done.code == 0, done.err
    result = json.loads(done.out)
    assert result["ok"] and result["image"] == url and result["model"] == "team-alphabet"
    assert [a["received"] for a in result["answers"]] == [" g h i j", " q r s t"]
    # No image to run vllm bench serve from: no speed figures (sparkbuild/verify/verify.py verify_url).
    assert result["vllm_version"] == "0.32.0" and result["benchmark"] is None
    # The shipped alphabet check's kinds: its prompts 20 times, 5 at a time, and 120 tokens of its cycle.
    assert [(k["kind"], k["ok"]) for k in result["kinds"]] == [("burn_in", True), ("long_generation", True)]

    # Robust answers: a text the answer contains, a regular expression it matches.
    robust = (ROOT / "matrix.yaml").read_text().replace('expect: " g h i j"', "contains: h i", 1)
    robust = robust.replace('expect: " q r s t"', "regex: '^ q r s t$'", 1)
    (tmp_path / "robust").mkdir()
    (tmp_path / "robust" / "matrix.yaml").write_text(robust)
    (tmp_path / "robust" / "patches").symlink_to(ROOT / "patches")
    matched = sparkbuild(
        "verify", "--url", url, "--check", "alphabet", "--matrix", str(tmp_path / "robust" / "matrix.yaml"), "--json"
    )
    assert matched.code == 0, matched.err
    assert [(a["match"], a["ok"]) for a in json.loads(matched.out)["answers"]] == [("contains", True), ("regex", True)]

    # A check that expects kernels needs the log; with it, the gate runs (the dense Llama logs no MoE).
    (tmp_path / "start.log").write_text(served["alphabet"].log)
    args = ("--check", "alphabet", "--matrix", str(gate_matrix(tmp_path, "{moe: CPU}")), "--result", str(tmp_path / "g.json"))
    no_log = sparkbuild("verify", "--url", url, *args)
    assert no_log.code == 6 and "give it with --log FILE" in no_log.err
    gated = sparkbuild("verify", "--url", url, *args, "--log", str(tmp_path / "start.log"))
    assert gated.code == 6
    assert "moe: expected CPU, but no line of the log matches kernel-paths.yaml's moe patterns for vLLM 0.32.0" in gated.err


def test_verify_url_says_when_nothing_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = sparkbuild("verify", "--url", url, "--check", "alphabet")
    assert done.code == 6 and f"cannot reach {url}/health" in done.err
    both = sparkbuild("verify", "some/image:1", "--url", url, "--check", "alphabet")
    assert both.code == 2 and "not both" in both.err


def test_the_check_kinds_the_tiny_model_cannot_answer_fail_saying_what_it_answered(
    served: dict[str, Served], tmp_path: Path
) -> None:
    """The alphabet model answers letters to word problems and to the pass-key question: arithmetic and
    needles fail for real, naming the kind, the item and the figure (their passing side is judged in
    tests/verify/test_checkkinds.py and proven on the runner). The burn-in and the long generation pass:
    20 answers right 5 at a time, and 120 tokens of its alphabet, a cycle of 26 different tokens."""
    body = (ROOT / "matrix.yaml").read_text()
    # Its 128-token context holds a question with no worked examples and an 8-token answer.
    extra = "      arithmetic: {questions: 10, shots: 0, max_tokens: 8}\n      needles: {max_tokens: 8}\n"
    body = body.replace(
        "      burn_in: {requests: 20, concurrency: 5}\n", extra + "      burn_in: {requests: 20, concurrency: 5}\n", 1
    )
    (tmp_path / "matrix.yaml").write_text(body)
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    url = served["alphabet"].url
    args = ("--check", "alphabet", "--matrix", str(tmp_path / "matrix.yaml"), "--result", str(tmp_path / "r.json"))
    done = sparkbuild("verify", "--url", url, *args)
    assert done.code == 6, done.err
    assert f"{url}: check alphabet's kinds failed (docs/check-kinds.md):" in done.err
    assert "  arithmetic: 0/10 right, at least 8 (80%) needed (seed 52148)" in done.err
    assert "    q1 'A shop sells 57 coins on Monday and 16 more than that on Tue...': expected 130, answered ' " in done.err
    assert "  needles: 0/3 pass keys found, at 10%, 50%, 90% of a 128-token context" in done.err
    assert re.search(r"    at 90% \(token \d+ of 128\): expected pass key \d{5}, answered ' [a-z]", done.err), done.err
    # The progress lines show every kind with its figure; the error names only the kinds that failed.
    assert "burn_in: 20/20 answers right, 5 at a time [ok]" in done.err
    error = done.err[done.err.index("error: ") :]
    assert "burn_in" not in error and "long_generation" not in error
    result = json.loads((tmp_path / "r.json").read_text())
    assert not result["ok"] and all(a["ok"] for a in result["answers"])
    kinds = {k["kind"]: k for k in result["kinds"]}
    assert [(name, k["ok"]) for name, k in kinds.items()] == [
        ("arithmetic", False),
        ("needles", False),
        ("burn_in", True),
        ("long_generation", True),
    ]
    assert len(kinds["arithmetic"]["wrong"]) == 10 and kinds["needles"]["figures"]["context"] == 128
    assert kinds["burn_in"]["figures"] == {"requests": 20, "concurrency": 5, "right": 20}
    long = kinds["long_generation"]["figures"]
    assert long == {"tokens": 120, "longest_run": 1, "fewest_distinct": 26, "finish_reason": "length"}
