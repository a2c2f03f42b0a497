"""Small mixture-of-experts check models in the quantized formats real Spark deployments serve.

Each is trained on the lookup-chain task (sparkbuild/models/moe/task.py) so that its answers need its experts, and
at their own magnitude; written in one format, and proven by an independent reference before the
folder may enter the cache (sparkbuild/models/moe/reference.py; docs/check-models.md):

- ``moe-alphabet``: the unquantized Qwen3-MoE (bfloat16) that ``moe-nvfp4`` and ``moe-fp8`` quantize;
- ``moe-nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (FP4 weights and activations), by llm-compressor;
- ``moe-fp8``: compressed-tensors FP8 with 128x128 weight blocks (Qwen3-30B-A3B-FP8's layout), by llm-compressor;
- ``gptoss-mxfp4``: a GptOssForCausalLM (attention sinks, sliding window) with gpt-oss's own MXFP4 experts.

Nothing here imports torch at import time: planning and the command line never pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# The recipes and their keys live in recipe.py, below the modules that make each kind.
from sparkbuild.models.moe.recipe import RECIPES as RECIPES
from sparkbuild.models.moe.recipe import VERSION as VERSION
from sparkbuild.models.moe.recipe import MoeRecipe
from sparkbuild.models.moe.recipe import key as key


def make(r: MoeRecipe, out: Path, ensure_base: Callable[[str], Path]) -> None:
    """Write the checkpoint of ``r`` into ``out``; ``ensure_base`` gives the cached model it quantizes."""
    if r.scheme == "bf16":
        from sparkbuild.models.moe import trained

        trained.make(r, out)
    elif r.scheme == "mxfp4":
        from sparkbuild.models.moe import mxfp4

        mxfp4.make(r, out)
    else:
        from sparkbuild.models.moe import compressed

        assert r.base is not None
        compressed.make(r, out, ensure_base(r.base))
