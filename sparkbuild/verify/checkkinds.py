"""Check kinds for depth and time: what Spark owners run by hand against a real model, made here.

A server can give a check's short answers right and still fail its users: gpt-oss on a Spark scored
0.000 on GSM8K with a healthy server until vLLM PR #52148 fixed SM12x prefill with sinks; users report
runs of token 0 after a few thousand tokens of context, loops after hours, garbage from the 5th or 6th
request. A check names the kinds it runs under ``kinds:`` (matrix.yaml, defaults in defaults.yaml's
``check_kinds:``); verify runs them after the answers and the client probes. Each is made by sparkbuild
from a seed, with no dataset download:

- ``arithmetic``: two-step word problems with exact whole-number answers; at least a fraction right.
- ``needles``: a pass key at each depth of a prompt that fills the served context, counted with the
  served tokenizer (POST /tokenize), so each depth is a token position; every key found.
- ``burn_in``: the check's own prompts, N requests at a concurrency; every answer right.
- ``long_generation``: one greedy generation judged for degenerate repetition (runs, short loops).

The judging functions are pure (tests/verify/test_checkkinds.py holds them to both sides of each rule);
the rest asks the server. Each kind gives an ``Outcome``: whether it passed, its figure against its
rule, and each item that went wrong. docs/check-kinds.md: the rules, why, and what only a runner
serving the real models proves.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import requests

from sparkbuild.errors import VerifyError
from sparkbuild.plan.matrix import Arithmetic, BurnIn, Check, LongGeneration, Needles, Prompt
from sparkbuild.util import log
from sparkbuild.verify import benchmark, probes

# How many wrong items an error quotes per kind (verify.json keeps them all).
SHOWN = 4
# How much of a text an item quotes.
QUOTE_CHARS = 60


class Answered(Protocol):
    """An answer as verify judges it (sparkbuild/verify/verify.py's Answer)."""

    @property
    def name(self) -> str: ...
    @property
    def expected(self) -> str: ...
    @property
    def received(self) -> str: ...
    @property
    def ok(self) -> bool: ...


Ask = Callable[[Prompt], Answered]
# The text of some tokens (POST /detokenize), for a message about them.
TextOf = Callable[[Sequence[int]], str]


@dataclass(frozen=True, kw_only=True)
class Outcome:
    kind: str
    ok: bool
    # The kind's figure against its rule, in words.
    summary: str
    # Each item that went wrong, naming it and its figure (a passing arithmetic set may have some).
    wrong: tuple[str, ...] = ()
    figures: dict[str, Any] = field(default_factory=dict)


def run(url: str, model: str, check: Check, ask: Ask) -> tuple[Outcome, ...]:
    """Every kind the check names, in the order of matrix.KIND_NAMES, each logged with its verdict."""
    kinds = check.kinds
    steps: list[Callable[[], Outcome]] = []
    if kinds.arithmetic is not None:
        steps.append(partial(arithmetic, url, model, kinds.arithmetic))
    if kinds.needles is not None:
        steps.append(partial(needles, url, model, kinds.needles))
    if kinds.burn_in is not None:
        steps.append(partial(burn_in, kinds.burn_in, check.prompts, ask))
    if kinds.long_generation is not None:
        steps.append(partial(long_generation, url, model, kinds.long_generation))
    found = []
    for step in steps:
        outcome = step()
        log.info(f"  {outcome.kind}: {outcome.summary} [{'ok' if outcome.ok else 'FAILED'}]")
        found.append(outcome)
    return tuple(found)


def problems(found: Sequence[Outcome]) -> list[str]:
    """Each failed kind with its figure, then at most SHOWN of its wrong items."""
    lines = []
    for outcome in (o for o in found if not o.ok):
        lines.append(f"  {outcome.kind}: {outcome.summary}")
        lines += [f"    {item}" for item in outcome.wrong[:SHOWN]]
        if len(outcome.wrong) > SHOWN:
            lines.append(f"    ... and {len(outcome.wrong) - SHOWN} more (verify.json lists them all)")
    return lines


def _quote(text: str) -> str:
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


# --- arithmetic -------------------------------------------------------------------------------

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Yuki", "Ines")
THINGS = ("marbles", "stickers", "pencils", "apples", "cards", "stamps", "shells", "cookies", "beads", "coins")


@dataclass(frozen=True)
class Question:
    text: str
    answer: int


def _draw(rng: random.Random, low: int, high: int) -> int:
    """A whole number in [low, high] from ``rng.random()`` alone: Python keeps random() and its seeding
    the same from one version to the next, not randint() or choice(), and the set must not change."""
    return low + int(rng.random() * (high - low + 1))


def _problem(rng: random.Random) -> Question:
    """One two-step word problem in GSM8K's manner, short, with small factors: a healthy model needs
    no written working to answer it."""
    name, things, shape = NAMES[_draw(rng, 0, len(NAMES) - 1)], THINGS[_draw(rng, 0, len(THINGS) - 1)], _draw(rng, 0, 4)
    if shape == 0:
        have, bags, each = _draw(rng, 10, 99), _draw(rng, 2, 9), _draw(rng, 3, 12)
        return Question(
            f"{name} has {have} {things} and buys {bags} bags of {each} {things}. How many {things} now?", have + bags * each
        )
    if shape == 1:
        each, friends, left = _draw(rng, 2, 9), _draw(rng, 2, 9), _draw(rng, 1, 60)
        text = f"{name} has {each * friends + left} {things} and gives {each} to each of {friends} friends. How many are left?"
        return Question(text, left)
    if shape == 2:
        monday, more = _draw(rng, 10, 99), _draw(rng, 2, 40)
        text = f"A shop sells {monday} {things} on Monday and {more} more than that on Tuesday. How many in all?"
        return Question(text, 2 * monday + more)
    if shape == 3:
        friends, each, kept = _draw(rng, 2, 9), _draw(rng, 2, 15), _draw(rng, 2, 20)
        text = (
            f"{name} keeps {kept} of {friends * each + kept} {things} and shares the rest among {friends} friends "
            "equally. How many each?"
        )
        return Question(text, each)
    pages, days, last = _draw(rng, 5, 30), _draw(rng, 2, 9), _draw(rng, 1, 30)
    return Question(
        f"{name} reads {pages} pages a day for {days} days, then {last} more. How many pages in all?", pages * days + last
    )


def questions(seed: int, count: int, *, stream: str = "questions", avoid: Sequence[Question] = ()) -> tuple[Question, ...]:
    """``count`` different problems from ``seed`` (none of ``avoid``): the same on every machine and
    Python run (random.Random hashes a string seed with SHA-512, not with the per-process hash)."""
    # Not for secrets: a reproducible question set.
    rng = random.Random(f"{seed}/{stream}")  # noqa: S311
    taken = {q.text for q in avoid}
    found: dict[str, Question] = {}
    while len(found) < count:
        q = _problem(rng)
        if q.text not in taken:
            found.setdefault(q.text, q)
    return tuple(found.values())


def arithmetic_prompt(examples: Sequence[Question], question: Question) -> str:
    """The worked examples, then the question, as a completion to go on with the answer."""
    shown = "".join(f"Question: {q.text}\nAnswer: {q.answer}\n\n" for q in examples)
    return f"{shown}Question: {question.text}\nAnswer:"


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*")


def number_in(text: str) -> int | None:
    """The first whole number of an answer's first line ("1,234" reads 1234); None where it has none."""
    first = text.strip().split("\n", 1)[0]
    found = _NUMBER.search(first)
    return None if found is None else int(found.group().replace(",", ""))


def judge_arithmetic(settings: Arithmetic, asked: Sequence[Question], texts: Sequence[str]) -> Outcome:
    """Right where the answer's first number is the exact answer; the set passes with at least
    ``pass_fraction`` of the questions right."""
    wrong = [
        f"q{i} {_quote(q.text)}: expected {q.answer}, answered {_quote(text)}"
        for i, (q, text) in enumerate(zip(asked, texts, strict=True), 1)
        if number_in(text) != q.answer
    ]
    right = len(asked) - len(wrong)
    # Rounded first: 0.7 * 10 is 7.000000000000001 in floating point, and 7 right must pass.
    needed = math.ceil(round(settings.pass_fraction * len(asked), 9))
    summary = f"{right}/{len(asked)} right, at least {needed} ({settings.pass_fraction:.0%}) needed (seed {settings.seed})"
    figures = {"right": right, "questions": len(asked), "needed": needed, "seed": settings.seed}
    return Outcome(kind="arithmetic", ok=right >= needed, summary=summary, wrong=tuple(wrong), figures=figures)


def arithmetic(url: str, model: str, settings: Arithmetic) -> Outcome:
    asked = questions(settings.seed, settings.questions)
    shown = questions(settings.seed, settings.shots, stream="examples", avoid=asked)
    texts = []
    for i, q in enumerate(asked, 1):
        prompt = arithmetic_prompt(shown, q)
        ids, context = tokenized(url, model, prompt, special=True)
        if len(ids) + settings.max_tokens > context:
            # Said here, not left to the server's refusal: which question, its figure, what to change.
            raise VerifyError(
                f"arithmetic q{i}: the question with its {settings.shots} example(s) is {len(ids)} tokens and its answer "
                f"{settings.max_tokens}, more than the served context ({context}): serve a longer one or lower shots"
            )
        body = {**_body(model, prompt, settings.max_tokens), "stop": ["\n"]}
        texts.append(str(_complete(url, body, f"arithmetic q{i}")["text"]))
    return judge_arithmetic(settings, asked, texts)


# --- needles ----------------------------------------------------------------------------------

# The pass-key retrieval task (Mohtashami and Jaggi, 2023): a key in repeated filler, asked for at the end.
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True, kw_only=True)
class Placed:
    """One needle prompt: its token ids, the key, and the token position where the needle starts."""

    depth: float
    key: int
    ids: tuple[int, ...]
    position: int


