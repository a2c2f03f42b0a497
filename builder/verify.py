"""Verify stage: serve the image's OpenAI-compatible API, check known answers, measure speed.

Answers are greedy (temperature 0) so a right build gives exactly the expected text. Speed is
measured with vLLM's own benchmark, run from the image against its server (``builder.speed``):
decode, prefill and queueing at each concurrency level of the check.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import requests

from builder import checkkinds, checkmodel, host, jitcache, kernelpath, log, numerics, probes, runnable, speed
from builder.benchmark import Benchmark
from builder.engine import Container, Engine
from builder.errors import FatalError, VerifyError
from builder.matrix import Check, Prompt
from builder.registry import free_port

MODEL_NAME = "sparkbuild-check"
# The server's whole log, beside verify.json, pass or fail: what the kernel-path gate read.
SERVER_LOG = "server.log"
# Beside it when the check failed: the error, the request that failed and its response, and how
# the server ended (exit code, signal, OOM kill).
FAILURE = "failure.json"


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
class VerifyResult:
    image: str
    model: str
    check: str
    startup_s: float
    answers: tuple[Answer, ...]
    # vllm bench serve's figures; None where an answer was wrong (nothing worth timing) or there
    # was no image to run the benchmark from (verify --url).
    benchmark: Benchmark | None = None
    # What the server said it is (GET /version), and the kernels it chose where the check expects some.
    vllm_version: str = ""
    kernels: tuple[kernelpath.Chosen, ...] = field(default=())
    # The client probes the server answered as it should (builder/probes.py).
    probes: tuple[str, ...] = field(default=())
    # The answers' logprobs against the model's recorded reference, one by one and batched
    # (builder/numerics.py); empty where the model recorded none.
    numbers: tuple[numerics.Comparison, ...] = field(default=())
    # Depth and time: the check kinds the check names (builder/checkkinds.py), after its answers.
    kinds: tuple[checkkinds.Outcome, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return (
            all(a.ok for a in self.answers)
            and all(k.ok for k in self.kernels)
            and all(n.ok for n in self.numbers)
            and all(k.ok for k in self.kinds)
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["benchmark"] = self.benchmark.to_json() if self.benchmark else None
        data["ok"] = self.ok
        for answer, raw in zip(self.answers, data["answers"], strict=True):
            raw["ok"] = answer.ok
        data["kernels"] = [k.to_json() for k in self.kernels]
        data["numbers"] = [n.to_json() for n in self.numbers]
        return data


def serve_check(
    engine: Engine, image: str, check: Check, model: Path, result_file: Path, *, gpus: bool = False, bench: bool = True
) -> VerifyResult:
    """Serve ``model`` from ``image`` and run the check: the result, written to ``result_file``,
    not judged. ``bench``: measure the speed too (a target's first check; the others give
    answers and kernel paths). Whatever happens, the server's whole log is kept beside the
    result; when the check fails, so is what failed (``failure.json``)."""
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
    folder = result_file.parent
    # What the server compiles (torch.compile, Triton, FlashInfer JIT) is kept for this image alone.
    caches = {jitcache.volume_for(str(engine.inspect(image)["Id"])): jitcache.MOUNT}
    run = engine.run(
        image, command, name=name, mounts={model.resolve(): "/model"}, caches=caches, environment=jitcache.ENV, gpus=gpus
    )
    with run as container:
        try:
            with log.step(f"Waiting for {image} to serve on {url}"):
                startup = wait_healthy(container, url, check.startup_timeout)
            server = Server(
                url=url,
                model=MODEL_NAME,
                read_log=lambda: container.logs(tail=None),
                benchmark=(
                    lambda: speed.measure(engine, image, check, model, url=url, served_name=MODEL_NAME, folder=folder / "bench")
                )
                if bench
                else None,
                no_benchmark="speed is measured on the target's first check",
                reference=numerics.load(model),
            )
            return run_check(server, check, image=image, model=str(model), startup=startup, result_file=result_file)
        except VerifyError as exc:
            raise failed(exc, container, check, image, folder) from None
        finally:
            _save_log(container, folder / SERVER_LOG)


def _save_log(container: Container, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(container.logs(tail=None))


def failed(exc: VerifyError, container: Container, check: Check, image: str, folder: Path) -> VerifyError:
    """``exc`` with the evidence kept: failure.json (the error, the failing request and response,
    how the server ended) beside the server's log, both named in the message."""
    state = container.state()
    evidence: dict[str, Any] = {"check": check.name, "image": image, "error": str(exc), "server": state.to_json()}
    if exc.request is not None:
        evidence["request"] = exc.request
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILURE).write_text(json.dumps(evidence, indent=2) + "\n")
    return VerifyError(
        f"{exc}\n  the server then: {state.text()}\n  its log: {folder / SERVER_LOG}\n  what failed: {folder / FAILURE}"
    )


