"""The client probes (sparkbuild/verify/probes.py) judged on what the real local image answered them
(tests/data/probes/, recorded from vLLM 0.32.0's CPU image serving the alphabet model), replayed
from a loopback HTTP server: each answer passes, and each way an answer can go wrong fails naming the
probe, with the request and the response kept."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sparkbuild.errors import VerifyError
from sparkbuild.plan import matrix
from sparkbuild.verify import probes
from tests.support import DATA, ROOT

RECORDED: dict[str, dict[str, Any]] = json.loads((DATA / "probes" / "vllm-0.32.0-cpu.json").read_text())
PROBES = {p.name: p for p in probes.plan(matrix.load(ROOT / "matrix.yaml").checks["alphabet"].prompts, "m", 128)}


class Replay(ThreadingHTTPServer):
    answer: tuple[int, str] = (200, "")


class Handler(BaseHTTPRequestHandler):
    server: Replay

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.server.answer
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replay() -> Iterator[Replay]:
    server = Replay(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url(server: Replay) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_every_probe_of_a_check_with_both_apis_is_planned() -> None:
    assert list(PROBES) == list(RECORDED)
    assert PROBES["stop string"].body["stop"] == [" h"]  # inside the answer " g h i j"
    assert len(PROBES["prompt longer than the context"].body["prompt"].split()) == 128 + 16


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_real_images_answer_to_each_probe_passes(replay: Replay, name: str) -> None:
    replay.answer = (RECORDED[name]["status"], RECORDED[name]["body"])
    probes.send(url(replay), PROBES[name])


def test_a_server_error_fails_the_probe_keeping_request_and_response(replay: Replay) -> None:
    replay.answer = (500, '{"error": {"message": "EngineCore encountered an issue", "code": 500}}')
    with pytest.raises(VerifyError, match=r"probe 'logprobs': POST /v1/completions -> HTTP 500, expected 200") as caught:
        probes.send(url(replay), PROBES["logprobs"])
    kept = caught.value.request
    assert kept is not None and kept["status"] == 500 and kept["request"]["body"]["logprobs"] == 2
    assert "EngineCore" in kept["response"]


@pytest.mark.parametrize(
    ("name", "change", "words"),
    [
        ("logprobs", lambda a: a["choices"][0]["logprobs"].update(top_logprobs=[]), "top_logprobs"),
        ("prompt_logprobs", lambda a: a["choices"][0].update(prompt_logprobs=None), "prompt_logprobs is None"),
        ("n=2", lambda a: a["choices"].pop(), "1 choices for n=2"),
        ("stop string", lambda a: a["choices"][0].update(finish_reason="length", text=" g h i j"), "stop ' h'"),
        ("logprobs (chat)", lambda a: a["choices"][0].update(logprobs=None), "logprobs.content"),
    ],
)
def test_an_answer_that_is_wrong_in_its_own_way_fails_the_probe(replay: Replay, name: str, change: Any, words: str) -> None:
    answer = json.loads(RECORDED[name]["body"])
    change(answer)
    replay.answer = (200, json.dumps(answer))
    with pytest.raises(VerifyError, match=re.escape(f"probe '{name}'")) as caught:
        probes.send(url(replay), PROBES[name])
    assert words in str(caught.value)


def test_a_stream_that_ends_without_done_fails(replay: Replay) -> None:
    body = RECORDED["stream (completions)"]["body"].replace("data: [DONE]", "")
    replay.answer = (200, body)
    with pytest.raises(VerifyError, match=r"not a server-sent event stream .*\[DONE\]"):
        probes.send(url(replay), PROBES["stream (completions)"])


def test_a_server_that_answers_an_over_long_prompt_fails_the_refusal_probe(replay: Replay) -> None:
    replay.answer = (200, RECORDED["logprobs"]["body"])
    with pytest.raises(VerifyError, match="HTTP 200, expected 400"):
        probes.send(url(replay), PROBES["prompt longer than the context"])
