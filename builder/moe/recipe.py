"""A MoE check model's recipe: plain data, hashed into its cache key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal

from builder.moe.task import Task


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
    # gpt-oss only: its sliding layers see 4 tokens, so the task's far letter (4 before the current) is out of their reach.
    sliding_window: int = 4
    # The task (builder/moe/task.py): next = TABLE[z[-far]][z[-near]] over ``letters`` letters.
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
    # Fault-aware training (builder/moe/trained.py): from this fraction of the steps on, half of each batch
    # runs with the experts' output scaled out of its band, and its right answers are penalized.
    fault_from: float = 0.5
    fault_weight: float = 1.0
    seed: int = 1234
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