def result_files(first: Path, checks: Sequence[Check]) -> dict[str, Path]:
    """Where each check's result goes: the first (benchmarked) check's at ``first``, with its
    server.log, bench/ and plot beside it; each further check's in ``checks/<name>/`` beside that."""
    return {c.name: first if i == 0 else first.parent / "checks" / c.name / first.name for i, c in enumerate(checks)}


def passed(result_file: Path, image: str) -> bool:
    """Whether ``result_file`` is a passing result of ``image``, or says the check was skipped on
    this host (what publish requires of each check: a skip is named in the summary and attached as
    such, never counted as a pass)."""
    try:
        data = json.loads(result_file.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("image") != image:
        return False
    return data.get("ok") is True or bool(data.get("skipped"))


@dataclass(frozen=True, kw_only=True)
class Verified:
    """What every check of a target gave: a result for each that served its answers, and the
    failure of each that did not pass (wrong answer, unexpected kernel, no server, no model)."""

    checks: tuple[str, ...]
    results: dict[str, VerifyResult]
    failures: dict[str, FatalError]
    # Checks this host cannot run (builder/runnable.py), with the reason: never served.
    skipped: dict[str, str] = field(default_factory=dict)
    # Each check's folder (verify.json, server.log, failure.json).
    folders: dict[str, Path] = field(default_factory=dict)

    @property
    def first(self) -> VerifyResult | None:
        """The benchmarked check's result."""
        return self.results.get(self.checks[0])

    def require(self) -> Verified:
        """Raise unless every check passed: one failure as it was raised, several in one message
        (of the first failure's kind, so its exit code)."""
        if not self.failures:
            return self
        errors = list(self.failures.values())
        if len(errors) == 1:
            raise errors[0]
        text = "\n".join(f"check {name}: {exc}" for name, exc in self.failures.items())
        raise type(errors[0])(f"{len(errors)} of {len(self.checks)} checks failed:\n{text}")


def verify_all(
    engine: Engine,
    image: str,
    checks: Sequence[Check],
    result_file: Path,
    *,
    cache: Path,
    gpus: bool = False,
    model: Path | None = None,
) -> Verified:
    """Every check of a target against ``image``, one server each, in order; the first is
    benchmarked. A failing check never stops the next: all are run, then judged together.
    ``model`` is a folder to serve in place of the (single) check's own model."""
    files = result_files(result_file, checks)
    results: dict[str, VerifyResult] = {}
    failures: dict[str, FatalError] = {}
    skipped: dict[str, str] = {}
    serving = runnable.Serving.of(engine.inspect(image)["Config"].get("Labels") or {}, host.read_cpu())
    for i, check in enumerate(checks):
        with log.step(f"check {check.name} ({i + 1}/{len(checks)}) on {image}"):
            # An earlier run's result of this check must not stand for this one's.
            for stale in (files[check.name], files[check.name].parent / FAILURE):
                stale.unlink(missing_ok=True)
            reason = None if model is not None else runnable.skip_reason(check, serving)
            if reason is not None:
                skipped[check.name] = reason
                write_skipped(files[check.name], check, image, reason)
                log.warning(f"check {check.name}: SKIPPED, not served on this host: {reason}")
                continue
            try:
                folder = model or checkmodel.provide(cache, check)
                served = serve_check(engine, image, check, folder, files[check.name], gpus=gpus, bench=i == 0)
                results[check.name] = served
                require(served, files[check.name])
            except FatalError as exc:
                failures[check.name] = exc
                log.error(f"check {check.name}: {exc}")
    folders = {name: path.parent for name, path in files.items()}
    return Verified(checks=tuple(c.name for c in checks), results=results, failures=failures, skipped=skipped, folders=folders)


def write_skipped(result_file: Path, check: Check, image: str, reason: str) -> None:
    """The result of a check this host cannot run: named as skipped, with why; never ``ok``."""
    result_file.parent.mkdir(parents=True, exist_ok=True)
    data = {"image": image, "check": check.name, "ok": False, "skipped": reason}
    result_file.write_text(json.dumps(data, indent=2) + "\n")


def verify_url(url: str, check: Check, result_file: Path, log_file: Path | None = None) -> VerifyResult:
    """Run the check against a server already running at ``url`` (a deployment after a rollout):
    answers and, from ``log_file``, the kernel-path gate. No benchmark: ``vllm bench serve`` runs
    from the image under test, and there is none here."""
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
    not readable, as for a server sparkbuild did not start and no log file was given), and how to
    benchmark it (None: no image to run ``vllm bench serve`` from)."""

    url: str
    model: str
    read_log: Callable[[], str] | None
    benchmark: Callable[[], Benchmark] | None = None
    # Why there is no benchmark, for the log.
    no_benchmark: str = "no image to run vllm bench serve from"
    # The logprobs the model's maker recorded, to hold the answers' numbers to (None: none recorded).
    reference: numerics.Reference | None = None


def run_check(server: Server, check: Check, *, image: str, model: str, startup: float, result_file: Path) -> VerifyResult:
    """Answers, the benchmark where they are right, and the kernel-path gate; the result is written
    to ``result_file`` (and the server's log beside it), not judged."""
    version = server_version(server.url)
    answers = tuple(ask(server.url, prompt, server.model) for prompt in check.prompts)
    for a in answers:
        log.info(f"  {a.name} ({a.api}): {a.prompt!r} -> {a.received!r} [{'ok' if a.ok else 'WRONG'}]")
    probed = survive_clients(server, check, answers)
    numbers = held_to_reference(server, check) if all(a.ok for a in answers) else ()
    asking = partial(ask, server.url, model=server.model)
    kinds = checkkinds.run(server.url, server.model, check, asking) if all(a.ok for a in answers) else ()
    bench: Benchmark | None = None
    if not all(a.ok for a in answers) or not all(n.ok for n in numbers) or not all(k.ok for k in kinds):
        pass  # a wrong answer, right ones on wrong numbers, or a failed kind: nothing worth timing
    elif server.benchmark is None:
        log.info(f"  speed not measured: {server.no_benchmark}")
    else:
        levels = ", ".join(map(str, check.concurrency))
        with log.step(f"vllm bench serve: decode, prefill, queueing at concurrency {levels}, x{check.bench_repeats}"):
            bench = server.benchmark()
    kernels = _gate(server, check, version, result_file.parent / SERVER_LOG)
    result = VerifyResult(
        image=image,
        model=model,
        check=check.name,
        startup_s=startup,
        answers=answers,
        benchmark=bench,
        vllm_version=version,
        kernels=kernels,
        probes=probed,
        numbers=numbers,
        kinds=kinds,
    )
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def held_to_reference(server: Server, check: Check) -> tuple[numerics.Comparison, ...]:
    """The answers' logprobs against the reference the model recorded (where it recorded one)."""
    if server.reference is None:
        return ()
    found = numerics.compare(server.url, server.model, server.reference, check.name)
    for c in found:
        log.info(f"  logprobs against the reference ({server.reference.format}), {c.text()}: {'ok' if c.ok else 'MOVED'}")
    return found


def survive_clients(server: Server, check: Check, answers: tuple[Answer, ...]) -> tuple[str, ...]:
    """The client probes (logprobs, streams, n, stop, invalid requests), then the first prompt again:
    the server must still give the answer it gave before them."""
    done = probes.run(server.url, probes.plan(check.prompts, server.model, max_model_len(server.url)))
    if check.prompts:
        again = ask(server.url, check.prompts[0], server.model)
        if again.received != answers[0].received:
            raise VerifyError(
                f"{again.name}: after the client probes the server answers {again.received!r}, "
                f"before them {answers[0].received!r}"
            )
    return done


def max_model_len(url: str) -> int:
    """The served context length (GET /v1/models)."""
    try:
        response = requests.get(f"{url}/v1/models", timeout=10)
        response.raise_for_status()
        return int(response.json()["data"][0]["max_model_len"])
    except (requests.RequestException, KeyError, IndexError, ValueError, TypeError) as exc:
        raise VerifyError(f"GET {url}/v1/models gave no max_model_len ({exc}): is it a vLLM server?") from None


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
    unverified_ok = check.accept_unverified_kernel_patterns
    chosen = tuple(kernelpath.gate(check.expected_kernels, text, version, accept_unverified=unverified_ok))
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
    moved = numerics.problems(result.numbers)
    if moved:
        problems += [f"{result.image}: the answers' logprobs moved beyond the tolerance recorded with the model:", *moved]
    if failed_kinds := checkkinds.problems(result.kinds):
        problems += [f"{result.image}: check {result.check}'s kinds failed (docs/check-kinds.md):", *failed_kinds]
    gate = kernelpath.failures(result.kernels, result.vllm_version)
    if gate:
        problems += [f"{result.image}: kernel-path gate failed:", *gate]
    if problems:
        raise VerifyError(
            "\n".join([*problems, f"result: {result_file}", f"the server's log: {result_file.parent / SERVER_LOG}"])
        )
    return result


def server_version(url: str) -> str:
    """The vLLM version the server reports (GET /version): which log patterns the gate reads."""
    try:
        response = requests.get(f"{url}/version", timeout=10)
        response.raise_for_status()
        return str(response.json()["version"])
    except (requests.RequestException, KeyError, ValueError, TypeError) as exc:
        raise VerifyError(f"GET {url}/version failed ({exc}): is it a vLLM server?") from None


# vLLM's words when its engine failed to start. The API server process does not always exit after
# them (seen with vLLM 0.32's CPU image: it hung until the startup timeout, 15 minutes), so verify
# stops waiting at the first of these lines rather than at the timeout.
ENGINE_DEAD = (
    "Engine core initialization failed",
    "EngineCore failed to start",
    "WorkerProc failed to start",
)


def wait_healthy(container: Container, url: str, timeout: int) -> float:
    """Poll /health until it answers; fail at once, with the last log lines, if the server dies or
    its engine fails to start."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not container.running():
            raise VerifyError(
                f"the server exited (code {container.exit_code()}) before it was healthy; "
                f"its last log lines:\n{container.logs(40)}"
            )
        dead = engine_dead(container.logs(tail=400))
        if dead is not None:
            raise VerifyError(
                f"the server's engine failed to start ({dead!r}) before it was healthy; its last log lines:\n{container.logs(40)}"
            )
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(1)
    raise VerifyError(f"the server was not healthy after {timeout}s; its last log lines:\n{container.logs(40)}")


def engine_dead(text: str) -> str | None:
    """The log line that says vLLM's engine failed to start, if any."""
    return next((line.strip() for line in text.splitlines() if any(words in line for words in ENGINE_DEAD)), None)


def _body(prompt: Prompt, max_tokens: int, model: str = MODEL_NAME) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if prompt.api == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt.prompt}]}
    return "/v1/completions", {**common, "prompt": prompt.prompt}


def ask(url: str, prompt: Prompt, model: str = MODEL_NAME) -> Answer:
    path, body = _body(prompt, prompt.max_tokens, model)
    status: int | None = None
    text = ""
    try:
        response = requests.post(url + path, json=body, timeout=120)
        status, text = response.status_code, response.text
        response.raise_for_status()
        choice = response.json()["choices"][0]
    except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
        raise probes.request_failed(
            f"{prompt.name}: POST {path} failed: {exc}", name=prompt.name, path=path, body=body, status=status, response=text
        ) from None
    text = choice["message"]["content"] if prompt.api == "chat" else choice["text"]
    return Answer(
        name=prompt.name, api=prompt.api, prompt=prompt.prompt, expected=prompt.expect, received=text or "", match=prompt.match
    )
