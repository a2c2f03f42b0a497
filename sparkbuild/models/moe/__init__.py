"""Small mixture-of-experts check models in the quantized formats real Spark deployments serve.

Each is trained on the lookup-chain task (sparkbuild/models/moe/task.py) so that its answers need its experts, and
at their own magnitude; written in one format, and proven by an independent reference before the
folder may enter the cache (sparkbuild/models/moe/reference.py; docs/check-models.md):

- ``moe-alphabet``: the unquantized Qwen3-MoE (bfloat16) that ``moe-nvfp4`` and ``moe-fp8`` quantize;
- ``moe-nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (FP4 weights and activations), by llm-compressor;
- ``moe-nvfp4a16``: the same format with FP4 weights only (W4A16, bf16 activations), by llm-compressor;
- ``moe-fp8``: compressed-tensors FP8 with 128x128 weight blocks (Qwen3-30B-A3B-FP8's layout), by llm-compressor;
- ``gptoss-mxfp4``: a GptOssForCausalLM (attention sinks, sliding window) with gpt-oss's own MXFP4 experts.

Nothing here imports torch at import time: planning and the command line never pay for it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from sparkbuild.errors import BuildError

# The recipes and their keys live in recipe.py, below the modules that make each kind.
from sparkbuild.models.moe.recipe import RECIPES as RECIPES
from sparkbuild.models.moe.recipe import VERSION as VERSION
from sparkbuild.models.moe.recipe import MoeRecipe
from sparkbuild.models.moe.recipe import key as key
from sparkbuild.util import log

META = "sparkbuild-model.json"


def make(r: MoeRecipe, out: Path, ensure_base: Callable[[str], Path]) -> None:
    """Write the checkpoint of ``r`` into ``out``; ``ensure_base`` gives the cached model it quantizes."""
    if r.base is not None:
        from sparkbuild.models.moe import compressed

        compressed.make(r, out, ensure_base(r.base))
    elif r.scheme == "mxfp4":
        from sparkbuild.models.moe import mxfp4

        search(r, out, mxfp4.make)
    else:
        from sparkbuild.models.moe import trained

        search(r, out, trained.make)


def search(r: MoeRecipe, out: Path, maker: Callable[[MoeRecipe, Path], None]) -> None:
    """Train ``r`` from its seed, and where the model fails its proof, from the next seed, ``r.tries`` seeds
    at most: a bounded search, each try recorded in ``sparkbuild-model.json`` (``search``). Whether a model
    needs its gpt-oss sinks, say, is a property of its trained weights, and those depend on the machine's
    arithmetic wherever it cannot be pinned (aarch64); the search reaches a proven model there too, and on
    x86_64, whose arithmetic is pinned, it takes the same seeds on every machine."""
    tried: list[dict[str, object]] = []
    for seed in range(r.seed, r.seed + r.tries):
        try:
            maker(dataclasses.replace(r, seed=seed), out)
        except BuildError as exc:
            tried.append({"seed": seed, "unproven": str(exc)})
            log.warning(f"model {r.name}: seed {seed} gives no proven model ({exc}); {r.seed + r.tries - seed - 1} more to try")
            for path in out.iterdir():
                path.unlink()
            continue
        meta = json.loads((out / META).read_text())
        meta["search"] = {"seed": seed, "tries": r.tries, "unproven": tried}
        (out / META).write_text(json.dumps(meta, indent=2) + "\n")
        return
    reasons = "; ".join(f"seed {t['seed']}: {t['unproven']}" for t in tried)
    raise BuildError(
        f"model {r.name}: none of its {r.tries} seeds gives a proven model ({reasons}); raise MoeRecipe.steps or tries"
    )
