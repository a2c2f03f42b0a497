"""The numbers behind a check's answers, held to the reference recorded when its model was made.

A MoE kernel that returns zeros, halves its output or misreads a scale can keep a greedy answer on a
model whose margins are wide; its logprobs still move. Each check model sparkbuild makes records, in
its ``sparkbuild-model.json``, the reference logprobs of every answer token (an independent forward of
the checkpoint as written) and a tolerance derived per format from simulated kernel numerics
(docs/check-models.md). verify asks the server for the top logprobs of every answer token and holds
each position to that rule: the token exact, its logprob within ``logprob_abs`` of the reference's, its
margin (top-1 minus top-2 logprob) at least ``margin_fraction`` of the reference's. The prompts go once
one by one and once all at the same time, so the batched MoE path is checked too. The tolerance is
read as the model recorded it, never widened here.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import requests

from sparkbuild.errors import VerifyError
from sparkbuild.verify import probes

META = "sparkbuild-model.json"
# How many violations a message quotes (the result file keeps them all).
SHOWN = 6
Mode = Literal["one by one", "batch"]


@dataclass(frozen=True, kw_only=True)
class Position:
    token: str
    logprob: float
    margin: float


@dataclass(frozen=True, kw_only=True)
class RefPrompt:
    name: str
    prompt: str
    max_tokens: int
    tokens: tuple[Position, ...]


@dataclass(frozen=True, kw_only=True)
class Reference:
    """What the model's maker recorded: per prompt, each answer position; and the serve-time rule."""

    format: str
    logprob_abs: float
    margin_fraction: float
    top: int
    prompts: tuple[RefPrompt, ...]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    mode: Mode
    positions: int
    violations: tuple[str, ...]
    # The worst figures seen: the largest logprob change and the smallest margin ratio.
    max_logprob_delta: float
    min_margin_ratio: float

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self) -> str:
        return (
            f"{self.mode}: {self.positions} positions, logprob moved at most {self.max_logprob_delta:.4f}, "
            f"margin kept at least {self.min_margin_ratio:.0%}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "positions": self.positions,
            "max_logprob_delta": round(self.max_logprob_delta, 6),
            "min_margin_ratio": round(self.min_margin_ratio, 4),
            "violations": list(self.violations),
        }


def load(folder: Path) -> Reference | None:
    """The folder's recorded reference, or None where its model recorded none (an older recipe, a
    folder or Hub model)."""
    try:
        meta: dict[str, Any] = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    tolerance, prompts = meta.get("tolerance"), meta.get("prompts")
    if not isinstance(tolerance, dict) or not isinstance(prompts, list):
        return None
    return Reference(
        format=str(tolerance["format"]),
        logprob_abs=float(tolerance["logprob_abs"]),
        margin_fraction=float(tolerance["margin_fraction"]),
        top=max(2, max((len(t["top"]) for p in prompts for t in p["tokens"]), default=2)),
        prompts=tuple(
            RefPrompt(
                name=str(p["name"]),
                prompt=str(p["prompt"]),
                max_tokens=int(p["max_tokens"]),
                tokens=tuple(Position(token=t["token"], logprob=t["logprob"], margin=t["margin"]) for t in p["tokens"]),
            )
            for p in prompts
        ),
    )


def compare(url: str, model: str, reference: Reference, check: str) -> tuple[Comparison, ...]:
    """Each recorded prompt one by one, then all at once; every position held to the rule."""
    one = [_ask(url, model, p, reference.top) for p in reference.prompts]
    with ThreadPoolExecutor(max_workers=len(reference.prompts)) as pool:
        batch = list(pool.map(lambda p: _ask(url, model, p, reference.top), reference.prompts))
    return (_judge("one by one", reference, one, check), _judge("batch", reference, batch, check))


def _ask(url: str, model: str, prompt: RefPrompt, top: int) -> dict[str, Any]:
    path = "/v1/completions"
    body = {"model": model, "prompt": prompt.prompt, "max_tokens": prompt.max_tokens, "temperature": 0, "logprobs": top}
    status, text = None, ""
    try:
        response = requests.post(url + path, json=body, timeout=probes.TIMEOUT_S)
        status, text = response.status_code, response.text
        response.raise_for_status()
        logprobs: dict[str, Any] = response.json()["choices"][0]["logprobs"]
        return logprobs
    except (requests.RequestException, KeyError, IndexError, ValueError, TypeError) as exc:
        raise probes.request_failed(
            f"{prompt.name}: POST {path} with logprobs failed: {exc}",
            name=prompt.name,
            path=path,
            body=body,
            status=status,
            response=text,
        ) from None


def _judge(mode: Mode, reference: Reference, answers: list[dict[str, Any]], check: str) -> Comparison:
    violations: list[str] = []
    deltas: list[float] = []
    ratios: list[float] = []
    for prompt, got in zip(reference.prompts, answers, strict=True):
        tokens = list(got.get("tokens") or [])
        wanted = [t.token for t in prompt.tokens]
        if tokens != wanted:
            violations.append(f"{check} {prompt.name} ({mode}): tokens {tokens}, reference {wanted}")
            continue
        for i, (want, lp, top) in enumerate(zip(prompt.tokens, got["token_logprobs"], got["top_logprobs"], strict=True)):
            margin = _margin(top)
            deltas.append(abs(lp - want.logprob))
            ratios.append(margin / want.margin)
            where = f"{check} {prompt.name} token {i + 1} ({want.token!r}, {mode})"
            if abs(lp - want.logprob) > reference.logprob_abs:
                allowed = f"allowed +-{reference.logprob_abs}, {reference.format}"
                violations.append(f"{where}: logprob {lp:.4f}, reference {want.logprob:.4f} ({allowed})")
            elif margin < reference.margin_fraction * want.margin:
                violations.append(
                    f"{where}: margin {margin:.3f}, reference {want.margin:.3f} "
                    f"(at least {reference.margin_fraction:.0%} of it, {reference.format})"
                )
    return Comparison(
        mode=mode,
        positions=sum(len(p.tokens) for p in reference.prompts),
        violations=tuple(violations),
        max_logprob_delta=max(deltas, default=0.0),
        min_margin_ratio=min(ratios, default=0.0),
    )


def _margin(top: dict[str, float]) -> float:
    """Top-1 minus top-2 logprob of one position."""
    best = sorted(top.values(), reverse=True)
    if len(best) < 2:
        raise VerifyError(f"the server gave {len(best)} top logprob(s) at a position; the comparison needs 2")
    return best[0] - best[1]


def problems(found: tuple[Comparison, ...]) -> list[str]:
    """The violations of every comparison, at most SHOWN of them, then how many more."""
    every = [v for c in found for v in c.violations]
    shown = [f"  {v}" for v in every[:SHOWN]]
    if len(every) > SHOWN:
        shown.append(f"  ... and {len(every) - SHOWN} more (verify.json lists them all)")
    return shown
