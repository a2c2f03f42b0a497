"""Small mixture-of-experts check models in the quantized formats real Spark deployments serve.

Each is trained on the lookup-chain task (builder/moe/task.py) so that its answers need its experts, and
at their own magnitude; written in one format, and proven by an independent reference before the
folder may enter the cache (builder/moe/reference.py; docs/check-models.md):

- ``moe-alphabet``: the unquantized Qwen3-MoE (bfloat16) that ``moe-nvfp4`` and ``moe-fp8`` quantize;
- ``moe-nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (FP4 weights and activations), by llm-compressor;
- ``moe-fp8``: compressed-tensors FP8 with 128x128 weight blocks (Qwen3-30B-A3B-FP8's layout), by llm-compressor;
- ``gptoss-mxfp4``: a GptOssForCausalLM (attention sinks, sliding window) with gpt-oss's own MXFP4 experts.

Nothing here imports torch at import time: planning and the command line never pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from builder.moe.recipe import MoeRecipe

# Bump when the training or quantizing code changes in a way that changes the checkpoints.
VERSION = 3

# Dimensions chosen so that no vLLM MoE backend pads (padding is a different code path from the one real
# models take): hidden 256 meets the largest hidden alignment (TRT-LLM FP4 MoE and Marlin MXFP4 round
# hidden up to 256), the expert width 128 the intermediate one (CUTLASS/FlashInfer/TRT-LLM/Marlin round
# it up to 128), and every dense FP4 GEMM's K and N are multiples of 32 (CUTLASS FP4 on SM120) and of
# the 16-element NVFP4 group, the 32-element MXFP4 block and the 128x128 FP8 weight block. Both
# architectures run the same task (builder/moe/task.py) with the same prompts.
_QWEN3 = MoeRecipe(name="moe-alphabet", arch="qwen3_moe", scheme="bf16", version=VERSION)
RECIPES: dict[str, MoeRecipe] = {
    "moe-alphabet": _QWEN3,
    "moe-nvfp4": replace(_QWEN3, name="moe-nvfp4", scheme="NVFP4", base="moe-alphabet"),
    "moe-fp8": replace(_QWEN3, name="moe-fp8", scheme="FP8_BLOCK", base="moe-alphabet"),
    "gptoss-mxfp4": MoeRecipe(name="gptoss-mxfp4", arch="gpt_oss", scheme="mxfp4", version=VERSION),
}


def key(name: str) -> str:
    """The cache key of recipe ``name``: its own fields and, for a quantized one, its base's key."""
    r = RECIPES[name]
    return r.key() if r.base is None else f"{r.key()[:8]}{key(r.base)[:8]}"


def make(r: MoeRecipe, out: Path, ensure_base: Callable[[str], Path]) -> None:
    """Write the checkpoint of ``r`` into ``out``; ``ensure_base`` gives the cached model it quantizes."""
    if r.scheme == "bf16":
        from builder.moe import trained

        trained.make(r, out)
    elif r.scheme == "mxfp4":
        from builder.moe import mxfp4

        mxfp4.make(r, out)
    else:
        from builder.moe import compressed

        assert r.base is not None
        compressed.make(r, out, ensure_base(r.base))
