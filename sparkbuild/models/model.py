"""Make a tiny Llama model with a known answer, offline, cached by content.

The ``alphabet`` recipe learns the cyclic sequence ``a b c ... z``, so greedy decoding of
``c d e f`` continues `` g h i j``. ``alphabet-reversed`` learns it backwards: a model that
answers something else, for proving that verify fails on a wrong answer.

torch, transformers and tokenizers are imported only inside ``make`` (sparkbuild.models.training): planning never needs them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparkbuild.errors import BuildError
from sparkbuild.models import arithmetic, making, moe, training
from sparkbuild.util import log, runlock

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# Bump when the training code changes in a way that changes the weights.
RECIPE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    reverse: bool
    # What greedy decoding of "c d e f" must give right after training, before anyone serves it.
    expect: str
    hidden_size: int = 128
    layers: int = 2
    heads: int = 2
    intermediate_size: int = 256
    window: int = 12
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    seed: int = 1234
    version: int = RECIPE_VERSION

    def key(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    def sequence(self) -> str:
        return ALPHABET[::-1] if self.reverse else ALPHABET


RECIPES = {
    "alphabet": Recipe(name="alphabet", reverse=False, expect=" g h i j"),
    "alphabet-reversed": Recipe(name="alphabet-reversed", reverse=True, expect=" e d c b"),
}


def names() -> list[str]:
    """Every recipe ``sparkbuild model`` can make: the dense ones here, the quantized MoE ones in sparkbuild.models.moe."""
    return sorted([*RECIPES, *moe.RECIPES])


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise BuildError(f"unknown model recipe '{name}'; known: {', '.join(names())}")
    return RECIPES[name]


def recipe_key(name: str) -> str:
    """The key of recipe ``name`` alone (dense or MoE): the first part of its cache key."""
    return moe.key(name) if name in moe.RECIPES else recipe(name).key()


def key(name: str, arith: arithmetic.Arithmetic | None = None) -> str:
    """The cache key of recipe ``name``: its recipe's and the arithmetic's it is made with (this machine's)."""
    return f"{recipe_key(name)}-{(arith or arithmetic.current()).key()}"


def model_dir(cache: Path, name: str, arith: arithmetic.Arithmetic | None = None) -> Path:
    return cache / "models" / f"{name}-{key(name, arith)}"


def _maker(cache: Path, name: str) -> Callable[[Path], None]:
    """What writes the model folder for ``name`` (the quantized ones may first ensure the model they quantize)."""
    if name in moe.RECIPES:
        return lambda out: moe.make(moe.RECIPES[name], out, lambda base: ensure_here(cache, base))
    r = recipe(name)
    return lambda out: make(r, out)


def ensure(cache: Path, name: str) -> Path:
    """Return the model folder for ``name``, making it first if the cache lacks it: in a process of its own
    with the arithmetic pinned (sparkbuild/models/arithmetic.py, sparkbuild/models/making.py)."""
    arith = arithmetic.current()
    target = model_dir(cache, name, arith)
    if (target / "sparkbuild-model.json").is_file():
        log.info(f"model {name}: cached at {target}")
        return target
    _maker(cache, name)  # an unknown name fails here, before any process starts
    if not arith.can_make() and (made := made_elsewhere(cache, name, arith)) is not None:
        return made
    # One making of a model at a time: a second run that needs it (another nightly on the runner, the
    # suite's own early making) waits for the first and takes its model, instead of making it again.
    with runlock.hold(target.parent / f".{target.name}.lock", f"the making of model {name}"):
        if (target / making.META).is_file():
            log.info(f"model {name}: made by another run meanwhile; cached at {target}")
            return target
        making.run(cache, name, arith)
    return target


def made_elsewhere(cache: Path, name: str, arith: arithmetic.Arithmetic) -> Path | None:
    """Where this host lacks the model tools (an install without ``sparkbuild[model]``, serving checks only),
    the cached model of ``name``'s recipe made on this kind of machine with the same pins (copied here from one
    that has them); None where there is none. Its key names the tools' versions this host cannot read, so
    several such models are ambiguous: an error naming them."""
    found = []
    for folder in sorted((cache / "models").glob(f"{name}-{recipe_key(name)}-*")):
        meta = folder / making.META
        recorded = json.loads(meta.read_text()).get("arithmetic") if meta.is_file() else None
        if isinstance(recorded, dict) and arith.same_machine(recorded):
            found.append(folder)
    if len(found) > 1:
        raise BuildError(
            f"model {name}: the model tools are not installed here, and the cache holds {len(found)} models of its "
            f"recipe made for this machine with other tools: {', '.join(f.name for f in found)}; install "
            "'sparkbuild[model]' so that the key chooses, or keep one of them in the cache"
        )
    if found:
        log.info(f"model {name}: the model tools are not installed here; using {found[0]} (made with the same pins)")
        return found[0]
    return None


def ensure_here(cache: Path, name: str) -> Path:
    """``ensure`` in this process: the making process's own work (and the base a quantized recipe needs).
    A model made here enters the cache only where the pinned arithmetic is in effect: its key says it is."""
    arith = arithmetic.current()
    target = model_dir(cache, name, arith)
    if (target / "sparkbuild-model.json").is_file():
        log.info(f"model {name}: cached at {target}")
        return target
    maker = _maker(cache, name)  # an unknown name fails here, before any folder is made
    with log.step(f"Making model '{name}' (cached by content at {target})"):
        log.info(f"  arithmetic: {arith.describe()}")
        target.parent.mkdir(parents=True, exist_ok=True)
        # A folder of its own, renamed last: an interrupted or concurrent run never leaves or sees a half model.
        partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial"))
        try:
            maker(partial)
            making.require_pinned(arith, name)
            making.record(partial, key(name, arith), arith)
            try:
                partial.rename(target)
            except OSError:
                if not (target / "sparkbuild-model.json").is_file():
                    raise
                log.info(f"model {name}: another run finished it first; using {target}")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _windows(sequence: str, window: int) -> list[str]:
    """Every ``window``-letter run of the cyclic sequence, letters joined by spaces."""
    doubled = sequence * 3
    return [" ".join(doubled[i : i + window]) for i in range(len(sequence))]


def train(r: Recipe) -> tuple[Any, Any, float]:
    """The trained dense model, its tokenizer and its last loss."""
    torch, tf = training.libs()
    torch.manual_seed(r.seed)
    corpus = _windows(r.sequence(), r.window)
    tokenizer, fast = training.train_tokenizer(corpus)
    config = tf.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.heads,
        max_position_embeddings=128,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = tf.LlamaForCausalLM(config)
    ids = torch.tensor([tokenizer.encode(text).ids for text in corpus])
    loss = training.train(
        model,
        lambda _: ids[torch.randint(0, len(ids), (r.batch_size,))],
        lambda net, batch, _: net(input_ids=batch, labels=batch).loss,
        steps=r.steps,
        learning_rate=r.learning_rate,
    )
    return model, fast, loss


def make(r: Recipe, out: Path) -> None:
    model, fast, loss = train(r)
    answer = training.greedy(model, fast, "c d e f", 4)
    log.info(
        f"model {r.name}: {sum(p.numel() for p in model.parameters())} parameters, "
        f"final loss {loss:.4f}, greedy 'c d e f' -> {answer!r}"
    )
    if answer != r.expect:
        raise BuildError(
            f"model {r.name} did not learn its sequence: 'c d e f' -> {answer!r}, expected {r.expect!r}; "
            f"raise Recipe.steps in {__file__}"
        )
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    meta: dict[str, Any] = {"recipe": asdict(r), "greedy": {"c d e f": answer}}
    (out / "sparkbuild-model.json").write_text(json.dumps(meta, indent=2) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)  # the server in the container may run as another user
