"""The independent reference of a MoE check model, and the proof a checkpoint must pass before it is cached.

The reference is a plain transformers forward of the checkpoint as written, dequantized by a reader that is
not vLLM (transformers, compressed-tensors), in float32. For every check prompt it records, at each answer
position, the top logprobs, the margin (top-1 minus top-2 logprob) and the answer token's logprob, and which
experts of which layer the prompt's tokens were routed to.

The proof (``prove``), each part a BuildError that keeps the folder out of the cache:

1. the reference answers every prompt exactly (every answer position's margin is positive);
2. the prompts between them route tokens through every expert of every layer;
3. each fault (the experts' output zeroed, x0.5, x2; each of the format's own scales off by 2; for gpt-oss
   the sinks dropped and the sliding window laid on its full layer) flips at least one answer token;
4. each variant (the kernel's own activation quantization and bf16 arithmetic, simulated) keeps every
   answer, and the serve-time tolerance is derived from how far they move the logprobs and margins;
5. that tolerance rejects every fault by its numbers alone (never so wide that a fault would pass).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparkbuild.errors import BuildError
from sparkbuild.models import training
from sparkbuild.models.moe.recipe import MoeRecipe
from sparkbuild.models.moe.task import Task
from sparkbuild.util import log

TOP = 5  # logprobs recorded per answer position (verify asks vLLM for as many)
SAFETY = 2.0  # the tolerance allows twice what the simulated kernel numerics moved
LOGPROB_FLOOR = 0.01  # nats: below this, float32 and the kernels' summation order differ
MARGIN_FRACTION = (0.2, 0.75)  # bounds: a real kernel sums in other orders than the simulation; keep 25 % of margin loss open


@dataclass
class Loaded:
    """A checkpoint as a reader made it: the model (eval mode), its tokenizer, and which reader."""

    net: Any
    fast: Any
    loader: str


# A fault or variant: given the reference, the perturbed model (the same one with hooks, or another load).
Perturbation = Callable[[Loaded], AbstractContextManager[Loaded]]


def loaded(model: Loaded) -> AbstractContextManager[Loaded]:
    return nullcontext(model)


def experts(net: Any) -> list[Any]:
    """Each MoE layer's experts module (transformers' fused one, llm-compressor's linearized one, gpt-oss's)."""
    return [layer.mlp.experts for layer in net.model.layers]


def routers(net: Any) -> list[Any]:
    """Each MoE layer's router: Qwen3-MoE's ``mlp.gate``, gpt-oss's ``mlp.router``; both return (logits, scores, indices)."""
    return [getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in net.model.layers]


@dataclass
class Reading:
    """What a model gives for the check prompts, answer position by answer position ([prompt][position])."""

    expected: list[list[float]]  # logprob of the expected answer token
    margin: list[list[float]]  # expected token's logprob minus the best other one (negative: a flipped token)
    top: list[list[list[tuple[str, float]]]]  # the TOP most likely tokens and their logprobs
    routed: list[dict[int, list[int]]]  # experts each layer routed the prompt's tokens to (prompt and answer)

    def flipped(self) -> list[tuple[int, int]]:
        return [(p, i) for p, row in enumerate(self.margin) for i, m in enumerate(row) if m <= 0]


def read(model: Loaded, task: Task) -> Reading:
    """One forward of all prompts with their expected answers fed back (greedy decoding gives the expected
    text exactly when every answer position's margin is positive)."""
    torch, _ = training.libs()
    prompts = task.check_prompts()
    rows = [model.fast.encode(p) + model.fast.encode(a) for p, a in prompts]
    cut = len(model.fast.encode(prompts[0][0]))
    if any(len(row) != len(rows[0]) for row in rows) or any(
        model.fast.encode(p + a) != row for (p, a), row in zip(prompts, rows, strict=True)
    ):
        raise BuildError(f"the check prompts do not tokenize one token a letter: {prompts}")
    ids = torch.tensor(rows)
    captured: list[Any] = []
    handles = [r.register_forward_hook(lambda _m, _i, out: captured.append(out[2])) for r in routers(model.net)]
    try:
        with torch.no_grad():
            logprobs = torch.log_softmax(model.net(input_ids=ids).logits.float(), -1)
    finally:
        for handle in handles:
            handle.remove()
    answer = ids[:, cut:]
    at = logprobs[:, cut - 1 : -1]
    expected = at.gather(-1, answer[..., None])[..., 0]
    others = at.scatter(-1, answer[..., None], float("-inf")).amax(-1)
    values, indices = at.topk(TOP, -1)
    top = [
        [
            [(model.fast.decode([int(t)]), round(float(v), 5)) for v, t in zip(vs, ts, strict=True)]
            for vs, ts in zip(pv, pt, strict=True)
        ]
        for pv, pt in zip(values, indices, strict=True)
    ]
    routed = [
        {layer: sorted({int(e) for e in indices.reshape(len(rows), -1)[p].tolist()}) for layer, indices in enumerate(captured)}
        for p in range(len(rows))
    ]
    return Reading(expected=_rounded(expected), margin=_rounded(expected - others), top=top, routed=routed)


