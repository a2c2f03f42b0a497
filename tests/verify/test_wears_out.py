"""A MoE kernel that computes right for its first N tokens and returns zeros after that fails verify at the
stage it turns wrong in, naming it (issue 39): the shape Spark owners report most, right on the demo
prompt and garbage from the Nth request, ``/health`` green.

Each image is the shipped local image plus one layer: a line after vLLM's CPU MoE kernel call
(``cpu_fused_moe`` in CPUUnquantizedExperts.apply, tests/data/break_vllm.py) that adds up the tokens the
kernel has computed (rows of ``hidden_states``, both MoE layers) and zeroes the experts' output from token N
on. The check is the shipped ``moe-alphabet`` at one level and two repeats, its burn-in sized to that
benchmark (84 requests: what the burn-in rule asks).

Tokens, not calls: how many requests share a step depends on when they arrive, so the kernel's call count
at a stage's end moves with the machine's timing; the tokens it computes do not (every prompt token and
every generated token once, whatever the batching). Measured on this image with a layer that logs each
call (2026-12-06, x86_64): on a quiet host and on one with three busy loops on its 2 cores, the calls
before the benchmark were 1282 and 1364 (the CI machine's 3250th call fell inside the benchmark's last
known-answer run, where this host's came after it), and the tokens were the same at every stage's end:
the answers, probes and numbers 800, the burn-in 2984, the benchmark's first repeat 12376 and its
known-answer run 12792, the second repeat 22148 and its known-answer run 22564, the answers asked again
after the load 23188. Each N lies in the middle of its stage, hundreds of tokens from both ends, and each
image fails there, the stage named. The unmodified image passes the same check in every nightly
(tests/lanes/test_nightly.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparkbuild.errors import VerifyError
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.verify import verify
from tests.support import DATA, ROOT
from tests.support.images import derived_image, verify_each

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# N: the token from which the kernel is wrong, and the words verify's failure must say.
WEARS_OUT = {
    "in-the-burn-in": (1900, "burn_in: "),
    "in-the-benchmark": (7000, "during the benchmark, after repeat 1 of 2"),
    "after-the-benchmark": (22870, "after the load ("),
}
COUNT = '__import__("builtins").__dict__.setdefault("_sparkbuild_tokens", [0])'


def fault(n: int) -> str:
    """One statement after the kernel call: add up its tokens, and from token ``n`` on zero the experts' output."""
    return f"{COUNT}.__setitem__(0, {COUNT}[0] + hidden_states.shape[0]) or ({COUNT}[0] >= {n} and output.mul_(0.0))"


def check() -> matrix.Check:
    shipped = matrix.load(ROOT / "matrix.yaml").checks["moe-alphabet"]
    kinds = dataclasses.replace(shipped.kinds, burn_in=matrix.BurnIn(requests=84, concurrency=1))
    return dataclasses.replace(shipped, concurrency=(1,), bench_repeats=2, kinds=kinds)


@pytest.fixture(scope="module")
def verified(
    engine: Engine, local_image: str, cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[verify.Verified, Path]]:
    images = {}
    for name, (n, _) in WEARS_OUT.items():
        steps = f"COPY break_vllm.py /tmp/\nRUN python3 /tmp/break_vllm.py moe '{fault(n)}' && rm /tmp/break_vllm.py"
        folder = tmp_path_factory.mktemp(f"wears-out-{name}")
        images[name] = derived_image(engine, local_image, f"sparkbuild-test/wears-out:{name}", steps, folder, {
            "break_vllm.py": (DATA / "break_vllm.py").read_text()
        })  # fmt: skip
    return verify_each(engine, images, check(), cache, tmp_path_factory)


@pytest.mark.parametrize("name", sorted(WEARS_OUT))
def test_a_kernel_that_turns_wrong_with_use_fails_verify_naming_when(
    verified: dict[str, tuple[verify.Verified, Path]], name: str
) -> None:
    found, _ = verified[name]
    error = found.failures.get("moe-alphabet")
    assert isinstance(error, VerifyError), f"{name}: verify passed a kernel that turns wrong after {WEARS_OUT[name][0]} tokens"
    text = str(error)
    assert WEARS_OUT[name][1] in text, text
    # Right at first: its first answers passed before the kernel turned.
    assert "before the load" not in text, text
    print(f"{name}: {' | '.join(text.splitlines()[:3])}")
