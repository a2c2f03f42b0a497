"""Images whose MoE kernel or attention gives wrong numbers while /health stays green fail verify
(issue 28): the fault users fear most, built for real.

Each image is the shipped local image plus one layer that edits one line of vLLM's CPU path after its
kernel call: the experts' output (``cpu_fused_moe`` in CPUUnquantizedExperts.apply) zeroed, halved
or noised at its own size, and the attention's output (CPU attention backend) scaled. verify serves the
``moe-alphabet`` check on each: its model answers a lookup chain only its experts compute, and verify
holds every answer token's logprob and margin to the reference recorded when the model was made
(sparkbuild/verify/numerics.py). Each broken image fails naming the check, the prompt and the figure that
moved; the unmodified image passes (tests/lanes/test_nightly.py serves the same check). An image
whose answers stay right on moved numbers is not burnt in: its numbers failed it already.
The images are served side by side: a server start is mostly imports.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparkbuild.errors import VerifyError
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.verify import verify
from tests.support import DATA, ROOT
from tests.support.images import derived_image, verify_each

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# Each fault: where it goes (tests/data/break_vllm.py, copied into the image) and what it does.
FAULTS = {
    "moe-zeroed": ("moe", "output.mul_(0.0)"),
    "moe-halved": ("moe", "output.mul_(0.5)"),
    "moe-noised": ("moe", "output.add_(torch.randn_like(output) * output.std())"),
    "attention-scaled": ("attention", "output.mul_(1.5)"),
    # Inside the band the model was trained to keep its answers in (x0.8 to x1.25): the text stays,
    # only the numbers move. What the logprob comparison is for.
    "moe-scaled-0.85": ("moe", "output.mul_(0.85)"),
}
# The faults whose answers stay right: verify must fail them on the numbers alone.
TEXT_KEPT = {"moe-scaled-0.85"}
BREAK = (DATA / "break_vllm.py").read_text()


def moe_check() -> matrix.Check:
    """The shipped moe-alphabet check, as the local nightly serves it."""
    return matrix.load(ROOT / "matrix.yaml").checks["moe-alphabet"]


@pytest.fixture(scope="module")
def broken(engine: Engine, local_image: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    images = {}
    for name, (where, fault) in FAULTS.items():
        folder = tmp_path_factory.mktemp(name)
        steps = f"COPY break_vllm.py /tmp/\nRUN python3 /tmp/break_vllm.py {where} '{fault}' && rm /tmp/break_vllm.py"
        tag = f"sparkbuild-test/broken:{name}"
        images[name] = derived_image(engine, local_image, tag, steps, folder, {"break_vllm.py": BREAK})
    return images


@pytest.fixture(scope="module")
def verified(
    engine: Engine, broken: dict[str, str], cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[verify.Verified, Path]]:
    check = dataclasses.replace(moe_check(), concurrency=(1,), bench_repeats=1)
    return verify_each(engine, broken, check, cache, tmp_path_factory)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_an_image_with_a_broken_kernel_fails_verify_naming_what_moved(
    verified: dict[str, tuple[verify.Verified, Path]], fault: str
) -> None:
    found, result_file = verified[fault]
    error = found.failures.get("moe-alphabet")
    assert isinstance(error, VerifyError), f"{fault}: verify passed an image with a broken kernel"
    text = str(error)
    # Named: the check, a prompt of it, and the figure that moved (a token, a logprob or a margin).
    assert "moe-alphabet" in text or "wrong answer" in text, text
    assert any(f"p{i}" in text for i in range(1, 9)), text
    assert any(words in text for words in ("logprob", "margin", "tokens", "expected")), text
    data = json.loads(result_file.read_text())
    assert data["ok"] is False
    if fault in TEXT_KEPT:
        assert all(a["ok"] for a in data["answers"]), data["answers"]
        assert "logprobs moved beyond the tolerance recorded with the model" in text, text
        assert any(not n["ok"] for n in data["numbers"]), data["numbers"]
        # Its numbers failed it: the check's burn-in (hundreds of requests) is not run to say it again.
        assert moe_check().kinds.burn_in is not None and data["kinds"] == [], data["kinds"]
    print(f"{fault}: {text.splitlines()[0]} | {text.splitlines()[1] if len(text.splitlines()) > 1 else ''}")
