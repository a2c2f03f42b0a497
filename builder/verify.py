"""Verify stage: serve the image's OpenAI-compatible API, check known answers, measure speed.

Answers are greedy (temperature 0) so a right build gives exactly the expected text. Speed is
measured by streaming: time to first token, and decode tokens/s after it, at each concurrency.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from builder import log
from builder.engine import Container, Engine
from builder.errors import VerifyError
from builder.matrix import Check, Prompt
from builder.registry import free_port

MODEL_NAME = "sparkbuild-check"


@dataclass(frozen=True, kw_only=True)
class Answer:
    name: str
    api: str
    prompt: str
    expected: str
    received: str

    @property
    def ok(self) -> bool:
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

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.answers)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for answer, raw in zip(self.answers, data["answers"], strict=True):
            raw["ok"] = answer.ok
        return data


def verify(engine: Engine, image: str, check: Check, model: Path, result_file: Path, *, gpus: bool = False) -> VerifyResult:
    """Run the check against ``image`` (given every GPU when ``gpus``: a Spark image); writes
    ``result_file`` and raises on a wrong answer."""
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
        answers = tuple(ask(url, prompt) for prompt in check.prompts)
        for a in answers:
            log.info(f"  {a.name} ({a.api}): {a.prompt!r} -> {a.received!r} [{'ok' if a.ok else 'WRONG'}]")
        bench: tuple[Bench, ...] = ()
        if all(a.ok for a in answers):
            with log.step(f"Benchmark at concurrency {', '.join(map(str, check.concurrency))}"):
                bench = tuple(measure(url, check.prompts[0], c, check.bench_max_tokens) for c in check.concurrency)
    result = VerifyResult(image=image, model=str(model), check=check.name, startup_s=startup, answers=answers, bench=bench)
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    wrong = [a for a in answers if not a.ok]
    if wrong:
        lines = "\n".join(
            f"  {a.name} ({a.api}): prompt {a.prompt!r}: expected {a.expected!r}, received {a.received!r}" for a in wrong
        )
        raise VerifyError(f"{image} gave {len(wrong)} wrong answer(s) of {len(answers)}:\n{lines}\nresult: {result_file}")
    return result


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


def _body(prompt: Prompt, max_tokens: int) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0}
    if prompt.api == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt.prompt}]}
    return "/v1/completions", {**common, "prompt": prompt.prompt}


def ask(url: str, prompt: Prompt) -> Answer:
    path, body = _body(prompt, prompt.max_tokens)
    try:
        response = requests.post(url + path, json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
    except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
        raise VerifyError(f"{prompt.name}: POST {path} failed: {exc}") from None
    text = choice["message"]["content"] if prompt.api == "chat" else choice["text"]
    return Answer(name=prompt.name, api=prompt.api, prompt=prompt.prompt, expected=prompt.expect, received=text or "")


def stream_once(url: str, prompt: Prompt, max_tokens: int) -> Sample:
    path, body = _body(prompt, max_tokens)
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


def measure(url: str, prompt: Prompt, concurrency: int, max_tokens: int) -> Bench:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(lambda _: stream_once(url, prompt, max_tokens), range(concurrency)))
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
