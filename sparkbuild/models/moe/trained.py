"""Train a tiny MoE on the lookup-chain task (sparkbuild/models/moe/task.py) so that its answers need its experts at
their own magnitude, and write the unquantized ``moe-alphabet``.

Fault-aware training: the answer must be right with the experts' output anywhere in [0.8, 1.25] of its
own (quantization moves it about that much) and wrong once it is scaled by 1/8..1/2 or 2..8 (a kernel that
halves, doubles or drops a scale). From ``fault_from`` of the steps on, half of each batch runs with such a
scale on every MoE layer and is penalized for each right answer (an unlikelihood term, -log(1 - p)). So a
MoE kernel whose output is off by 2 either way flips answer tokens by design, not by luck; the proof in
sparkbuild/models/moe/reference.py checks that it does before the model is cached.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkbuild.models import training
from sparkbuild.models.moe import reference
from sparkbuild.models.moe.recipe import MoeRecipe
from sparkbuild.models.moe.task import Encoder, Task
from sparkbuild.util import log

# The band the experts' output may move in and still answer (quantization, bf16), and the faults' scales.
NOMINAL = (0.8, 1.25)
FAULTS = ((1 / 8, 1 / 2), (2.0, 8.0))


def config(r: MoeRecipe, vocab_size: int, fast: Any) -> Any:
    _, tf = training.libs()
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": r.hidden_size,
        "num_hidden_layers": r.layers,
        "num_attention_heads": r.heads,
        "num_key_value_heads": r.kv_heads,
        "head_dim": r.head_dim,
        "num_experts_per_tok": r.experts_per_token,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.eos_token_id,
        "tie_word_embeddings": False,
    }
    if r.arch == "gpt_oss":
        # gpt-oss alternates sliding and full attention layers; every layer has attention sinks.
        layer_types = ["sliding_attention", "full_attention"] * (r.layers // 2)
        return tf.GptOssConfig(
            **common,
            intermediate_size=r.expert_size,
            num_local_experts=r.experts,
            sliding_window=r.sliding_window,
            layer_types=layer_types,
        )
    return tf.Qwen3MoeConfig(
        **common,
        # Unused (every layer is sparse) but read by loaders: twice the expert width, as Qwen3-MoE models have.
        intermediate_size=2 * r.expert_size,
        moe_intermediate_size=r.expert_size,
        num_experts=r.experts,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=128,
    )


class ExpertScale:
    """Multiplies every MoE layer's expert output by ``value`` (None: untouched), through forward hooks."""

    def __init__(self, net: Any) -> None:
        self.value: Any = None
        self.handles = [m.register_forward_hook(self._hook) for m in reference.experts(net)]

    def _hook(self, _module: Any, _inputs: Any, output: Any) -> Any:
        return output if self.value is None else output * self.value

    @contextmanager
    def scaled(self, value: Any) -> Iterator[None]:
        self.value = value
        try:
            yield
        finally:
            self.value = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def fit(r: MoeRecipe, net: Any, task: Task, encode: Encoder, *, attention_only: bool = False) -> float:
    """Train ``net`` on ``task`` with the fault-aware loss; returns the last step's nominal cross-entropy.
    ``attention_only``: the experts' output is zeroed throughout and there are no fault terms (the
    attention-only twin bench/check_models.py compares the check model with)."""
    torch, _ = training.libs()
    generator = torch.Generator().manual_seed(r.seed + 1)
    scale = ExpertScale(net)
    last = {"ce": float("nan")}

    def sample(_step: int) -> Any:
        return encode(task.sample(r.batch_size, generator))

    def loss(net: Any, ids: Any, step: int) -> Any:
        size, length = ids.shape
        faulted = size // 2 if step >= r.fault_from * r.steps and not attention_only else 0
        nominal = size - faulted
        scales = torch.exp(torch.empty(size).uniform_(math.log(NOMINAL[0]), math.log(NOMINAL[1]), generator=generator))
        for i in range(faulted):
            low, high = FAULTS[i % 2]
            scales[nominal + i] = math.exp(torch.empty(()).uniform_(math.log(low), math.log(high), generator=generator))
        if attention_only:
            scales.zero_()
        with scale.scaled(scales.repeat_interleave(length)[:, None]):
            logits = net(input_ids=ids).logits[:, task.far - 1 : -1].float()
        targets = ids[:, task.far :]
        ce = torch.nn.functional.cross_entropy(logits[:nominal].reshape(-1, logits.shape[-1]), targets[:nominal].reshape(-1))
        last["ce"] = float(ce.item())
        if not faulted:
            return ce
        right = logits[nominal:].softmax(-1).gather(-1, targets[nominal:, :, None])[..., 0]
        return ce + r.fault_weight * -torch.log1p(-right.clamp(max=1 - 1e-6)).mean()

    try:
        training.train(net, sample, loss, steps=r.steps, learning_rate=r.learning_rate, cosine=True)
    finally:
        scale.remove()
    return last["ce"]


def train(r: MoeRecipe, *, attention_only: bool = False) -> tuple[Any, Any]:
    """The trained float32 model and its tokenizer."""
    torch, tf = training.libs()
    torch.manual_seed(r.seed)
    task = r.task()
    tokenizer, fast = training.train_tokenizer(task.corpus(2000))
    net = tf.AutoModelForCausalLM.from_config(config(r, tokenizer.get_vocab_size(), fast), dtype=torch.float32)
    ce = fit(r, net, task, Encoder(task, fast), attention_only=attention_only)
    log.info(f"model {r.name}: {parameters(net)} parameters, final cross-entropy {ce:.4f} ({task.describe()})")
    return net, fast


def parameters(net: Any) -> int:
    return int(sum(p.numel() for p in net.parameters()))


def make(r: MoeRecipe, out: Path) -> None:
    """The unquantized model in bfloat16 (the dtype the quantized ones start from and vLLM serves)."""
    torch, tf = training.libs()
    start = time.monotonic()
    net, fast = train(r)
    before = reference.summary(reference.read(reference.Loaded(net=net, fast=fast, loader="trained"), r.task()))
    net.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)

    def load(dtype: Any) -> reference.Loaded:
        return reference.Loaded(
            net=tf.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval(),
            fast=tf.AutoTokenizer.from_pretrained(out),
            loader=f"transformers from_pretrained, {str(dtype).removeprefix('torch.')} compute",
        )

    proof = reference.prove(
        r,
        load(torch.float32),
        faults=reference.expert_faults(),
        variants={"bf16": lambda _: reference.loaded(load(torch.bfloat16))},
        fmt="bf16",
        derivation="bf16: the reference computed in bfloat16 (how a Spark image serves it by default)",
    )
    reference.write_meta(
        r,
        out,
        proof,
        parameters=parameters(net),
        trained_float32=before,
        making_s=round(time.monotonic() - start, 1),
    )