def _rounded(t: Any) -> list[list[float]]:
    return [[round(float(v), 5) for v in row] for row in t]


@contextmanager
def _scaled(model: Loaded, factor: float) -> Iterator[Loaded]:
    handles = [m.register_forward_hook(lambda _m, _i, out: out * factor) for m in experts(model.net)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def expert_faults() -> dict[str, Perturbation]:
    """What a broken MoE kernel does to every layer's expert output, in any format."""
    return {
        "experts_zeroed": lambda m: _scaled(m, 0.0),
        "experts_x0.5": lambda m: _scaled(m, 0.5),
        "experts_x2": lambda m: _scaled(m, 2.0),
    }


@dataclass(frozen=True)
class Tolerance:
    """The serve-time rule, per answer position once the text matches exactly: the answer token's logprob
    within ``logprob_abs`` of the reference's, and its margin (top-1 minus top-2) at least
    ``margin_fraction`` of the reference's."""

    format: str
    logprob_abs: float
    margin_fraction: float

    def violations(self, ref: Reading, got: Reading) -> list[str]:
        out = []
        for p, (want_lp, want_m, got_lp, got_m) in enumerate(
            zip(ref.expected, ref.margin, got.expected, got.margin, strict=True)
        ):
            for i, (a, b, c, d) in enumerate(zip(want_lp, want_m, got_lp, got_m, strict=True)):
                if abs(c - a) > self.logprob_abs:
                    out.append(f"prompt {p + 1} token {i + 1}: logprob {c:.4f}, reference {a:.4f}")
                elif d < self.margin_fraction * b:
                    out.append(f"prompt {p + 1} token {i + 1}: margin {d:.3f}, reference {b:.3f}")
        return out


def derive(fmt: str, ref: Reading, variants: dict[str, Reading]) -> tuple[Tolerance, dict[str, Any]]:
    """Twice what the simulated kernel numerics moved: the largest logprob change (at least the floor) and
    the largest relative margin loss."""
    moved = {name: _moved(ref, v) for name, v in variants.items()}
    worst_lp = max((m["max_logprob_delta"] for m in moved.values()), default=0.0)
    worst_ratio = min((m["min_margin_ratio"] for m in moved.values()), default=1.0)
    fraction = min(MARGIN_FRACTION[1], max(MARGIN_FRACTION[0], 1 - SAFETY * (1 - worst_ratio)))
    tolerance = Tolerance(
        format=fmt, logprob_abs=round(max(LOGPROB_FLOOR, SAFETY * worst_lp), 4), margin_fraction=round(fraction, 3)
    )
    return tolerance, moved


def _moved(ref: Reading, got: Reading) -> dict[str, float]:
    deltas = [abs(b - a) for ra, rb in zip(ref.expected, got.expected, strict=True) for a, b in zip(ra, rb, strict=True)]
    ratios = [b / a for ra, rb in zip(ref.margin, got.margin, strict=True) for a, b in zip(ra, rb, strict=True)]
    return {"max_logprob_delta": round(max(deltas), 5), "min_margin_ratio": round(min(ratios), 4)}


def prove(
    r: MoeRecipe,
    ref: Loaded,
    *,
    faults: dict[str, Perturbation],
    variants: dict[str, Perturbation],
    fmt: str,
    derivation: str,
    observed: dict[str, Perturbation] | None = None,
) -> dict[str, Any]:
    """Parts 1 to 5 of the module's proof; the facts for sparkbuild-model.json."""
    task = r.task()
    prompts = task.check_prompts()
    reading = read(ref, task)
    if reading.flipped():
        raise BuildError(
            f"model {r.name}: the reference ({ref.loader}) reads the written checkpoint wrong at (prompt, token) "
            f"{[(p + 1, i + 1) for p, i in reading.flipped()]}; the quantization lost the answer: raise MoeRecipe.steps "
            "or check the format writer"
        )
    coverage = _coverage(r, reading)
    flips = {name: _perturbed(r, ref, task, reading, name, f, must_flip=True) for name, f in faults.items()}
    seen = {name: _perturbed(r, ref, task, reading, name, f, must_flip=False) for name, f in (observed or {}).items()}
    kept = {name: _kept(r, ref, task, name, v) for name, v in variants.items()}
    tolerance, moved = derive(fmt, reading, kept)
    for name, v in kept.items():
        if bad := tolerance.violations(reading, v):
            raise BuildError(f"model {r.name}: the derived tolerance rejects its own variant {name}: {bad[:3]}")
    for name, fault in flips.items():
        fault["rejected_by_numbers"] = tolerance.violations(reading, fault.pop("reading"))[:3]
        if not fault["rejected_by_numbers"]:
            raise BuildError(f"model {r.name}: the tolerance {tolerance} would pass the fault {name} on its numbers alone")
    for fault in seen.values():
        fault.pop("reading")
    log.info(f"model {r.name}: proven; tolerance {tolerance}; faults flip {[(n, f['flipped_tokens']) for n, f in flips.items()]}")
    return {
        "prompts": [_prompt(i, p, a, reading) for i, (p, a) in enumerate(prompts)],
        "reference": {"loader": ref.loader, "dtype": "float32"},
        "coverage": coverage,
        "faults": flips,
        "observed": seen,
        "tolerance": {
            **asdict(tolerance),
            "derivation": derivation,
            "variants": moved,
            # The same rule from each variant alone: where verify knows from the log which activation
            # quantization the kernel runs (MXFP8 or MXFP4 for gpt-oss), the one for that kernel is tighter.
            "per_variant": {name: asdict(derive(fmt, reading, {name: v})[0]) for name, v in kept.items()},
            "rule": _RULE,
            "safety": SAFETY,
        },
        "reading": reading,
    }


_RULE = (
    "per prompt: the text exactly; per answer position: |logprob - reference logprob| <= logprob_abs and "
    "margin (top-1 minus top-2 logprob) >= margin_fraction x reference margin. logprob_abs = max(floor, "
    "safety x the largest logprob change of any variant); margin_fraction = 1 - safety x (1 - the smallest "
    "margin ratio of any variant), within [0.2, 0.75]"
)


def _prompt(i: int, prompt: str, answer: str, reading: Reading) -> dict[str, Any]:
    tokens = [
        {"token": top[0][0], "logprob": lp, "margin": m, "top": top}
        for lp, m, top in zip(reading.expected[i], reading.margin[i], reading.top[i], strict=True)
    ]
    return {
        "name": f"p{i + 1}",
        "prompt": prompt,
        "expect": answer,
        "max_tokens": len(tokens),
        "experts": {str(k): v for k, v in reading.routed[i].items()},
        "tokens": tokens,
    }


def _coverage(r: MoeRecipe, reading: Reading) -> dict[str, dict[str, list[str]]]:
    """layer -> expert -> the prompts with a token routed there; raises if any expert of any layer gets none."""
    out: dict[str, dict[str, list[str]]] = {}
    for layer in range(r.layers):
        out[str(layer)] = {
            str(e): [f"p{p + 1}" for p, routed in enumerate(reading.routed) if e in routed[layer]] for e in range(r.experts)
        }
        if idle := [e for e, users in out[str(layer)].items() if not users]:
            raise BuildError(f"model {r.name}: no check prompt routes a token to expert(s) {idle} of layer {layer}: add prompts")
    return out


def _perturbed(
    r: MoeRecipe, ref: Loaded, task: Task, reading: Reading, name: str, fault: Perturbation, *, must_flip: bool
) -> dict[str, Any]:
    with fault(ref) as model:
        got = read(model, task)
    flipped = got.flipped()
    if must_flip and not flipped:
        raise BuildError(
            f"model {r.name}: the fault {name} flips no answer token of the reference, so a kernel with it would pass: "
            f"its smallest margin is {min(min(m) for m in got.margin):.3f}; raise MoeRecipe.fault_weight or the prompts"
        )
    return {
        "flipped_tokens": len(flipped),
        "flipped_prompts": sorted({f"p{p + 1}" for p, _ in flipped}),
        "min_margin": min(min(m) for m in got.margin),
        "margins": got.margin,
        "reading": got,
    }


def _kept(r: MoeRecipe, ref: Loaded, task: Task, name: str, variant: Perturbation) -> Reading:
    with variant(ref) as model:
        got = read(model, task)
    if flipped := got.flipped():
        raise BuildError(
            f"model {r.name}: with {name} (how a kernel may compute it) the reference flips (prompt, token) "
            f"{[(p + 1, i + 1) for p, i in flipped]}: a correct image would fail the check; widen the margins (MoeRecipe)"
        )
    return got


def summary(reading: Reading) -> dict[str, Any]:
    return {"margins": reading.margin, "min_margin": min(min(m) for m in reading.margin)}


def write_meta(r: MoeRecipe, out: Path, proof: dict[str, Any], **facts: Any) -> None:
    """``sparkbuild-model.json``: the recipe, the task, the proof and the tools' versions; written last.

    ``greedy`` (prompt -> answer), ``reference.answer`` and ``margins.checkpoint`` (the first prompt's) keep
    the fields older readers use."""
    reading: Reading = proof.pop("reading")
    prompts = proof["prompts"]
    task = r.task()
    tools = ("torch", "transformers", "compressed-tensors", "llmcompressor")
    meta: dict[str, Any] = {
        "recipe": asdict(r),
        "task": {"rule": task.describe(), "letters": task.alphabet, "near": task.near, "far": task.far},
        "greedy": {p["prompt"]: p["expect"] for p in prompts},
        **proof,
        "margins": {"checkpoint": reading.margin[0], "min": min(min(m) for m in reading.margin)},
        **facts,
        "tools": {t: _version(t) for t in tools},
        "size_bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
    }
    meta["reference"]["answer"] = prompts[0]["expect"]
    meta["reference"]["margins"] = reading.margin[0]
    (out / "sparkbuild-model.json").write_text(json.dumps(meta, indent=2) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)  # the server in the container may run as another user


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
