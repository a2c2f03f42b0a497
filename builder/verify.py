"""Verify stage: serve the image's OpenAI-compatible API, check known answers, measure speed.

Answers are greedy (temperature 0) so a right build gives exactly the expected text. Speed is
measured by streaming: time to first token, and decode tokens/s after it, at each concurrency.
"""

from __future__ import annotations

import json
import re
import secrets
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import requests

from builder import kernelpath, log
from builder.engine import Container, Engine
from builder.errors import VerifyError
from builder.matrix import Check, Prompt
from builder.registry import free_port

MODEL_NAME = "sparkbuild-check"
# The server's whole log, beside verify.json: what the kernel-path gate read.
SERVER_LOG = "server.log"


@dataclass(frozen=True, kw_only=True)
class Answer:
    name: str
    api: str
    prompt: str
    expected: str
    received: str
    match: Literal["exact", "contains", "regex"] = "exact"

    @property
    def ok(self) -> bool:
        if self.match == "contains":
            return self.expected in self.received
        if self.match == "regex":
            return re.search(self.expected, self.received) is not None
        return self.received.strip() == self.expected.strip()


@dataclass(frozen=True, kw_only=True)
class Sample:
    ttft_s: float
    decode_tokens_per_s: float
    tokens: int


@dataclass(frozen=True, kw_only=True)
class Bench:
    concurrency: int
    ttft_ms_p50: float
    ttft_ms_max: float
    decode_tokens_per_s_p50: float
    total_tokens_per_s: float
    requests: int


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    image: str
    model: str
    check: str
    startup_s: float
    answers: tuple[Answer, ...]
    bench: tuple[Bench, ...] = field(default=())
    # What the server said it is (GET /version), and the kernels it chose where the check expects some.
    vllm_version: str = ""
    kernels: tuple[kernelpath.Chosen, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.answers) and all(k.ok for k in self.kernels)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for answer, raw in zip(self.answers, data["answers"], strict=True):
            raw["ok"] = answer.ok
        data["kernels"] = [k.to_json() for k in self.kernels]
        return data


