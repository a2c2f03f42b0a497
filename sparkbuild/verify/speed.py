"""Runs ``vllm bench serve`` from the image under test against the server verify started.

The benchmark is vLLM's own, from the same image as the server (the same vLLM), in a container of
its own on the host network (where the server listens on 127.0.0.1): one container runs every
level's scenarios and repeats in one process (``resources/vllm_bench.py``: vLLM's own parser and
``main``, as the command runs them), so vLLM is imported once per verify. Each run
saves its result into a folder of the target's output, read back by ``sparkbuild.verify.benchmark``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from sparkbuild.errors import EngineError, VerifyError
from sparkbuild.oci.engine import Engine
from sparkbuild.plan.matrix import Check, Prompt
from sparkbuild.resources import packaged
from sparkbuild.util import log
from sparkbuild.verify import benchmark, checkkinds
from sparkbuild.verify.benchmark import Benchmark, Figures, Known, Run

# The image's entrypoint starts the server, so it is replaced by its Python and the runner.
RUNNER = packaged.resource("vllm_bench.py")
RUNNER_IN_IMAGE = "/sparkbuild/vllm_bench.py"
RESULTS = "/results"
TOKENIZER = "/model"
# Every run of a verify sends a few thousand requests at most; a benchmark that takes longer is stuck.
RUNS_TIMEOUT_S = 3600
# Wrong answers a message quotes (the run's saved outputs hold them all).
SHOWN = 4


def window_of(model: Path, check: Check) -> int:
    """The served context window: the model's ``max_position_embeddings``, or a shorter
    ``--max-model-len`` in the check's serve arguments."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VerifyError(f"{model}/config.json: {exc}; the benchmark reads the model's context window from it") from None
    return benchmark.context_window(config if isinstance(config, dict) else {}, check.serve_args)


def measure(
    engine: Engine,
    image: str,
    check: Check,
    model: Path,
    *,
    url: str,
    served_name: str,
    folder: Path,
    read_log: Callable[[], str],
    served_before: int | None = None,
) -> Benchmark:
    """Every scenario at every level of ``check.concurrency``, ``check.bench_repeats`` times; the
    medians. After each repeat, the check's own completion prompts through the same client, every answer
    judged (``benchmark.Known``; ``served_before``: the requests the server had served before the
    benchmark, for the message). Where this host cannot time the figures that count the client's own turns
    (``benchmark.contention``, read from the server's log ``read_log`` gives), every level says so.
    Raises VerifyError where a run fails, its figures are inconsistent, or an answer is wrong."""
    window = window_of(model, check)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    runs = benchmark.runs(check.concurrency, window, check.bench_repeats)
    lengths = {p.name: len(checkkinds.tokenized(url, served_name, p.prompt, special=True)[0]) for p in check.prompts}
    prompts, unsent = benchmark.known_prompts(check.prompts, lengths)
    for why in unsent:
        log.info(f"  not sent through the benchmark's client: {why}")
    known = benchmark.known_runs(prompts, check.concurrency, check.bench_repeats)
    order, dataset = benchmark.known_dataset(prompts, known[0].requests) if known else ([], "[]\n")
    (folder / benchmark.KNOWN_DATASET).write_text(dataset)
    results = _run_all(engine, image, runs, known, model, url=url, served_name=served_name, folder=folder)
    _judge_known(check, runs, known, order, folder, served_before)
    # Each level's own cost: the time vLLM's benchmark reports for its runs (the one import apart).
    per_level: dict[int, float] = {}
    for run, _ in results:
        per_level[run.concurrency] = per_level.get(run.concurrency, 0.0) + _duration(folder / f"{run.name}.json")
    why = benchmark.contention(read_log(), engine.cpus()) or ""
    if why:
        log.info(f"  only c=1's per-request figures are measurable on this host: {why}")
    combined = benchmark.combine(results, window, time.monotonic() - start, per_level, why)
    return dataclasses.replace(combined, known_answers=sum(k.requests for k in known))


def _judge_known(
    check: Check, runs: list[Run], known: list[Known], order: list[Prompt], folder: Path, served_before: int | None
) -> None:
    """Every known-answer run's answers; the first run with a wrong one fails the check, naming its repeat
    and how many requests the server had been sent by then."""
    for k in known:
        wrong = benchmark.known_wrong(folder / f"{k.name}.json", order)
        if wrong:
            sent = sum(r.num_prompts + benchmark.WARMUPS for r in runs if r.repeat <= k.repeat)
            sent += sum(j.requests for j in known if j.repeat < k.repeat)
            served = f"{served_before} before the benchmark, then" if served_before is not None else "the benchmark's"
            raise VerifyError(
                "\n".join(
                    [
                        f"check {check.name}: during the benchmark, after repeat {k.repeat + 1} of {len(known)} ({served} "
                        f"{sent} requests), {len(wrong)} of {k.requests} of its own answers were wrong "
                        f"({k.concurrency} at a time, vllm bench serve's client):",
                        *[f"  {w}" for w in wrong[:SHOWN]],
                        f"  its outputs: {folder / (k.name + '.json')}",
                    ]
                )
            )
        log.info(f"  {k.name}: {k.requests} of the check's own answers through the benchmark's client, all right")


def _duration(result: Path) -> float:
    try:
        return float(json.loads(result.read_text()).get("duration") or 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0


def _run_all(
    engine: Engine, image: str, runs: list[Run], known: list[Known], model: Path, *, url: str, served_name: str, folder: Path
) -> list[tuple[Run, Figures]]:
    """Every run in one container (on the host network: ``url`` is the server's there), so vLLM
    is imported once per verify, not once per level, each repeat followed by its known-answer run;
    each speed run's figures, checked."""
    args = {"url": url, "model": served_name, "tokenizer": TOKENIZER, "result_dir": RESULTS}
    lists = []
    for repeat in sorted({r.repeat for r in runs}):
        lists += [benchmark.arguments(r, **args) for r in runs if r.repeat == repeat]
        lists += [benchmark.known_arguments(k, **args) for k in known if k.repeat == repeat]
    listing = folder / "runs.json"
    listing.write_text(json.dumps(lists, indent=1) + "\n")
    mounts = {model.resolve(): (TOKENIZER, "ro"), folder.resolve(): (RESULTS, "rw"), RUNNER.resolve(): (RUNNER_IN_IMAGE, "ro")}
    command = ["python3", RUNNER_IN_IMAGE, f"{RESULTS}/{listing.name}"]
    try:
        engine.output(image, command, timeout_s=RUNS_TIMEOUT_S, network="host", mounts=mounts)
    except EngineError as exc:
        raise VerifyError(f"vllm bench serve failed: {exc}") from None
    done = []
    for run in runs:
        figures = benchmark.require_consistent(benchmark.read(folder / f"{run.name}.json"), run)
        log.info(
            f"  {run.name}: {figures.tokens_per_s:.1f} tok/s in all, {figures.tokens_per_s_per_request or 'bursts'} per request "
            f"(TPOT p50 {figures.tpot_ms_p50:.2f} ms), TTFT p50 {figures.ttft_ms_p50:.1f} ms p99 {figures.ttft_ms_p99:.1f} ms, "
            f"{figures.requests} requests"
        )
        done.append((run, figures))
    return done