def place(
    depth: float,
    key: int,
    *,
    head: Sequence[int],
    filler: Sequence[int],
    needle: Sequence[int],
    question: Sequence[int],
    context: int,
    max_tokens: int,
) -> Placed:
    """The prompt ``head + filler[:at] + needle + filler[at:room] + question``: the needle at ``depth``
    of the filler, and prompt plus answer exactly the served ``context`` (the server refuses one token
    more). ``filler``: token ids, at least as many as the room left."""
    room = context - max_tokens - len(head) - len(needle) - len(question)
    if room < 1:
        raise VerifyError(
            f"needles: the served context ({context} tokens) has no room for filler beside the pass key "
            f"({len(needle)} tokens), the question ({len(question)}) and the answer ({max_tokens}): "
            "serve a longer context, or name no needles for this check"
        )
    assert len(filler) >= room, "the caller tokenizes filler enough for the room"
    at = round(depth * room)
    ids = (*head, *filler[:at], *needle, *filler[at:room], *question)
    return Placed(depth=depth, key=key, ids=ids, position=len(head) + at)


def pass_keys(seed: int, count: int) -> tuple[int, ...]:
    """``count`` different five-digit keys from ``seed``."""
    rng = random.Random(f"{seed}/needles")  # noqa: S311 - reproducible keys, not secrets
    keys: dict[int, None] = {}
    while len(keys) < count:
        keys.setdefault(_draw(rng, 10_000, 99_999))
    return tuple(keys)


