"""Small mixture-of-experts check models in the quantized formats real Spark deployments serve.

Each recipe trains a tiny MoE on the alphabet task (greedy ``c d e f`` -> `` g h i j``), writes it in one
quantized format, and proves the saved checkpoint with an independent reference (transformers loading it
on CPU) before the folder may enter the cache:

- ``moe-alphabet``: the unquantized Qwen3-MoE (bfloat16) that ``moe-nvfp4`` and ``moe-fp8`` quantize;
- ``moe-nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (FP4 weights and activations), by llm-compressor;
- ``moe-fp8``: compressed-tensors FP8 with 128x128 weight blocks (Qwen3-30B-A3B-FP8's layout), by llm-compressor;
- ``gptoss-mxfp4``: a GptOssForCausalLM (attention sinks, sliding window) with gpt-oss's own MXFP4 experts.

Nothing here imports torch at import time: planning and the command line never pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from builder.moe.recipe import MoeRecipe

# Bump when the training or quantizing code changes in a way that changes the checkpoints.
VERSION = 2

# Dimensions chosen so that no vLLM MoE backend pads (padding is a different code path from the one real
# models take): hidden 256 meets the largest hidden alignment (TRT-LLM FP4 MoE and Marlin MXFP4 round
# hidden up to 256), the expert width 128 the intermediate one (CUTLASS/FlashInfer/TRT-LLM/Marlin round
# it up to 128), and every dense FP4 GEMM's K and N are multiples of 32 (CUTLASS FP4 on SM120) and of
# the 16-element NVFP4 group, the 32-element MXFP4 block and the 128x128 FP8 weight block.
RECIPES: dict[str, MoeRecipe] = {
    "moe-alphabet": MoeRecipe(name="moe-alphabet", arch="qwen3_moe", scheme="bf16", version=VERSION),
    "moe-nvfp4": MoeRecipe(name="moe-nvfp4", arch="qwen3_moe", scheme="NVFP4", base="moe-alphabet", version=VERSION),
    "moe-fp8": MoeRecipe(name="moe-fp8", arch="qwen3_moe", scheme="FP8_BLOCK", base="moe-alphabet", version=VERSION),
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
