"""A quantized MoE check model's recipe: plain data, hashed into its cache key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal

PROMPT = "c d e f"
EXPECT = " g h i j"


@dataclass(frozen=True, kw_only=True)
class MoeRecipe:
    name: str
    arch: Literal["qwen3_moe", "gpt_oss"]
    # "bf16" (not quantized), an llm-compressor scheme ("NVFP4", "FP8_BLOCK") or "mxfp4" (gpt-oss's own).
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
    # gpt-oss only: its sliding layers see 4 tokens, fewer than the prompt and answer, so the window bites.
    sliding_window: int = 4
    window: int = 12
    steps: int = 150
    batch_size: int = 16
    learning_rate: float = 3e-3
    seed: int = 1234
    version: int

    def key(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]
