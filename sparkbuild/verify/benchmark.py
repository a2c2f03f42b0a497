"""Speed, measured with vLLM's own benchmark (``vllm bench serve``): what to run and what it said.

Pure: builds the argument lists, reads the result files vLLM saves, and checks the figures for
consistency. Running them is ``sparkbuild.verify.verify``'s (the benchmark runs from the image under test,
so it is the same vLLM as the server).

Three scenarios per concurrency level, the three numbers a Spark user judges an image by:

- decode: prompt 2048 / output 128 tokens at ``--max-concurrency c``; tok/s is the figure;
- prefill: a long prompt and a short output; TTFT is the figure;
- queueing: a burst of ``QUEUE_FACTOR * c`` requests at once (``--request-rate inf``, no client-side
  cap): the server admits what it can and queues the rest; TTFT p99 is the figure.

A model whose context window is shorter than a scenario has its lengths scaled down (``shape``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from sparkbuild.errors import VerifyError
from sparkbuild.plan.matrix import Prompt

Scenario = Literal["decode", "prefill", "queueing"]
SCENARIOS: tuple[Scenario, ...] = ("decode", "prefill", "queueing")

# The shape each scenario asks for when the context window allows it (input, output tokens).
# decode: the shape of the from-source Spark comparison (seeds/004); prefill: a long prompt.
FULL_SHAPES: dict[Scenario, tuple[int, int]] = {"decode": (2048, 128), "prefill": (4096, 8), "queueing": (512, 32)}
# Scaled down, an output keeps at least this many tokens: fewer make TPOT a figure of 2 or 3 gaps.
MIN_OUTPUT = {"decode": 16, "prefill": 4, "queueing": 8}
# vLLM's random dataset decodes random token ids and encodes them again; the count can grow by a
# few tokens. An eighth of the window (at least 4 tokens) is left free so no request is refused.
TOKENIZER_SLACK = 8
QUEUE_FACTOR = 4
# A window the full shapes fit in: the number of requests does not depend on the shapes.
FULL_WINDOW = 1 << 16
# Requests per concurrency slot in the decode and prefill runs (more average out a slow first one),
# and at least MIN_REQUESTS: a figure is a median over a run's requests, and the median of 2 is their
# mean, which one request slowed by a busy machine moves by half (the check models here answer a
# request in tens of ms, so 16 cost about a second).
ROUNDS = 2
MIN_REQUESTS = 16
WARMUPS = 2
SEED = 14
PERCENTILES = (50, 99)

# Nothing measured may be faster than this. One stream's token takes a vLLM engine step
# (schedule, forward, sample, detokenize, one server-sent event): above 0.1 ms on any hardware
# sparkbuild targets, so above 10,000 tok/s per stream is a measuring error (the hand-made
# benchmark this replaces printed 82,375 tok/s for a model that decodes a few hundred).
MIN_STEP_MS = 0.1
MAX_STREAM_TOKENS_PER_S = 1000 / MIN_STEP_MS
# Streams at their own decode rate bound the aggregate; TPOT is a median, so some streams are
# faster than it: this much above c x (1000 / TPOT p50) is still consistent.
AGGREGATE_SLACK = 1.25


@dataclass(frozen=True, kw_only=True)
class Shape:
    input_len: int
    output_len: int


def shape(scenario: Scenario, window: int) -> Shape:
    """The scenario's input and output lengths within a context window of ``window`` tokens.

    The full shape where it fits. Else both are scaled by the same factor to fit in the window less
    the tokenizer slack, the output kept at its minimum and the prompt given the rest, so the
    prompt still dominates (decode: 2048/128 becomes 96/16 in a 128-token window).
    """
    full_in, full_out = FULL_SHAPES[scenario]
    usable = window - max(4, window // TOKENIZER_SLACK)
    if full_in + full_out <= usable:
        return Shape(input_len=full_in, output_len=full_out)
    output = max(MIN_OUTPUT[scenario], full_out * usable // (full_in + full_out))
    if usable - output < 1:
        raise VerifyError(
            f"a context window of {window} tokens leaves no room for a {scenario} benchmark "
            f"({output} output tokens); serve the check model with a longer --max-model-len"
        )
    return Shape(input_len=usable - output, output_len=output)


def context_window(model_config: dict[str, Any], serve_args: Sequence[str]) -> int:
    """The served context: ``max_position_embeddings`` of the model's config.json, or the serve
    arguments' ``--max-model-len`` where that is shorter."""
    window = model_config.get("max_position_embeddings")
    if not isinstance(window, int) or window < 1:
        raise VerifyError(
            "the check model's config.json has no max_position_embeddings; the benchmark needs the "
            "context window to size its prompts (remake the model: sparkbuild model NAME)"
        )
    args = list(serve_args)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--max-model-len" and i + 1 < len(args) else None
        if arg.startswith("--max-model-len="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            window = min(window, int(value))
    return window


@dataclass(frozen=True, kw_only=True)
class Run:
    """One ``vllm bench serve`` invocation: a scenario at a concurrency level, one repeat."""

    scenario: Scenario
    concurrency: int
    repeat: int
    shape: Shape

    @property
    def name(self) -> str:
        return f"{self.scenario}-c{self.concurrency}-r{self.repeat}"

    @property
    def num_prompts(self) -> int:
        if self.scenario == "queueing":  # one burst: its size is what the level measures
            return self.concurrency * QUEUE_FACTOR
        return max(MIN_REQUESTS, self.concurrency * ROUNDS)

    @property
    def in_flight(self) -> int:
        """The most requests the client has open at once: the level, or every request of the
        queueing burst (no client-side cap)."""
        return self.num_prompts if self.scenario == "queueing" else self.concurrency


def runs(concurrency: Sequence[int], window: int, repeats: int) -> list[Run]:
    """Every run of a check: each repeat of each scenario at each level, repeats outermost so a
    slow spell of the machine spreads over the levels instead of skewing one."""
    shapes = {s: shape(s, window) for s in SCENARIOS}
    return [
        Run(scenario=s, concurrency=c, repeat=r, shape=shapes[s]) for r in range(repeats) for c in concurrency for s in SCENARIOS
    ]


def arguments(run: Run, *, url: str, model: str, tokenizer: str, result_dir: str) -> list[str]:
    """The ``vllm bench serve`` arguments of ``run`` (after ``vllm``), against the server at ``url``."""
    args = [
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(run.shape.input_len),
        "--random-output-len",
        str(run.shape.output_len),
        # Every prompt the same length: the figures of two nights compare like with like.
        "--random-range-ratio",
        "0",
        # Every request generates its full output even where the model would stop.
        "--ignore-eos",
        "--num-prompts",
        str(run.num_prompts),
        "--request-rate",
        "inf",
        "--seed",
        str(SEED + run.repeat),
        "--num-warmups",
        str(WARMUPS),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        ",".join(map(str, PERCENTILES)),
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        f"{run.name}.json",
        "--disable-tqdm",
    ]
    if run.scenario != "queueing":  # queueing: no client-side cap, the server's queue is what is measured
        args += ["--max-concurrency", str(run.concurrency)]
    return args


# --- the check's own answers, through the benchmark's client --------------------------------

# The speed runs' prompts are random token ids with --ignore-eos: no answer is known for them, so the
# benchmark's outputs cannot be judged. After each repeat, the check's own completion prompts go through
# the same client (vLLM's ShareGPT dataset from a file: its custom dataset needs pandas, which vLLM's
# images do not carry), greedy, and every answer is judged: a kernel that turns wrong while the speed is
# measured fails the check there, naming the repeat.
KNOWN_DATASET = "known.json"
# vLLM's ShareGPT dataset drops a prompt of fewer tokens than this (datasets.is_valid_sequence).
MIN_PROMPT_TOKENS = 4


@dataclass(frozen=True, kw_only=True)
class Known:
    """The check's own prompts after repeat ``repeat``: ``requests`` of them, ``concurrency`` at a time."""

    repeat: int
    requests: int
    concurrency: int
    max_tokens: int

    @property
    def name(self) -> str:
        return f"known-r{self.repeat}"


def known_prompts(prompts: Sequence[Prompt], lengths: dict[str, int]) -> tuple[list[Prompt], list[str]]:
    """The prompts the benchmark's client can send as written (completions, of the first one's answer length
    and at least MIN_PROMPT_TOKENS long by ``lengths``, the served tokenizer's count), and why each other is not."""
    sent: list[Prompt] = []
    why: list[str] = []
    for p in prompts:
        if p.api != "completions":
            why.append(f"{p.name}: a chat prompt (the client sends completions as written)")
        elif sent and p.max_tokens != sent[0].max_tokens:
            why.append(f"{p.name}: {p.max_tokens} tokens of answer, not {sent[0].max_tokens} (one length a run)")
        elif lengths.get(p.name, 0) < MIN_PROMPT_TOKENS:
            why.append(f"{p.name}: {lengths.get(p.name)} prompt tokens, fewer than vLLM's dataset keeps")
        else:
            sent.append(p)
    return sent, why


def known_runs(prompts: Sequence[Prompt], concurrency: Sequence[int], repeats: int) -> list[Known]:
    """One after each repeat: as many requests as that repeat's decode run at the highest level, at that level."""
    if not prompts:
        return []
    top = max(concurrency)
    count = max(MIN_REQUESTS, top * ROUNDS)
    return [Known(repeat=r, requests=count, concurrency=top, max_tokens=prompts[0].max_tokens) for r in range(repeats)]


def known_dataset(prompts: Sequence[Prompt], requests: int) -> tuple[list[Prompt], str]:
    """The prompts in the order they are sent (in turn, ``requests`` of them) and the dataset's JSON."""
    order = [prompts[i % len(prompts)] for i in range(requests)]
    turns = [{"conversations": [{"from": "human", "value": p.prompt}, {"from": "gpt", "value": p.expect}]} for p in order]
    return order, json.dumps(turns, indent=0) + "\n"


def known_arguments(run: Known, *, url: str, model: str, tokenizer: str, result_dir: str) -> list[str]:
    """``vllm bench serve`` sending the dataset in order (no shuffle, none drawn again), greedy, every output kept."""
    return [
        "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "sharegpt", "--dataset-path", f"{result_dir}/{KNOWN_DATASET}", "--disable-shuffle",
        "--no-oversample", "--sharegpt-output-len", str(run.max_tokens), "--temperature", "0",
        "--num-prompts", str(run.requests), "--max-concurrency", str(run.concurrency), "--request-rate", "inf",
        "--num-warmups", "0", "--save-result", "--save-detailed", "--result-dir", result_dir,
        "--result-filename", f"{run.name}.json", "--disable-tqdm",
    ]  # fmt: skip


def known_wrong(path: Path, order: Sequence[Prompt]) -> list[str]:
    """Each answer of a known-answer run that is not its prompt's (vLLM keeps the outputs in the order sent)."""
    try:
        data = json.loads(path.read_text())
        texts = list(data["generated_texts"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerifyError(f"{path}: vllm bench serve left no outputs to judge ({type(exc).__name__}: {exc})") from None
    if len(texts) != len(order):
        return [f"{len(texts)} outputs for {len(order)} requests ({data.get('failed')} failed: {data.get('errors', [])[:2]})"]
    return [
        f"request {i + 1} ({p.name}): prompt {p.prompt!r}: expected {p.expect!r}, received {text!r}"
        for i, (p, text) in enumerate(zip(order, texts, strict=True))
        if not p.accepts(str(text))
    ]


def requests_sent(concurrency: Sequence[int], repeats: int) -> int:
    """Every request the speed runs send (their warm-ups too): what a burn-in is sized against."""
    per_repeat = sum(run.num_prompts + WARMUPS for run in runs(concurrency, FULL_WINDOW, 1))
    return per_repeat * repeats


# --- what vLLM saved -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Figures:
    """One scenario at one level, as vLLM's saved result gives it (times in ms)."""

    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    # Output tokens/s of one request while it decodes: 1000 / TPOT p50 (vLLM's TPOT, in other units).
    # None where the stream shows no decode: ITL p50 or TPOT p50 below one engine step means the tokens
    # reached the client in bursts (the API server fell behind the engine and merged them: a small model
    # on a few CPU cores), so TPOT times the bursts, not the decode. TPOT alone shows it where most
    # requests' few output tokens (prefill's 4) came in one event: ITL counts each event's gap once.
    tokens_per_s_per_request: float | None
    # vLLM's output_throughput: every output token over the run's duration.
    tokens_per_s: float
    requests: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# The result keys each figure is read from (vLLM's benchmarks/serve.py names them).
KEYS = {
    "ttft_ms_p50": "p50_ttft_ms",
    "ttft_ms_p99": "p99_ttft_ms",
    "tpot_ms_p50": "p50_tpot_ms",
    "tpot_ms_p99": "p99_tpot_ms",
    "itl_ms_p50": "p50_itl_ms",
    "itl_ms_p99": "p99_itl_ms",
    "tokens_per_s": "output_throughput",
}


def parse(data: Any, where: str) -> Figures:
    """The figures of one saved result; a VerifyError naming what is missing or failed."""
    if not isinstance(data, dict):
        raise VerifyError(f"{where}: not a vllm bench serve result (a JSON object)")
    missing = [key for key in (*KEYS.values(), "completed", "failed") if not isinstance(data.get(key), int | float)]
    if missing:
        raise VerifyError(
            f"{where}: no {', '.join(missing)} in vllm bench serve's result; this vLLM saves other fields "
            "(sparkbuild/verify/benchmark.py KEYS names the ones read)"
        )
    if data["failed"] or not data["completed"]:
        errors = [e for e in data.get("errors") or () if e][:3]
        raise VerifyError(f"{where}: {data['failed']} request(s) failed, {data['completed']} completed: {errors}")
    values = {field: round(float(data[key]), 4) for field, key in KEYS.items()}
    tpot = values["tpot_ms_p50"]
    bursts = values["itl_ms_p50"] < MIN_STEP_MS or tpot < MIN_STEP_MS
    per_request = None if bursts else round(1000.0 / tpot, 3)
    return Figures(**values, tokens_per_s_per_request=per_request, requests=int(data["completed"]))


def read(path: Path) -> Figures:
    try:
        return parse(json.loads(path.read_text()), str(path))
    except (OSError, ValueError) as exc:
        raise VerifyError(f"{path}: vllm bench serve left no readable result ({exc})") from None


# --- checks on the figures ---------------------------------------------------------------------


def inconsistencies(figures: Figures, concurrency: int) -> list[str]:
    """What is impossible about these figures (empty when they are consistent)."""
    f = figures
    found = [
        f"{name} p99 {p99} < p50 {p50}"
        for name, p50, p99 in (
            ("TTFT", f.ttft_ms_p50, f.ttft_ms_p99),
            ("TPOT", f.tpot_ms_p50, f.tpot_ms_p99),
            ("ITL", f.itl_ms_p50, f.itl_ms_p99),
        )
        if p99 < p50
    ]
    if f.ttft_ms_p50 <= 0 or f.tokens_per_s <= 0:
        found.append(f"TTFT p50 {f.ttft_ms_p50} ms and {f.tokens_per_s} tok/s: a run that measured nothing")
    if f.tokens_per_s > concurrency * MAX_STREAM_TOKENS_PER_S:
        found.append(f"{f.tokens_per_s} tok/s in aggregate is above {concurrency} x the bound {MAX_STREAM_TOKENS_PER_S:g}")
    per_request = f.tokens_per_s_per_request
    if per_request is not None and per_request > MAX_STREAM_TOKENS_PER_S:
        found.append(f"{per_request} tok/s per request is above the bound {MAX_STREAM_TOKENS_PER_S:g}")
    if per_request is not None and f.tokens_per_s > concurrency * per_request * AGGREGATE_SLACK:
        found.append(
            f"{f.tokens_per_s} tok/s in aggregate is more than {concurrency} stream(s) at "
            f"{per_request} tok/s each can make (x{AGGREGATE_SLACK})"
        )
    return found


def require_consistent(figures: Figures, run: Run) -> Figures:
    wrong = inconsistencies(figures, run.in_flight)
    if wrong:
        raise VerifyError(
            f"vllm bench serve's {run.name} figures are inconsistent: {'; '.join(wrong)}. "
            "The benchmark or the server is broken; its result file has every request's times"
        )
    return figures


# --- repeats and the check's whole result -----------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Level:
    """A scenario at one level over its repeats: the median of each figure, and its spread."""

    scenario: Scenario
    concurrency: int
    shape: Shape
    figures: Figures
    # (max - min) / median of each figure over the repeats: the noise the gate allows for.
    spread: dict[str, float]
    repeats: int
    # Why the benchmark client shared the server's CPUs where this level was measured (``contention``):
    # its ``client_timed`` figures were not measurable there. Empty where the client had a CPU of its own.
    contended: str = ""

    def to_json(self) -> dict[str, Any]:
        data = {
            "scenario": self.scenario,
            "concurrency": self.concurrency,
            "input_len": self.shape.input_len,
            "output_len": self.shape.output_len,
            "figures": self.figures.to_json(),
            "spread": self.spread,
            "repeats": self.repeats,
        }
        return {**data, "contended": self.contended} if self.contended else data


FIELDS = tuple(Figures.__dataclass_fields__)


def median_of(scenario: Scenario, concurrency: int, run_shape: Shape, repeats: Sequence[Figures]) -> Level:
    """The median of each figure over ``repeats`` (each a whole run), and how far they spread; a
    per-request rate over the repeats that measured it, where at least half did."""
    if not repeats:
        raise VerifyError(f"{scenario} at c={concurrency}: no run to take a median of")
    medians: dict[str, Any] = {}
    spread: dict[str, float] = {}
    for name in FIELDS:
        values = [float(v) for v in (getattr(f, name) for f in repeats) if v is not None]
        if len(values) * 2 < len(repeats):  # measured in fewer than half the repeats: no median
            medians[name], spread[name] = None, 0.0
            continue
        mid = statistics.median(values)
        medians[name] = round(mid, 4)
        spread[name] = round((max(values) - min(values)) / mid, 4) if mid else 0.0
    medians["requests"] = sum(f.requests for f in repeats)  # the requests behind the medians, all repeats
    return Level(
        scenario=scenario,
        concurrency=concurrency,
        shape=run_shape,
        figures=Figures(**medians),
        spread=spread,
        repeats=len(repeats),
    )


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """A check's speed: every scenario at every level; what ran it and where its files are."""

    levels: tuple[Level, ...]
    window: int
    seconds: float
    # Seconds of benchmark per concurrency level (every scenario and repeat at that level).
    seconds_per_level: dict[int, float]
    # The check's own answers the benchmark's client asked for after its repeats (Known), all right.
    known_answers: int = 0

    def level(self, scenario: Scenario, concurrency: int) -> Level | None:
        return next((lv for lv in self.levels if lv.scenario == scenario and lv.concurrency == concurrency), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": "vllm bench serve",
            "window": self.window,
            "seconds": round(self.seconds, 1),
            "seconds_per_level": {str(c): round(s, 1) for c, s in self.seconds_per_level.items()},
            "known_answers": self.known_answers,
            "levels": [lv.to_json() for lv in self.levels],
        }


def combine(
    results: Sequence[tuple[Run, Figures]],
    window: int,
    seconds: float,
    per_level: dict[int, float],
    contended: str = "",
) -> Benchmark:
    """Group each run's figures by scenario and level; the median over the repeats of each. With
    ``contended`` (``contention``'s reason), every level is marked with it: its ``client_timed``
    figures were not measurable where it ran."""
    groups: dict[tuple[Scenario, int], list[tuple[Run, Figures]]] = {}
    for run, figures in results:
        groups.setdefault((run.scenario, run.concurrency), []).append((run, figures))
    levels = tuple(
        dataclasses.replace(median_of(scenario, c, group[0][0].shape, [f for _, f in group]), contended=contended)
        for (scenario, c), group in groups.items()
    )
    order = sorted(levels, key=lambda lv: (SCENARIOS.index(lv.scenario), lv.concurrency))
    return Benchmark(levels=tuple(order), window=window, seconds=seconds, seconds_per_level=per_level)


def from_json(data: Any, where: str) -> Benchmark:
    """A benchmark as ``to_json`` wrote it (a verify.json's or a baseline's); VerifyError if not one."""
    try:
        levels = tuple(
            Level(
                scenario=lv["scenario"],
                concurrency=int(lv["concurrency"]),
                shape=Shape(input_len=int(lv["input_len"]), output_len=int(lv["output_len"])),
                figures=Figures(**{name: lv["figures"][name] for name in FIELDS}),
                spread={str(k): float(v) for k, v in dict(lv.get("spread") or {}).items()},
                repeats=int(lv.get("repeats", 1)),
                contended=str(lv.get("contended") or ""),
            )
            for lv in data["levels"]
            if lv["scenario"] in SCENARIOS
        )
        per_level = {int(c): float(s) for c, s in dict(data.get("seconds_per_level") or {}).items()}
        return Benchmark(
            levels=levels,
            window=int(data["window"]),
            seconds=float(data["seconds"]),
            seconds_per_level=per_level,
            known_answers=int(data.get("known_answers") or 0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise VerifyError(f"{where}: not a sparkbuild benchmark result ({type(exc).__name__}: {exc})") from None


# --- what the host can time --------------------------------------------------------------------

# The figures that count the benchmark client's own turns: a time to first token runs from the
# client's send, through the API server's tokenizing and the engine's scheduling, to the first token
# back; tok/s in aggregate is a run's tokens over its duration, which holds every request's first
# token and, at c=1, the client's turn between one request and the next. At c>1 every figure does:
# a stream's token gaps hold the engine steps that admit the other streams' requests, sent when the
# client got its turn. Only c=1's per-request rate, TPOT and ITL (medians of the gaps between one
# stream's tokens, nothing else in flight) are the engine's steps alone.
CLIENT_TIMED = ("ttft_ms_p50", "ttft_ms_p99", "tokens_per_s")


def client_timed(figure: str, concurrency: int) -> bool:
    """Whether ``figure`` at level ``concurrency`` counts the benchmark client's own turns."""
    return figure in CLIENT_TIMED or concurrency > 1


# vLLM's CPU worker logs the CPUs it binds its OpenMP threads to and those it leaves to the API server
# (vllm/utils/ompmultiprocessing.py in 0.32.0, the CPU image the local profile ships):
#   (EngineCore pid=20) INFO ... [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]
#   (EngineCore pid=20) INFO ... [ompmultiprocessing.py:185] \treserved_cpus=[1]
CORE_IDS = re.compile(r"core ids=\[([0-9, ]*)\]")
RESERVED = re.compile(r"reserved_cpus=\[([0-9, ]*)\]")


def _cpus(pattern: re.Pattern[str], log_text: str) -> set[int]:
    return {int(n) for found in pattern.findall(log_text) for n in found.replace(" ", "").split(",") if n}


def contention(log_text: str, host_cpus: int) -> str | None:
    """Why the figures ``client_timed`` names cannot be measured on this host, or None where they can.

    vLLM's CPU image binds its engine's threads to every CPU but those it reserves for its API
    server; the benchmark client then has no CPU of its own and shares one with the server, and
    those figures count three processes' turns on the same CPUs. Measured on 2 CPUs with nothing
    else running (docs/speed-gate.md), between fresh servers of one image: prefill TTFT p50 moved
    20 %, queueing TTFT p99 (the slowest of 4 requests in a burst) 100 %, decode tok/s in aggregate
    up to 12 % and the per-request rate at c=2 up to 28 %, more than their repeats spread within one
    server; the per-request rate at c=1 moved least (a standard deviation of 4.7 %). A server that
    logs no CPU binding (a GPU image) leaves the host's CPUs to the client: None.
    """
    engine = _cpus(CORE_IDS, log_text)
    if not engine:
        return None
    server = engine | _cpus(RESERVED, log_text)
    if host_cpus - len(server) >= 1:
        return None
    return (
        f"the benchmark client has no CPU of its own: vLLM's engine is bound to CPU(s) {_listed(engine)} and "
        f"its API server has {_listed(server - engine) or 'none'} of this host's {host_cpus}; "
        "a time to first token, tok/s in aggregate and, at c>1, a stream's token gaps count all three processes' turns"
    )


def _listed(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
