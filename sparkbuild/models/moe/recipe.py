"""A MoE check model's recipe: plain data, hashed into its cache key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Literal

from sparkbuild.models.moe.task import Task


@dataclass(frozen=True, kw_only=True)
class MoeRecipe:
    name: str
    arch: Literal["qwen3_moe", "gpt_oss"]
    # "bf16" (not quantized), an llm-compressor scheme ("NVFP4", "NVFP4A16", "FP8_BLOCK") or "mxfp4" (gpt-oss's own).
    scheme: str
    # The recipe whose trained model this one quantizes; None: it trains its own.
    base: str | None = None
    hidden_size: int = 256
    expert_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 4
    experts_per_token: int = 2
    # gpt-oss only: its sliding layers see 4 tokens, so the task's far letter (4 before the current) is out of their reach.
    sliding_window: int = 4
    # The task (sparkbuild/models/moe/task.py): next = TABLE[z[-far]][z[-near]] over ``letters`` letters.
    letters: int = 16
    near: int = 1
    far: int = 5
    length: int = 14
    answer: int = 6
    prompts: int = 8
    task_seed: int = 28
    steps: int = 1000
    batch_size: int = 32
    learning_rate: float = 3e-3
    # Fault-aware training (sparkbuild/models/moe/trained.py): from this fraction of the steps on, half of each batch
    # runs with the experts' output scaled out of its band, and its right answers are penalized.
    fault_from: float = 0.5
    fault_weight: float = 1.0
    seed: int = 1234
    # A trained recipe whose model fails its proof is trained again from the next seed, this many seeds at most.
    tries: int = 3
    version: int

    def key(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    def task(self) -> Task:
        return Task(
            letters=self.letters,
            near=self.near,
            far=self.far,
            length=self.length,
            answer=self.answer,
            prompts=self.prompts,
            seed=self.task_seed,
        )


# Bump when the training or quantizing code changes in a way that changes the checkpoints.
VERSION = 4

# Dimensions chosen so that no vLLM MoE backend pads (padding is a different code path from the one real
# models take): hidden 256 meets the largest hidden alignment (TRT-LLM FP4 MoE and Marlin MXFP4 round
# hidden up to 256), the expert width 128 the intermediate one (CUTLASS/FlashInfer/TRT-LLM/Marlin round
# it up to 128), and every dense FP4 GEMM's K and N are multiples of 32 (CUTLASS FP4 on SM120) and of
# the 16-element NVFP4 group, the 32-element MXFP4 block and the 128x128 FP8 weight block. Both
# architectures run the same task (sparkbuild/models/moe/task.py) with the same prompts.
_QWEN3 = MoeRecipe(name="moe-alphabet", arch="qwen3_moe", scheme="bf16", version=VERSION)
RECIPES: dict[str, MoeRecipe] = {
    "moe-alphabet": _QWEN3,
    "moe-nvfp4": replace(_QWEN3, name="moe-nvfp4", scheme="NVFP4", base="moe-alphabet"),
    "moe-fp8": replace(_QWEN3, name="moe-fp8", scheme="FP8_BLOCK", base="moe-alphabet"),
    # NVFP4 weights with bf16 activations (W4A16): the MoE layers vLLM 0.33.0 gives Marlin on a GB10 and
    # the nvfp4-moe-b12x-auto patch gives b12x (vLLM issue #54666); the W4A4 moe-nvfp4 takes FlashInfer's
    # CUTLASS either way, so only this model's check sees the patch.
    "moe-nvfp4a16": replace(_QWEN3, name="moe-nvfp4a16", scheme="NVFP4A16", base="moe-alphabet"),
    # gpt-oss learns the task more slowly (its sliding layers see 4 tokens; only the full layer reaches the far
    # letter): at 1000 steps some answers stay within a logit of the runner-up, and which ones depends on the
    # machine's float arithmetic (seeds 1234-1236 on one x86_64: smallest margins -0.38, -0.10, -1.96: not made).
    # 2000 steps: 6.5 on the same machine, and the model is proven before it is cached on any other.
    "gptoss-mxfp4": MoeRecipe(name="gptoss-mxfp4", arch="gpt_oss", scheme="mxfp4", steps=2000, version=VERSION),
}


def key(name: str) -> str:
    """The cache key of recipe ``name``: its own fields and, for a quantized one, its base's key."""
    r = RECIPES[name]
    return r.key() if r.base is None else f"{r.key()[:8]}{key(r.base)[:8]}"
