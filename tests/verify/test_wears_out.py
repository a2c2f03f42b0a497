"""A MoE kernel that computes right for its first N calls and returns zeros after that fails verify at the
stage it turns wrong in, naming it (issue 39): the shape Spark owners report most, right on the demo
prompt and garbage from the Nth request, ``/health`` green.

Each image is the shipped local image plus one layer: a line after vLLM's CPU MoE kernel call
(``cpu_fused_moe`` in CPUUnquantizedExperts.apply, tests/data/break_vllm.py) that counts the calls and zeroes
the experts' output from call N on. The check is the shipped ``moe-alphabet`` at one level and two
repeats, its burn-in sized to that benchmark (84 requests: what the burn-in rule asks). Measured on this
image with a counting layer (two runs, 2026-12-06, x86_64), the kernel's calls when each stage ended:
answers 96, probes 162-164, numbers 274-276, burn-in 1282-1284, the benchmark 3178-3180 (the known-answer
run after repeat 1 ends near 2231, after repeat 2 at the benchmark's end), the answers asked again after
the load 3388-3390. So the kernel turns wrong after the answers (in the burn-in), after the kinds (in the
benchmark's first repeat) and after the benchmark, each N hundreds of calls inside its stage (the last 70),
and each image fails there, the stage named. The unmodified image passes the same check in every nightly
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

# N: the kernel's first wrong call, and the words verify's failure must say.
WEARS_OUT = {
    "in-the-burn-in": (600, "burn_in: "),
    "in-the-benchmark": (1500, "during the benchmark, after repeat 1 of 2"),
    "after-the-benchmark": (3250, "after the load ("),
}
COUNT = '__import__("builtins").__dict__.setdefault("_sparkbuild_calls", [0])'


def fault(n: int) -> str:
    """One statement after the kernel call: count it, and from call ``n`` on zero the experts' output."""
    return f"{COUNT}.__setitem__(0, {COUNT}[0] + 1) or ({COUNT}[0] >= {n} and output.mul_(0.0))"


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
    assert isinstance(error, VerifyError), f"{name}: verify passed a kernel that turns wrong after {WEARS_OUT[name][0]} calls"
    text = str(error)
    assert WEARS_OUT[name][1] in text, text
    # Right at first: its first answers passed before the kernel turned.
    assert "before the load" not in text, text
    print(f"{name}: {' | '.join(text.splitlines()[:3])}")
