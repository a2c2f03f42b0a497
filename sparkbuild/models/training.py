"""The one training loop and tokenizer every check model shares (the dense ``alphabet``, the MoE ones).

A check model is trained here from nothing in a few hundred steps on 2 CPU cores, so the loop is plain
PyTorch: AdamW, one batch a step, an optional cosine decay. Each recipe brings what differs: how a batch
is drawn and what its loss is (the MoE recipes add their experts' faults to it).

torch, transformers and tokenizers are imported only when called: planning never needs them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sparkbuild.errors import ToolMissingError

# Renders the conversation as the plain text the model was trained on.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def libs() -> tuple[Any, Any]:
    """torch and transformers, typed as Any: their own annotations are partial and not ours to check."""
    try:
        importlib.import_module("tokenizers")
        return importlib.import_module("torch"), importlib.import_module("transformers")
    except ImportError as exc:
        raise ToolMissingError(
            f"making a check model needs torch, transformers and tokenizers ({exc.name} is missing): "
            "pip install 'sparkbuild[model]'"
        ) from None


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread: a tiny model's steps are too small to share, and on a busy 2-core machine
    (CI, other jobs) two threads waiting on each other made a step 20 times slower than one thread alone."""
    torch, _ = libs()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(
    net: Any,
    sample: Callable[[int], Any],
    loss: Callable[[Any, Any, int], Any],
    *,
    steps: int,
    learning_rate: float,
    cosine: bool = False,
) -> float:
    """Train ``net`` for ``steps`` AdamW steps: ``sample(step)`` draws a batch, ``loss(net, batch, step)``
    scores it. With ``cosine`` the rate warms up over 50 steps and decays to a tenth (the MoE recipes, whose
    fault terms unsettle a constant rate late in training). Returns the last step's loss; leaves ``net``
    in eval mode."""
    torch, _ = libs()
    optimizer = torch.optim.AdamW(net.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _rate(step, steps) if cosine else 1.0)
    net.train()
    value = float("nan")
    with one_thread():
        for step in range(steps):
            batch = sample(step)
            result = loss(net, batch, step)
            optimizer.zero_grad()
            result.backward()
            optimizer.step()
            schedule.step()
            value = float(result.item())
    net.eval()
    return value


def _rate(step: int, steps: int) -> float:
    warm = min(1.0, (step + 1) / 50)
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))


def train_tokenizer(corpus: list[str]) -> tuple[Any, Any]:
    """A byte-level BPE tokenizer learnt from ``corpus``: the raw one and its transformers wrapper."""
    tok: Any = importlib.import_module("tokenizers")
    _, tf = libs()
    tokenizer = tok.Tokenizer(tok.models.BPE())
    tokenizer.pre_tokenizer = tok.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tok.decoders.ByteLevel()
    tokenizer.train_from_iterator(
        corpus,
        tok.trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=tok.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")  # noqa: S106
    fast.chat_template = CHAT_TEMPLATE
    return tokenizer, fast


def greedy(model: Any, tokenizer: Any, prompt: str, tokens: int) -> str:
    """The model's greedy continuation of ``prompt``, ``tokens`` tokens long, as text."""
    torch, _ = libs()
    with torch.no_grad():
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return str(tokenizer.decode(out[0, ids.shape[1] :]))
