"""Runs ``vllm bench serve`` from the image under test against the server verify started.

The benchmark is vLLM's own, from the same image as the server (the same vLLM), in a container of
its own on the host network (where the server listens on 127.0.0.1). Each run saves its result
into a folder of the target's output, read back by ``builder.benchmark``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from builder import benchmark, log
from builder.benchmark import Benchmark, Figures, Run
from builder.engine import Engine
from builder.errors import EngineError, VerifyError
from builder.matrix import Check

# vLLM's CLI as a module: the image's entrypoint starts the server, so it is replaced.
VLLM = ("python3", "-m", "vllm.entrypoints.cli.main")
RESULTS = "/results"
TOKENIZER = "/model"
# One run sends a few dozen requests at most; one that takes longer than this is stuck.
RUN_TIMEOUT_S = 900


def window_of(model: Path, check: Check) -> int:
    """The served context window: the model's ``max_position_embeddings``, or a shorter
    ``--max-model-len`` in the check's serve arguments."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VerifyError(f"{model}/config.json: {exc}; the benchmark reads the model's context window from it") from None
    return benchmark.context_window(config if isinstance(config, dict) else {}, check.serve_args)


def measure(engine: Engine, image: str, check: Check, model: Path, *, port: int, served_name: str, folder: Path) -> Benchmark:
    """Every scenario at every level of ``check.concurrency``, ``check.bench_repeats`` times; the
    medians. Raises VerifyError where a run fails or its figures are inconsistent."""
    window = window_of(model, check)
    folder.mkdir(parents=True, exist_ok=True)
    results: list[tuple[Run, Figures]] = []
    per_level: dict[int, float] = dict.fromkeys(check.concurrency, 0.0)
    start = time.monotonic()
    for run in benchmark.runs(check.concurrency, window, check.bench_repeats):
        began = time.monotonic()
        figures = benchmark.require_consistent(_one(engine, image, run, model, port, served_name, folder), run)
        per_level[run.concurrency] += time.monotonic() - began
        log.info(
            f"  {run.name}: {figures.tokens_per_s_per_request:.1f} tok/s per request, {figures.tokens_per_s:.1f} in all, "
            f"TTFT p50 {figures.ttft_ms_p50:.1f} ms p99 {figures.ttft_ms_p99:.1f} ms ({figures.requests} requests)"
        )
        results.append((run, figures))
    return benchmark.combine(results, window, time.monotonic() - start, per_level)


def _one(engine: Engine, image: str, run: Run, model: Path, port: int, served_name: str, folder: Path) -> Figures:
    args = benchmark.arguments(run, url=f"http://127.0.0.1:{port}", model=served_name, tokenizer=TOKENIZER, result_dir=RESULTS)
    mounts = {model.resolve(): (TOKENIZER, "ro"), folder.resolve(): (RESULTS, "rw")}
    try:
        engine.output(image, [*VLLM, *args], timeout_s=RUN_TIMEOUT_S, network="host", mounts=mounts)
    except EngineError as exc:
        raise VerifyError(f"vllm bench serve ({run.name}) failed: {exc}") from None
    return benchmark.read(folder / f"{run.name}.json")