def verify(engine: Engine, image: str, check: Check, model: Path, result_file: Path, *, gpus: bool = False) -> VerifyResult:
    """Run the check against ``image`` (given every GPU when ``gpus``: a Spark image); writes
    ``result_file`` and the server's log beside it, and raises on a wrong answer or kernel path."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        "/model",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        *check.serve_args,
    ]
    name = f"sparkbuild-verify-{secrets.token_hex(4)}"
    with engine.run(image, command, name=name, mounts={model.resolve(): "/model"}, gpus=gpus) as container:
        with log.step(f"Waiting for {image} to serve on {url}"):
            startup = wait_healthy(container, url, check.startup_timeout)
        result = run_check(
            Server(url=url, model=MODEL_NAME, read_log=lambda: container.logs(tail=None)),
            check,
            image=image,
            model=str(model),
            startup=startup,
            result_file=result_file,
        )
    return require(result, result_file)


def verify_url(url: str, check: Check, result_file: Path, log_file: Path | None = None) -> VerifyResult:
    """Run the check against a server already running at ``url`` (a deployment after a rollout):
    answers, benchmark and, from ``log_file``, the kernel-path gate."""
    url = url.rstrip("/")
    try:
        healthy = requests.get(f"{url}/health", timeout=10).status_code == 200
    except requests.RequestException as exc:
        reason = type(exc).__name__
        raise VerifyError(f"cannot reach {url}/health ({reason}): is the server running, is the URL http://HOST:PORT?") from None
    if not healthy:
        raise VerifyError(f"{url}/health does not answer 200: the server is not ready (or it is not vLLM)")
    name = served_model(url)
    read_log = None if log_file is None else (lambda: log_file.read_text(errors="replace"))
    server = Server(url=url, model=name, read_log=read_log)
    return require(run_check(server, check, image=url, model=name, startup=0.0, result_file=result_file), result_file)


def served_model(url: str) -> str:
    """The model the server serves (GET /v1/models): the name requests must use."""
    try:
        response = requests.get(f"{url}/v1/models", timeout=10)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (requests.RequestException, KeyError, IndexError, ValueError, TypeError) as exc:
        raise VerifyError(f"GET {url}/v1/models failed ({exc}): a vLLM server lists the model it serves there") from None


@dataclass(frozen=True, kw_only=True)
class Server:
    """A server to check: where it answers, the model name it serves, how to read its log (None:
    not readable, as for a server sparkbuild did not start and no log file was given)."""

    url: str
    model: str
    read_log: Callable[[], str] | None


def run_check(server: Server, check: Check, *, image: str, model: str, startup: float, result_file: Path) -> VerifyResult:
    """Answers, the benchmark where they are right, and the kernel-path gate; the result is written
    to ``result_file`` (and the server's log beside it), not judged."""
    version = server_version(server.url)
    answers = tuple(ask(server.url, prompt, server.model) for prompt in check.prompts)
    for a in answers:
        log.info(f"  {a.name} ({a.api}): {a.prompt!r} -> {a.received!r} [{'ok' if a.ok else 'WRONG'}]")
    bench: tuple[Bench, ...] = ()
    if all(a.ok for a in answers):
        with log.step(f"Benchmark at concurrency {', '.join(map(str, check.concurrency))}"):
            first = check.prompts[0]
            bench = tuple(measure(server.url, first, c, check.bench_max_tokens, server.model) for c in check.concurrency)
    kernels = _gate(server, check, version, result_file.parent / SERVER_LOG)
    result = VerifyResult(
        image=image,
        model=model,
        check=check.name,
        startup_s=startup,
        answers=answers,
        bench=bench,
        vllm_version=version,
        kernels=kernels,
    )
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _gate(server: Server, check: Check, version: str, log_file: Path) -> tuple[kernelpath.Chosen, ...]:
    """The kernels vLLM chose, from its log (saved to ``log_file``), for the kinds the check expects."""
    text = server.read_log() if server.read_log is not None else None
    if text is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text(text)
    if not check.kernels:
        return ()
    if text is None:
        raise VerifyError(
            f"check {check.name} expects kernel paths ({', '.join(k for k, _ in check.kernels)}), which are read from the "
            "server's startup log: give it with --log FILE (for a container: docker logs NAME > FILE 2>&1)"
        )
    chosen = tuple(kernelpath.gate(check.expected_kernels, text, version))
    log.info(f"  kernel path (vLLM {version}): {kernelpath.text(chosen)}")
    return chosen


def require(result: VerifyResult, result_file: Path) -> VerifyResult:
    """Raise, naming every wrong answer and every unexpected kernel, unless the result is ok."""
    problems = [
        f"  {a.name} ({a.api}): prompt {a.prompt!r}: expected {a.expected!r}, received {a.received!r}"
        for a in result.answers
        if not a.ok
    ]
    if problems:
        problems.insert(0, f"{result.image} gave {len(problems)} wrong answer(s) of {len(result.answers)}:")
    gate = kernelpath.failures(result.kernels, result.vllm_version)
    if gate:
        problems += [f"{result.image}: kernel-path gate failed:", *gate, f"  the server's log: {result_file.parent / SERVER_LOG}"]
    if problems:
        raise VerifyError("\n".join([*problems, f"result: {result_file}"]))
    return result


def server_version(url: str) -> str:
    """The vLLM version the server reports (GET /version): which log patterns the gate reads."""
    try:
        response = requests.get(f"{url}/version", timeout=10)
        response.raise_for_status()
        return str(response.json()["version"])
    except (requests.RequestException, KeyError, ValueError, TypeError) as exc:
        raise VerifyError(f"GET {url}/version failed ({exc}): is it a vLLM server?") from None


def wait_healthy(container: Container, url: str, timeout: int) -> float:
    """Poll /health until it answers; fail at once, with the last log lines, if the server dies."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not container.running():
            raise VerifyError(
                f"the server exited (code {container.exit_code()}) before it was healthy; "
                f"its last log lines:\n{container.logs(40)}"
            )
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(1)
    raise VerifyError(f"the server was not healthy after {timeout}s; its last log lines:\n{container.logs(40)}")


def _body(prompt: Prompt, max_tokens: int, model: str = MODEL_NAME) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if prompt.api == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt.prompt}]}
    return "/v1/completions", {**common, "prompt": prompt.prompt}


def ask(url: str, prompt: Prompt, model: str = MODEL_NAME) -> Answer:
    path, body = _body(prompt, prompt.max_tokens, model)
    try:
        response = requests.post(url + path, json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
    except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
        raise VerifyError(f"{prompt.name}: POST {path} failed: {exc}") from None
    text = choice["message"]["content"] if prompt.api == "chat" else choice["text"]
    return Answer(
        name=prompt.name, api=prompt.api, prompt=prompt.prompt, expected=prompt.expect, received=text or "", match=prompt.match
    )


def stream_once(url: str, prompt: Prompt, max_tokens: int, model: str = MODEL_NAME) -> Sample:
    path, body = _body(prompt, max_tokens, model)
    body.update(stream=True, ignore_eos=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with requests.post(url + path, json=body, stream=True, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if event.get("choices"):
                last = time.perf_counter()
                first = first or last
    if not first:
        raise VerifyError(f"streaming {path} returned no tokens")
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return Sample(ttft_s=first - start, decode_tokens_per_s=decode, tokens=tokens)


def measure(url: str, prompt: Prompt, concurrency: int, max_tokens: int, model: str = MODEL_NAME) -> Bench:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(lambda _: stream_once(url, prompt, max_tokens, model), range(concurrency)))
    wall = time.perf_counter() - start
    bench = Bench(
        concurrency=concurrency,
        ttft_ms_p50=round(statistics.median(s.ttft_s for s in samples) * 1000, 1),
        ttft_ms_max=round(max(s.ttft_s for s in samples) * 1000, 1),
        decode_tokens_per_s_p50=round(statistics.median(s.decode_tokens_per_s for s in samples), 1),
        total_tokens_per_s=round(sum(s.tokens for s in samples) / wall, 1),
        requests=concurrency,
    )
    log.info(
        f"  c={concurrency}: TTFT p50 {bench.ttft_ms_p50} ms, decode p50 {bench.decode_tokens_per_s_p50} tok/s, "
        f"total {bench.total_tokens_per_s} tok/s"
    )
    return bench