def judge_needles(context: int, placed: Sequence[Placed], texts: Sequence[str]) -> Outcome:
    """Each answer must contain its key (as a whole number); every key must be found."""
    wrong = [
        f"at {p.depth:.0%} (token {p.position:,} of {context:,}): expected pass key {p.key}, answered {_quote(text)}"
        for p, text in zip(placed, texts, strict=True)
        if re.search(rf"(?<!\d){p.key}(?!\d)", text) is None
    ]
    depths = ", ".join(f"{p.depth:.0%}" for p in placed)
    summary = f"{len(placed) - len(wrong)}/{len(placed)} pass keys found, at {depths} of a {context:,}-token context"
    figures = {"context": context, "found": len(placed) - len(wrong), "positions": [p.position for p in placed]}
    return Outcome(kind="needles", ok=not wrong, summary=summary, wrong=tuple(wrong), figures=figures)


def needles(url: str, model: str, settings: Needles) -> Outcome:
    # The BOS token where the tokenizer adds one, and the served context (as GET /v1/models gives it).
    head, context = tokenized(url, model, "", special=True)
    question = _tokenize(url, model, QUESTION)
    keys = pass_keys(settings.seed, len(settings.depths))
    pieces = [_tokenize(url, model, NEEDLE.format(key=key)) for key in keys]
    room = context - settings.max_tokens - len(head) - len(question) - min(len(p) for p in pieces)
    unit = max(1, len(_tokenize(url, model, FILLER)))
    filler = _tokenize(url, model, FILLER * (max(room, 0) // unit + 2))
    placed = [
        place(d, k, head=head, filler=filler, needle=p, question=question, context=context, max_tokens=settings.max_tokens)
        for d, k, p in zip(settings.depths, keys, pieces, strict=True)
    ]
    # A long prefill: at least 100 tokens a second on anything that serves such a context.
    timeout = probes.TIMEOUT_S + context // 100
    texts = [
        str(_complete(url, _body(model, list(p.ids), settings.max_tokens), f"needles at {p.depth:.0%}", timeout)["text"])
        for p in placed
    ]
    return judge_needles(context, placed, texts)


# --- burn-in ----------------------------------------------------------------------------------


def judge_burn_in(settings: BurnIn, answers: Sequence[Answered]) -> Outcome:
    """Every answer must be right: greedy decoding gives a healthy server's answer to the same
    prompt every time, so any wrong one is the fault."""
    wrong = [
        f"request {i} of {len(answers)} ({a.name}): expected {a.expected!r}, received {_quote(a.received)}"
        for i, a in enumerate(answers, 1)
        if not a.ok
    ]
    right = len(answers) - len(wrong)
    summary = f"{right}/{len(answers)} answers right, {settings.concurrency} at a time"
    figures = {"requests": len(answers), "concurrency": settings.concurrency, "right": right}
    return Outcome(kind="burn_in", ok=not wrong, summary=summary, wrong=tuple(wrong), figures=figures)


def burn_in(settings: BurnIn, prompts: Sequence[Prompt], ask: Ask) -> Outcome:
    order = [prompts[i % len(prompts)] for i in range(settings.requests)]
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        futures = [pool.submit(ask, p) for p in order]
        answers = [_answer(i, len(futures), f) for i, f in enumerate(futures, 1)]
    return judge_burn_in(settings, answers)


def burn_in_too_short(check: Check) -> str | None:
    """Why ``check``'s burn-in does not meet the rule for the MoE check models (issue 39), or None.

    A MoE kernel that turns wrong with use passes answers asked once. So a check of a sparkbuild check model
    whose kernel path names ``moe`` burns in at least as many requests as its benchmark sends, at its highest
    level, every answer judged (a check without ``bench`` as if it had one: its served twin's figures)."""
    if check.hub is not None or check.path is not None or not any(kind == "moe" for kind, _ in check.kernels):
        return None
    need = benchmark.requests_sent(check.concurrency, check.bench_repeats)
    top = max(check.concurrency)
    found = check.kinds.burn_in
    if found is not None and found.requests >= need and found.concurrency >= top:
        return None
    has = f"its burn_in is {{requests: {found.requests}, concurrency: {found.concurrency}}}" if found else "it names no burn_in"
    return (
        f"check {check.name} serves a MoE check model through a moe kernel path, and {has}: give it at least "
        f"the benchmark's requests at its highest level, kinds: burn_in: {{requests: {need}, concurrency: {top}}} "
        "(docs/check-kinds.md)"
    )


def _answer(i: int, count: int, future: Future[Answered]) -> Answered:
    try:
        return future.result()
    except VerifyError as exc:
        raise VerifyError(f"burn_in request {i} of {count}: {exc}", request=exc.request) from None


# --- long generation --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Run:
    token: int
    start: int
    length: int


def longest_run(ids: Sequence[int]) -> Run:
    """The longest stretch of one token repeated (the first, of equal ones)."""
    best = Run(token=-1, start=0, length=0)
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            if i - start > best.length:
                best = Run(token=ids[start], start=start, length=i - start)
            start = i
    return best


def distinct_per_window(ids: Sequence[int], window: int) -> list[int]:
    """How many different tokens each window of ``window`` consecutive tokens holds (one window of
    all of them where there are fewer)."""
    size = min(window, len(ids))
    if size == 0:
        return []
    counts: dict[int, int] = {}
    for token in ids[:size]:
        counts[token] = counts.get(token, 0) + 1
    found = [len(counts)]
    for i in range(size, len(ids)):
        counts[ids[i]] = counts.get(ids[i], 0) + 1
        gone = ids[i - size]
        counts[gone] -= 1
        if counts[gone] == 0:
            del counts[gone]
        found.append(len(counts))
    return found


def period(block: Sequence[int]) -> int | None:
    """The shortest period of ``block`` that repeats at least twice in it, or None."""
    return next((p for p in range(1, len(block) // 2 + 1) if all(block[i] == block[i + p] for i in range(len(block) - p))), None)


def judge_long_generation(settings: LongGeneration, ids: Sequence[int], finish_reason: str, text_of: TextOf) -> Outcome:
    """Degenerate repetition: a token more than ``max_run`` times in a row, or a window of ``window``
    tokens with fewer than ``min_distinct`` different ones (a loop of fewer tokens than that fills a
    window with at most as many). The generation must also reach ``tokens``: one that ended early
    checked nothing past its end."""
    wrong = []
    if len(ids) < settings.tokens:
        wrong.append(
            f"the text ended after {len(ids)} of {settings.tokens} tokens (finish_reason {finish_reason!r}): nothing past "
            "that was checked; give long_generation a prompt that asks for more"
        )
    run = longest_run(ids)
    if run.length > settings.max_run:
        wrong.append(
            f"token {run.token} ({text_of([run.token])!r}) {run.length} times in a row from token {run.start + 1} "
            f"(at most {settings.max_run})"
        )
    counts = distinct_per_window(ids, settings.window)
    poorest = min(counts, default=0)
    bad = [i for i, n in enumerate(counts) if n < settings.min_distinct]
    if bad:
        # Where it starts, and what it is where it is poorest (inside the loop, not at its edge).
        size = min(settings.window, len(ids))
        block = ids[counts.index(poorest) : counts.index(poorest) + size]
        loop = period(block)
        shape = f"a loop of {loop} token(s), {text_of(block[:loop])!r}" if loop else _quote(text_of(block))
        wrong.append(
            f"tokens {bad[0] + 1}-{bad[0] + size}: {counts[bad[0]]} different tokens in {size} (at least "
            f"{settings.min_distinct}), and {len(bad)} such window(s), the poorest {poorest}: {shape}"
        )
    summary = (
        f"{len(ids)} tokens, longest run {run.length} (at most {settings.max_run}), fewest different tokens in "
        f"{settings.window} {poorest} (at least {settings.min_distinct})"
    )
    figures = {"tokens": len(ids), "longest_run": run.length, "fewest_distinct": poorest, "finish_reason": finish_reason}
    return Outcome(kind="long_generation", ok=not wrong, summary=summary, wrong=tuple(wrong), figures=figures)


def long_generation(url: str, model: str, settings: LongGeneration) -> Outcome:
    body = {**_body(model, settings.prompt, settings.tokens), "return_token_ids": True}
    # At least 4 tokens a second on anything that serves a check.
    choice = _complete(url, body, "long_generation", probes.TIMEOUT_S + settings.tokens // 4)
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise VerifyError(
            "long_generation: the server gave no token_ids for return_token_ids (vLLM gives them from 0.10.2): "
            "is it vLLM, and that new?"
        )
    return judge_long_generation(settings, ids, str(choice.get("finish_reason")), lambda some: _detokenize(url, model, some))


# --- requests ---------------------------------------------------------------------------------


def _body(model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _post(url: str, path: str, body: dict[str, Any], what: str, timeout: int = probes.TIMEOUT_S) -> dict[str, Any]:
    """The JSON the server answers ``body`` with, or VerifyError with the request and its response."""
    status, text = None, ""
    try:
        response = requests.post(url + path, json=body, timeout=timeout)
        status, text = response.status_code, response.text
        response.raise_for_status()
        answer = response.json()
        if not isinstance(answer, dict):
            raise ValueError(f"a JSON {type(answer).__name__}, not an object")
        return answer
    except (requests.RequestException, ValueError) as exc:
        shown = body if not isinstance(body.get("prompt"), list) else {**body, "prompt": f"{len(body['prompt'])} token ids"}
        raise probes.request_failed(
            f"{what}: POST {path} failed: {exc}: {text.strip()[:300]}",
            name=what,
            path=path,
            body=shown,
            status=status,
            response=text,
        ) from None


def _complete(url: str, body: dict[str, Any], what: str, timeout: int = probes.TIMEOUT_S) -> dict[str, Any]:
    """The first choice of a completion."""
    try:
        choice: dict[str, Any] = _post(url, "/v1/completions", body, what, timeout)["choices"][0]
        return choice
    except (KeyError, IndexError, TypeError) as exc:
        raise VerifyError(f"{what}: POST /v1/completions gave no choices ({exc!r}): is it an OpenAI-compatible server?") from None


def _tokenize(url: str, model: str, text: str) -> list[int]:
    return tokenized(url, model, text)[0]


def tokenized(url: str, model: str, text: str, *, special: bool = False) -> tuple[list[int], int]:
    """``text``'s token ids by the served tokenizer and the served context (vLLM's POST /tokenize)."""
    answer = _post(url, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": special}, "tokenize")
    ids, context = answer.get("tokens"), answer.get("max_model_len")
    if not isinstance(ids, list) or not isinstance(context, int):
        raise VerifyError(f"POST {url}/tokenize gave no tokens and max_model_len ({str(answer)[:200]}): is it a vLLM server?")
    return [int(i) for i in ids], context


def _detokenize(url: str, model: str, ids: Sequence[int]) -> str:
    return str(_post(url, "/detokenize", {"model": model, "tokens": list(ids)}, "detokenize").get("prompt", ids))
