"""Requests any OpenAI client may send, sent to every check's server after its answers.

A server that answers a plain greedy request can still die on the next client: vLLM's CPU image
without a C++ compiler loses its engine on the first ``"logprobs": 2`` (torch's inductor compiles
the sampler's top-k), and every later request then fails. Each probe here must be answered (or, for
an invalid request, refused with a 400), and after all of them the server must still be healthy
and give the check's first answer again. The first probe that fails stops the rest: its request
and response are the evidence (``VerifyError.request``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from sparkbuild.errors import VerifyError
from sparkbuild.plan.matrix import Prompt
from sparkbuild.util import log

# How much of a response body the evidence keeps.
KEEP_CHARS = 4000
TIMEOUT_S = 300

Judge = Callable[[Any], str | None]


def request_failed(message: str, *, name: str, path: str, body: dict[str, Any], status: int | None, response: str) -> VerifyError:
    """A request the server did not answer as it should, with what was sent and what came back."""
    shown = dict(body)
    if isinstance(shown.get("prompt"), str) and len(shown["prompt"]) > 200:
        shown["prompt"] = shown["prompt"][:200] + f"... ({len(body['prompt'])} characters)"
    evidence = {"name": name, "request": {"path": path, "body": shown}, "status": status, "response": response[:KEEP_CHARS]}
    return VerifyError(message, request=evidence)


@dataclass(frozen=True, kw_only=True)
class Probe:
    name: str
    path: str
    body: dict[str, Any]
    # 200 for a request the server must answer, 400 for one it must refuse and live on.
    status: int = 200
    stream: bool = False
    judge: Judge = field(default=lambda _: None)


def plan(prompts: tuple[Prompt, ...], model: str, max_model_len: int) -> tuple[Probe, ...]:
    """The probes for a check: each API the check's prompts use, with its first prompt."""
    completion = next((p for p in prompts if p.api == "completions"), None)
    chat = next((p for p in prompts if p.api == "chat"), None)
    found: list[Probe] = []
    if completion is not None:
        found += _completion_probes(completion, model)
    if chat is not None:
        found += _chat_probes(chat, model)
    first = completion or chat
    if first is not None:
        found += _refusals(first, model, max_model_len)
    return tuple(found)


def _completion_probes(prompt: Prompt, model: str) -> list[Probe]:
    base = {"model": model, "prompt": prompt.prompt, "max_tokens": prompt.max_tokens, "temperature": 0}
    stop = _stop_at(prompt)
    probes = [
        Probe(name="logprobs", path="/v1/completions", body={**base, "logprobs": 2}, judge=_judge_logprobs),
        Probe(name="prompt_logprobs", path="/v1/completions", body={**base, "prompt_logprobs": 1}, judge=_judge_prompt_logprobs),
        Probe(
            name="stream (completions)", path="/v1/completions", body={**base, "stream": True}, stream=True, judge=_judge_stream
        ),
        Probe(
            name="n=2",
            path="/v1/completions",
            body={**base, "n": 2, "temperature": 0.8, "seed": 1},
            judge=lambda r: None if len(r["choices"]) == 2 else f"{len(r['choices'])} choices for n=2",
        ),
    ]
    if stop is not None:
        probes.append(
            Probe(name="stop string", path="/v1/completions", body={**base, "stop": [stop]}, judge=lambda r: _judge_stop(r, stop))
        )
    return probes


def _chat_probes(prompt: Prompt, model: str) -> list[Probe]:
    base = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.prompt}],
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
    }
    return [
        Probe(name="stream (chat)", path="/v1/chat/completions", body={**base, "stream": True}, stream=True, judge=_judge_stream),
        Probe(
            name="logprobs (chat)",
            path="/v1/chat/completions",
            body={**base, "logprobs": True, "top_logprobs": 2},
            judge=_judge_chat_logprobs,
        ),
    ]


def _refusals(prompt: Prompt, model: str, max_model_len: int) -> list[Probe]:
    """Invalid requests the server must refuse with a 400 and survive."""
    # One " a" is a token in every tokenizer sparkbuild meets; the text stays under vLLM's character
    # bound (4 per token), so the refusal comes from counting the tokens, as a real client's would.
    too_long = " a" * (max_model_len + 16)
    path, key = ("/v1/completions", "prompt") if prompt.api == "completions" else ("/v1/chat/completions", "messages")
    value: Any = too_long if key == "prompt" else [{"role": "user", "content": too_long}]
    short: Any = prompt.prompt if key == "prompt" else [{"role": "user", "content": prompt.prompt}]
    return [
        Probe(name="prompt longer than the context", path=path, body={"model": model, key: value, "max_tokens": 4}, status=400),
        Probe(
            name="max_tokens beyond the context",
            path=path,
            body={"model": model, key: short, "max_tokens": max_model_len + 1},
            status=400,
        ),
    ]


