"""Verify stage: serve the image's OpenAI-compatible API, check known answers, measure speed.

Answers are greedy (temperature 0) so a right build gives exactly the expected text. Speed is
measured with vLLM's own benchmark, run from the image against its server (``builder.speed``):
decode, prefill and queueing at each concurrency level of the check.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from builder import log, speed
from builder.benchmark import Benchmark
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
class VerifyResult:
    image: str
    model: str
    check: str
    startup_s: float
    answers: tuple[Answer, ...]
    # vllm bench serve's figures; None where an answer was wrong (nothing worth timing).
    benchmark: Benchmark | None = None

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.answers)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["benchmark"] = self.benchmark.to_json() if self.benchmark else None
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
        bench: Benchmark | None = None
        if all(a.ok for a in answers):
            levels = ", ".join(map(str, check.concurrency))
            with log.step(f"vllm bench serve: decode, prefill, queueing at concurrency {levels}, x{check.bench_repeats}"):
                folder = result_file.parent / "bench"
                bench = speed.measure(engine, image, check, model, port=port, served_name=MODEL_NAME, folder=folder)
    result = VerifyResult(image=image, model=str(model), check=check.name, startup_s=startup, answers=answers, benchmark=bench)
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
