"""Train a tiny MoE on the alphabet task, and prove a saved checkpoint with transformers as the reference.

The proof is the same for every format: transformers loads the folder as written (decompressing or
dequantizing it on CPU), greedy decoding of the prompt must give the expected answer, and each answer
token's logit margin (its logit minus the best other one, with the expected answer fed back) is recorded.
A wrong answer raises, so the folder never reaches the cache (``model.ensure`` renames it in last).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from builder import log
from builder.errors import BuildError, ToolMissingError
from builder.moe.recipe import EXPECT, PROMPT, MoeRecipe


def libs() -> tuple[Any, Any]:
    """torch and transformers, typed as Any: their own annotations are partial and not ours to check."""
    try:
        return importlib.import_module("torch"), importlib.import_module("transformers")
    except ImportError as exc:
        raise ToolMissingError(
            f"making the MoE check models needs torch and transformers ({exc.name} is missing): pip install 'sparkbuild[model]'"
        ) from None


def config(r: MoeRecipe, vocab_size: int, fast: Any) -> Any:
    _, tf = libs()
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


def train(r: MoeRecipe) -> tuple[Any, Any]:
    """The trained float32 model and its tokenizer; raises when greedy decoding misses the answer."""
    from builder import model as dense

    torch, tf = libs()
    torch.manual_seed(r.seed)
    corpus = dense._windows(dense.ALPHABET, r.window)
    tokenizer, fast = dense.train_tokenizer(corpus)
    net = tf.AutoModelForCausalLM.from_config(config(r, tokenizer.get_vocab_size(), fast), dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(text).ids for text in corpus])
    optimizer = torch.optim.AdamW(net.parameters(), lr=r.learning_rate)
    net.train()
    for _ in range(r.steps):
        batch = ids[torch.randint(0, len(ids), (r.batch_size,))]
        loss = net(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    net.eval()
    answer = dense._greedy(net, fast, PROMPT, 4)
    log.info(f"model {r.name}: {parameters(net)} parameters, final loss {loss.item():.4f}, {PROMPT!r} -> {answer!r}")
    if answer != EXPECT:
        raise BuildError(f"model {r.name} did not learn the alphabet: {PROMPT!r} -> {answer!r}; raise MoeRecipe.steps")
    return net, fast


def parameters(net: Any) -> int:
    return int(sum(p.numel() for p in net.parameters()))


def margins(net: Any, fast: Any) -> list[float]:
    """Per answer token: its logit minus the best other logit, the expected answer fed back (negative: wrong)."""
    torch, _ = libs()
    prompt, answer = fast.encode(PROMPT), fast.encode(EXPECT)
    with torch.no_grad():
        logits = net(input_ids=torch.tensor([prompt + answer])).logits[0].float()
    out = []
    for i, token in enumerate(answer):
        row = logits[len(prompt) - 1 + i].clone()
        right = float(row[token])
        row[token] = float("-inf")
        out.append(round(right - float(row.max()), 3))
    return out


def margins_without_experts(net: Any, fast: Any) -> list[float]:
    """The margins with every expert weight zeroed (restored after): how much of the answer the experts carry.

    The alphabet is a bigram task that attention and the embeddings can solve alone, so a MoE kernel that
    returns zeros or small noise leaves the answer right with smaller margins; only a check of the margins
    (served logprobs against these) catches it. Recorded so that such a check has its numbers."""
    torch, _ = libs()
    saved = {n: p.detach().clone() for n, p in net.named_parameters() if ".experts." in n}
    params = dict(net.named_parameters())
    with torch.no_grad():
        for name in saved:
            params[name].zero_()
        try:
            return margins(net, fast)
        finally:
            for name, value in saved.items():
                params[name].copy_(value)


def reference(r: MoeRecipe, folder: Path, **load: Any) -> dict[str, Any]:
    """Load ``folder`` with transformers on CPU, decode greedily, and raise unless the answer is right."""
    _, tf = libs()
    return prove(r, tf.AutoModelForCausalLM.from_pretrained(folder, **load), tf.AutoTokenizer.from_pretrained(folder))


def prove(r: MoeRecipe, net: Any, fast: Any) -> dict[str, Any]:
    """Greedy decoding of the loaded checkpoint must give the answer; its margins are part of the proof."""
    from builder import model as dense

    answer = dense._greedy(net, fast, PROMPT, 4)
    found = {"answer": answer, "margins": margins(net, fast), "dtype": str(net.dtype).removeprefix("torch.")}
    log.info(f"model {r.name}: reference {PROMPT!r} -> {answer!r}, margins {found['margins']}")
    if answer != EXPECT:
        raise BuildError(
            f"model {r.name}: transformers reads the written checkpoint as {PROMPT!r} -> {answer!r}, expected {EXPECT!r}; "
            "the quantization lost the answer: raise MoeRecipe.steps (wider margins) or check the format writer"
        )
    return found


def write_meta(r: MoeRecipe, out: Path, key: str, **facts: Any) -> None:
    """``sparkbuild-model.json``: the recipe, the reference's proof and the tools' versions; written last."""
    tools = ("torch", "transformers", "compressed-tensors", "llmcompressor")
    meta: dict[str, Any] = {
        "recipe": asdict(r),
        "key": key,
        "greedy": {PROMPT: EXPECT},
        **facts,
        "tools": {t: _version(t) for t in tools},
        "size_bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
    }
    (out / "sparkbuild-model.json").write_text(json.dumps(meta, indent=2) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)  # the server in the container may run as another user


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def make(r: MoeRecipe, out: Path) -> None:
    """The unquantized model in bfloat16 (the dtype the quantized ones start from and vLLM serves)."""
    from builder import moe

    torch, _ = libs()
    start = time.monotonic()
    net, fast = train(r)
    trained = margins(net, fast)
    alone = margins_without_experts(net, fast)
    net.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    proof = reference(r, out)
    write_meta(
        r,
        out,
        moe.key(r.name),
        parameters=parameters(net),
        margins={"float32": trained, "checkpoint": proof["margins"], "float32_experts_zeroed": alone},
        reference=proof,
        making_s=round(time.monotonic() - start, 1),
    )