def _stop_at(prompt: Prompt) -> str | None:
    """A stop string inside an exact answer (its second word): the answer must end before it."""
    words = prompt.expect.split(" ")
    if prompt.match != "exact" or len([w for w in words if w]) < 2:
        return None
    return " " + [w for w in words if w][1]


def _judge_logprobs(response: Any) -> str | None:
    logprobs = response["choices"][0]["logprobs"]
    tokens, top = logprobs["tokens"], logprobs["top_logprobs"]
    if not tokens or len(top) != len(tokens):
        return f"{len(tokens)} tokens but {len(top)} top_logprobs entries"
    if any(not entry for entry in top):
        return "a token without its top logprobs"
    bad = [v for v in logprobs["token_logprobs"] if v is None or not (v <= 0.0)]
    return f"token logprobs not in (-inf, 0]: {bad[:3]}" if bad else None


def _judge_prompt_logprobs(response: Any) -> str | None:
    found = response["choices"][0].get("prompt_logprobs")
    if not isinstance(found, list) or len(found) < 2 or not all(isinstance(e, dict) for e in found[1:]):
        return f"prompt_logprobs is {str(found)[:200]}"
    return None


def _judge_chat_logprobs(response: Any) -> str | None:
    content = (response["choices"][0].get("logprobs") or {}).get("content")
    if not content or any(not entry.get("top_logprobs") for entry in content):
        return f"logprobs.content is {str(content)[:200]}"
    return None


def _judge_stream(events: Any) -> str | None:
    if not events:
        return "no events before [DONE]"
    return None if events[-1]["choices"][0].get("finish_reason") else "the last event has no finish_reason"


def _judge_stop(response: Any, stop: str) -> str | None:
    choice = response["choices"][0]
    if choice.get("finish_reason") != "stop" or stop in choice.get("text", ""):
        return f"stop {stop!r}: finish_reason {choice.get('finish_reason')!r}, text {choice.get('text')!r}"
    return None


def send(url: str, probe: Probe) -> Any:
    """Send ``probe``; the parsed answer (a list of events for a stream), or VerifyError."""
    status: int | None = None
    text = ""
    try:
        with requests.post(url + probe.path, json=probe.body, timeout=TIMEOUT_S, stream=probe.stream) as response:
            status = response.status_code
            if probe.stream and status == 200:
                events, text = _events(response)
            else:
                text = response.text
                events = None
    except requests.RequestException as exc:
        raise _failed(probe, status, text or f"{type(exc).__name__}: {exc}", "no answer") from None
    except ValueError as exc:
        raise _failed(probe, status, text, f"not a server-sent event stream ({exc})") from None
    if status != probe.status:
        raise _failed(probe, status, text, f"HTTP {status}, expected {probe.status}")
    if probe.status != 200:
        return None
    try:
        answer = events if probe.stream else json.loads(text)
        problem = probe.judge(answer)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        problem = f"an answer not of the API's shape ({type(exc).__name__}: {exc})"
    if problem:
        raise _failed(probe, status, text, problem)
    return answer


def _events(response: requests.Response) -> tuple[list[Any], str]:
    """The JSON events of a server-sent stream, up to ``data: [DONE]`` (required)."""
    events: list[Any] = []
    lines: list[str] = []
    for chunk in response.iter_lines():
        # Bytes, whatever charset the server names (or none): SSE is UTF-8 by its specification.
        raw = chunk.decode("utf-8", errors="replace")
        lines.append(raw)
        if not raw or not raw.startswith("data: "):
            continue
        data = raw.removeprefix("data: ")
        if data == "[DONE]":
            return events, "\n".join(lines)
        events.append(json.loads(data))
    raise ValueError("the stream ended without data: [DONE]")


def _failed(probe: Probe, status: int | None, text: str, problem: str) -> VerifyError:
    return request_failed(
        f"probe '{probe.name}': POST {probe.path} -> {problem}: {text.strip()[:300]}",
        name=probe.name,
        path=probe.path,
        body=probe.body,
        status=status,
        response=text,
    )


def run(url: str, probes: tuple[Probe, ...]) -> tuple[str, ...]:
    """Send every probe; the names of those answered. Raises VerifyError at the first that fails,
    or VerifyError when the server is not healthy after them."""
    done = []
    for probe in probes:
        send(url, probe)
        done.append(probe.name)
    try:
        healthy = requests.get(f"{url}/health", timeout=30).status_code == 200
    except requests.RequestException:
        healthy = False
    if not healthy:
        raise VerifyError(f"the server is not healthy after the client probes ({', '.join(done)})")
    log.info(f"  client probes: {len(done)} answered as they should ({', '.join(done)}); the server is healthy")
    return tuple(done)
