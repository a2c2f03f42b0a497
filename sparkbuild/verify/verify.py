"""Verify stage: serve the image's OpenAI-compatible API, check known answers, measure speed.

Answers are greedy (temperature 0) so a right build gives exactly the expected text. Speed is
measured with vLLM's own benchmark, run from the image against its server (``sparkbuild.verify.speed``):
decode, prefill and queueing at each concurrency level of each check with ``bench``.

A result names what it is of, so publish can tie it to the image it pushes (``tie``): the image
by its reference and its ID (the digest of its config), the vLLM version its server reported,
and the sha256 of the server's log kept beside it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import requests
from packaging.version import InvalidVersion, Version

from sparkbuild.errors import ConfigError, FatalError, VerifyError
from sparkbuild.oci import jitcache
from sparkbuild.oci.engine import Container, Engine
from sparkbuild.oci.remote import Node
from sparkbuild.plan import matrix, runnable
from sparkbuild.plan.matrix import Check, Prompt
from sparkbuild.upstream import kernelpath
from sparkbuild.util import host, log
from sparkbuild.util.net import free_port
from sparkbuild.verify import checkkinds, checkmodel, multinode, numerics, probes, speed
from sparkbuild.verify.benchmark import Benchmark
from sparkbuild.verify.layout import SERVER_LOG, result_files

MODEL_NAME = "sparkbuild-check"
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
        return matrix.answers(self.expected, self.match, self.received)


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
    # The client probes the server answered as it should (sparkbuild/verify/probes.py).
    probes: tuple[str, ...] = field(default=())
    # The answers' logprobs against the model's recorded reference, one by one and batched
    # (sparkbuild/verify/numerics.py); empty where the model recorded none.
    numbers: tuple[numerics.Comparison, ...] = field(default=())
    # The image's ID (the sha256 of its config) and the sha256 of the server's log saved beside
    # this result: what ties it to the image publish pushes. None for a server verify did not
    # start (verify --url).
    image_id: str | None = None
    server_log_sha256: str | None = None
    # Depth and time: the check kinds the check names (sparkbuild/verify/checkkinds.py), after its answers.
    kinds: tuple[checkkinds.Outcome, ...] = field(default=())
    # The requests the server had served when its answers were first asked (vLLM's /metrics; None: unreadable).
    served_before: int | None = None
    # The answers and their numbers asked again after everything else verify sent (None: not reached).
    after_load: Recheck | None = None
    # The nodes that served, where a cluster did (multi_node): how many, how split, where they met, their logs.
    cluster: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return (
            all(a.ok for a in self.answers)
            and all(k.ok for k in self.kernels)
            and all(n.ok for n in self.numbers)
            and all(k.ok for k in self.kinds)
            and (self.after_load is None or self.after_load.ok)
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["benchmark"] = self.benchmark.to_json() if self.benchmark else None
        data["ok"] = self.ok
        for answer, raw in zip(self.answers, data["answers"], strict=True):
            raw["ok"] = answer.ok
        data["kernels"] = [k.to_json() for k in self.kernels]
        data["numbers"] = [n.to_json() for n in self.numbers]
        data["after_load"] = self.after_load.to_json() if self.after_load else None
        return data


@dataclass(frozen=True, kw_only=True)
class Recheck:
    """The check's answers and their logprobs asked again at the end, judged by the same rule: a kernel that
    turns wrong with use (right on the first prompts, garbage from the Nth request) fails here."""

    served: int | None
    answers: tuple[Answer, ...]
    numbers: tuple[numerics.Comparison, ...]

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.answers) and all(n.ok for n in self.numbers)

    def when(self) -> str:
        return f"after the load ({self.served} requests served)" if self.served is not None else "after the load"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for answer, raw in zip(self.answers, data["answers"], strict=True):
            raw["ok"] = answer.ok
        data["numbers"] = [n.to_json() for n in self.numbers]
        return data


@contextmanager
def started(engine: Engine, image: str, check: Check, model: Path, *, gpus: bool = False) -> Iterator[tuple[Container, str]]:
    """A container of ``image`` serving ``model`` as the check serves it (not yet healthy), and
    its URL; removed on the way out. What the server compiles (torch.compile, Triton, FlashInfer
    JIT) is kept in a volume of this image's own (``sparkbuild.oci.jitcache``)."""
    port = free_port()
    command = ["/model", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME, *check.serve_args]
    caches = jitcache.for_image(image_id(engine, image))
    name = f"sparkbuild-verify-{secrets.token_hex(4)}"
    mounts = {model.resolve(): "/model"}
    environment = jitcache.environment()
    with engine.run(image, command, name=name, mounts=mounts, caches=caches, environment=environment, gpus=gpus) as container:
        yield container, f"http://127.0.0.1:{port}"


def image_id(engine: Engine, image: str) -> str:
    """The image's ID: the sha256 of its config, which any change to the image changes."""
    return str(engine.inspect(image)["Id"])


def serve_check(
    engine: Engine,
    image: str,
    check: Check,
    model: Path,
    result_file: Path,
    *,
    gpus: bool = False,
    peers: multinode.Peers | None = None,
) -> VerifyResult:
    """Serve ``model`` from ``image`` and run the check: the result, written to ``result_file``,
    not judged; the speed too where the check has ``bench``. Whatever happens, the server's whole
    log is kept beside the result; when the check fails, so is what failed (``failure.json``).
    A check naming ``multi_node`` is served by a cluster of the image instead (``serve_cluster``),
    its nodes past the head on ``peers`` where given."""
    if check.kinds.multi_node is not None:
        return serve_cluster(engine, image, check, model, result_file, gpus=gpus, peers=peers)
    folder = result_file.parent
    with started(engine, image, check, model, gpus=gpus) as (container, url):
        done = False
        try:
            with log.step(f"Waiting for {image} to serve on {url}"):
                startup = wait_healthy(container, url, check.startup_timeout)
            server = Server(
                url=url,
                model=MODEL_NAME,
                read_log=lambda: container.logs(tail=None),
                benchmark=(
                    lambda: speed.measure(
                        engine,
                        image,
                        check,
                        model,
                        url=url,
                        served_name=MODEL_NAME,
                        folder=folder / "bench",
                        read_log=lambda: container.logs(tail=None),
                        served_before=served_requests(url),
                    )
                )
                if check.bench
                else None,
                no_benchmark=f"check {check.name} has bench: false",
                image_id=image_id(engine, image),
                reference=numerics.load(model),
            )
            result = run_check(server, check, image=image, model=str(model), startup=startup, result_file=result_file)
            done = True  # run_check kept the log its result names (by digest)
            return result
        except VerifyError as exc:
            raise failed(exc, container, check, image, folder) from None
        finally:
            if not done:
                _save_log(container, folder / SERVER_LOG)


# Where a cluster's nodes keep their logs, beside the check's result (the head's is also server.log).
MULTI_NODE_DIR = "multi-node"


def serve_cluster(
    engine: Engine,
    image: str,
    check: Check,
    model: Path,
    result_file: Path,
    *,
    gpus: bool = False,
    images: Sequence[str] = (),
    layout: multinode.Layout | None = None,
    peers: multinode.Peers | None = None,
) -> VerifyResult:
    """The check with a cluster of ``image`` as its server (sparkbuild/verify/multinode.py): the model split
    over the nodes by vLLM's own multi-node launch, then every step of the check against the head, as
    against one server: answers, probes, the logprobs held to the model's reference (what one node must
    give), the kinds (the burn-in among them), the kernel path from the head's log. A node that stops
    fails the check naming it; every node's log is kept in ``multi-node/`` beside the result.
    ``peers``: the machines the nodes past the head run on, over ssh (default: every node on this
    machine's loopback); ``images``: each node's image where they differ (default ``image`` on every
    node); ``layout``: where the nodes meet on this machine (default: its loopback, free ports)."""
    settings = check.kinds.multi_node
    if settings is None:
        raise ValueError(f"check {check.name} names no multi_node")
    folder = result_file.parent
    if peers is not None and peers.hosts:
        layout, machines = multinode.over_ssh(settings.nodes, peers.nodes(), peers.interface, launch=settings.launch)
    else:
        layout = layout or multinode.loopback(settings.nodes, launch=settings.launch)
        machines = [Node(host=None)] * settings.nodes
    with (
        multinode.places(engine, image, machines, images) as places,
        multinode.cluster(
            check, model, folder / MULTI_NODE_DIR, places=places, model_name=MODEL_NAME, layout=layout, gpus=gpus
        ) as found,
    ):
        head = found.nodes[0]
        with log.step(f"Waiting for the {layout.nodes}-node cluster of {image} to serve on {found.url}"):
            startup = wait_healthy(head, found.url, check.startup_timeout, down=found.stopped)
        server = Server(
            url=found.url,
            model=MODEL_NAME,
            read_log=lambda: head.logs(tail=None),
            no_benchmark=f"check {check.name} is served by a cluster: its speed is measured on one node",
            image_id=found.image_id,
            reference=numerics.load(model),
            cluster=found.describe(folder / MULTI_NODE_DIR),
        )
        try:
            result = run_check(server, check, image=image, model=str(model), startup=startup, result_file=result_file)
        except VerifyError as exc:
            down = found.watch.settle()
            cause = (
                exc if down is None else VerifyError(f"{down.text()}, while verify asked the cluster: {exc}", request=exc.request)
            )
            raise cluster_failed(cause, found, check, image, folder) from None
        if found.watch.down is not None:
            raise cluster_failed(VerifyError(f"{found.watch.down.text()}, as verify finished"), found, check, image, folder)
        return result


def cluster_failed(exc: VerifyError, found: multinode.Cluster, check: Check, image: str, folder: Path) -> VerifyError:
    """``exc`` with the evidence kept, as ``failed`` keeps it for one server (the head's log is server.log),
    and where every node's log is."""
    head = found.nodes[0]
    _save_log(head, folder / SERVER_LOG)
    return VerifyError(f"{failed(exc, head, check, image, folder)}\n  every node's log: {folder / MULTI_NODE_DIR}")


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


def tie(result_file: Path, image: str, inspected: Mapping[str, Any]) -> str | None:
    """Why ``result_file`` is not a result publish may trust for ``image`` (``inspected``: the
    engine's inspect of it); None where it is one. A result is trusted when it passed, or says
    the check was skipped on this host (named in the summary and attached as such, never counted
    as a pass), and names this image by its reference and its ID; a served one also names the
    vLLM version the image carries and the sha256 of the server's log beside it, which names that
    version too. A hand-written result, or one of the image as it was before a rebuild, fails one
    of these."""
    try:
        data = json.loads(result_file.read_text())
    except (OSError, ValueError) as exc:
        return f"no readable result ({type(exc).__name__})"
    if not isinstance(data, dict):
        return "not a verify result (a JSON object)"
    if data.get("image") != image:
        return f"a result of {data.get('image')!r}, not of {image}"
    own = str(inspected["Id"])
    if data.get("image_id") != own:
        return f"it names image ID {data.get('image_id')!r}, but {image} is {own}: a stale or hand-written result"
    if data.get("skipped"):
        return None
    if data.get("ok") is not True:
        return "the check did not pass"
    return _served_by(result_file.parent / SERVER_LOG, data, inspected)


def _served_by(log_file: Path, data: Mapping[str, Any], inspected: Mapping[str, Any]) -> str | None:
    """Why the server log and the vLLM version a passing result names are not this image's."""
    try:
        text = log_file.read_bytes()
    except OSError:
        return f"no server log beside it ({log_file}): not a result verify wrote"
    digest = log_digest(text)
    if data.get("server_log_sha256") != digest:
        return (
            f"it names server log {data.get('server_log_sha256')!r}, but {log_file} is {digest}: an edited or hand-written result"
        )
    version = str(data.get("vllm_version") or "")
    if not version or version not in text.decode(errors="replace"):
        return f"its server log never names the vLLM version it gives ({version!r})"
    carried = (inspected.get("Config", {}).get("Labels") or {}).get("io.sparkbuild.vllm.version")
    if carried is not None and _public(version) != _public(carried):
        return f"its server reported vLLM {version}; the image carries {carried}"
    return None


def log_digest(text: bytes) -> str:
    return "sha256:" + hashlib.sha256(text).hexdigest()


def _public(version: str) -> str:
    """``0.32.0`` of ``0.32.0+cpu``: the version without its local label."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version


@dataclass(frozen=True, kw_only=True)
class Verified:
    """What every check of a target gave: a result for each that served its answers, and the
    failure of each that did not pass (wrong answer, unexpected kernel, no server, no model)."""

    checks: tuple[str, ...]
    results: dict[str, VerifyResult]
    failures: dict[str, FatalError]
    # Checks this host cannot run (sparkbuild/plan/runnable.py), with the reason: never served.
    skipped: dict[str, str] = field(default_factory=dict)
    # Each check's folder (verify.json, server.log, failure.json).
    folders: dict[str, Path] = field(default_factory=dict)

    @property
    def first(self) -> VerifyResult | None:
        """The first check's result."""
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
    layout: Sequence[str] = (),
    peers: multinode.Peers | None = None,
) -> Verified:
    """Every check of a target against ``image``, one server each, in order; each with ``bench``
    is benchmarked. A failing check never stops the next: all are run, then judged together.
    ``model`` is a folder to serve in place of the (single) check's own model. ``layout``: the
    target's checks, where ``checks`` are some of them (their results go where the target's go).
    ``peers``: the other machines a check served across nodes runs on (sparkbuild/verify/multinode.py)."""
    if short := [why for check in checks if (why := checkkinds.burn_in_too_short(check))]:
        raise ConfigError("\n".join(short))
    files = result_files(result_file, layout or checks)
    results: dict[str, VerifyResult] = {}
    failures: dict[str, FatalError] = {}
    skipped: dict[str, str] = {}
    serving = runnable.Serving.of(engine.inspect(image)["Config"].get("Labels") or {}, host.read_cpu())
    others = len(peers.hosts) if peers else 0  # the machines a check served across nodes may run on, past this one
    for i, check in enumerate(checks):
        with log.step(f"check {check.name} ({i + 1}/{len(checks)}) on {image}"):
            # An earlier run's result of this check must not stand for this one's.
            for stale in (files[check.name], files[check.name].parent / FAILURE):
                stale.unlink(missing_ok=True)
            reason = (None if model is not None else runnable.skip_reason(check, serving)) or runnable.cluster_reason(
                check, gpus=gpus, other_machines=others
            )
            if reason is not None:
                skipped[check.name] = reason
                write_skipped(files[check.name], check, image, image_id(engine, image), reason)
                log.warning(f"check {check.name}: SKIPPED, not served on this host: {reason}")
                continue
            try:
                folder = model or checkmodel.provide(cache, check)
                served = serve_check(engine, image, check, folder, files[check.name], gpus=gpus, peers=peers)
                results[check.name] = served
                require(served, files[check.name])
            except FatalError as exc:
                failures[check.name] = exc
                log.error(f"check {check.name}: {exc}")
    folders = {name: path.parent for name, path in files.items()}
    return Verified(checks=tuple(c.name for c in checks), results=results, failures=failures, skipped=skipped, folders=folders)


def write_skipped(result_file: Path, check: Check, image: str, identity: str, reason: str) -> None:
    """The result of a check this host cannot run: named as skipped, with why; never ``ok``."""
    result_file.parent.mkdir(parents=True, exist_ok=True)
    data = {"image": image, "image_id": identity, "check": check.name, "ok": False, "skipped": reason}
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
    # The ID of the image serving (None: a server verify did not start).
    image_id: str | None = None
    # A cluster's shape, where the server is one (sparkbuild/verify/multinode.py): kept in the result.
    cluster: dict[str, Any] | None = None


def run_check(server: Server, check: Check, *, image: str, model: str, startup: float, result_file: Path) -> VerifyResult:
    """Answers, the benchmark where they are right, and the kernel-path gate; the result is written
    to ``result_file`` (and the server's log beside it), not judged."""
    version = server_version(server.url)
    served_before = served_requests(server.url)
    answers = tuple(ask(server.url, prompt, server.model) for prompt in check.prompts)
    for a in answers:
        log.info(f"  {a.name} ({a.api}): {a.prompt!r} -> {a.received!r} [{'ok' if a.ok else 'WRONG'}]")
    right = all(a.ok for a in answers)
    # A wrong answer is the finding; the probes (a stop string inside the expected answer) and the
    # numbers (the reference's tokens) presume right ones. The kinds presume right numbers too: a
    # kernel whose logprobs already moved has failed, and a burn-in of it would only spend the runner's
    # time (hundreds of requests) to say so again.
    probed = survive_clients(server, check, answers) if right else ()
    numbers = held_to_reference(server, check) if right else ()
    asking = partial(ask, server.url, model=server.model)
    kinds = checkkinds.run(server.url, server.model, check, asking) if right and all(n.ok for n in numbers) else ()
    bench: Benchmark | None = None
    if not all(a.ok for a in answers) or not all(n.ok for n in numbers) or not all(k.ok for k in kinds):
        pass  # a wrong answer, right ones on wrong numbers, or a failed kind: nothing worth timing
    elif server.benchmark is None:
        log.info(f"  speed not measured: {server.no_benchmark}")
    else:
        levels = ", ".join(map(str, check.concurrency))
        with log.step(f"vllm bench serve: decode, prefill, queueing at concurrency {levels}, x{check.bench_repeats}"):
            bench = server.benchmark()
    after = recheck(server, check) if right and all(n.ok for n in numbers) and all(k.ok for k in kinds) else None
    text = _keep_log(server, result_file.parent / SERVER_LOG)
    kernels = _gate(text, check, version)
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
        image_id=server.image_id,
        server_log_sha256=None if text is None else log_digest(text.encode()),
        kinds=kinds,
        served_before=served_before,
        after_load=after,
        cluster=server.cluster,
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


def recheck(server: Server, check: Check) -> Recheck:
    """The answers one by one and their logprobs (one by one and batched) again, after everything else verify
    sent the server (probes, kinds, the benchmark)."""
    served = served_requests(server.url)
    answers = tuple(ask(server.url, prompt, server.model) for prompt in check.prompts)
    numbers = numerics.compare(server.url, server.model, server.reference, check.name) if server.reference else ()
    found = Recheck(served=served, answers=answers, numbers=numbers)
    log.info(
        f"  {found.when()}: {sum(a.ok for a in answers)} of {len(answers)} answers right, numbers {'ok' if found.ok else 'MOVED'}"
    )
    return found


# The counter vLLM's /metrics keeps of the requests it finished (one sample per finish reason).
SERVED = "vllm:request_success_total"


def served_requests(url: str) -> int | None:
    """How many requests the server has finished, by its own count (GET /metrics); None where it has none."""
    try:
        response = requests.get(f"{url}/metrics", timeout=10)
        response.raise_for_status()
    except requests.RequestException:
        return None
    samples = [line.rsplit(" ", 1)[-1] for line in response.text.splitlines() if line.startswith((SERVED + "{", SERVED + " "))]
    try:
        return round(sum(float(v) for v in samples)) if samples else None
    except ValueError:
        return None


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


def _keep_log(server: Server, log_file: Path) -> str | None:
    """The server's log as it stands after every request of the check, saved to ``log_file``
    (the result names its digest); None where it cannot be read."""
    text = server.read_log() if server.read_log is not None else None
    if text is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_bytes(text.encode())
    return text


def _gate(text: str | None, check: Check, version: str) -> tuple[kernelpath.Chosen, ...]:
    """The kernels vLLM chose, from its log, for the kinds the check expects."""
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
    before = f"before the load ({result.served_before} requests served)" if result.served_before is not None else "at first"
    problems = _wrong(result.image, result.answers, result.numbers, before)
    if result.after_load is not None:
        problems += _wrong(result.image, result.after_load.answers, result.after_load.numbers, result.after_load.when())
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


def _wrong(image: str, answers: tuple[Answer, ...], numbers: tuple[numerics.Comparison, ...], when: str) -> list[str]:
    """The wrong answers and moved logprobs of one asking, saying when it was."""
    problems = [
        f"  {a.name} ({a.api}): prompt {a.prompt!r}: expected {a.expected!r}, received {a.received!r}"
        for a in answers
        if not a.ok
    ]
    if problems:
        problems.insert(0, f"{image} gave {len(problems)} wrong answer(s) of {len(answers)} {when}:")
    moved = numerics.problems(numbers)
    if moved:
        problems += [f"{image}: the answers' logprobs moved beyond the tolerance recorded with the model, {when}:", *moved]
    return problems


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


def wait_healthy(container: Container, url: str, timeout: int, *, down: Callable[[], str | None] | None = None) -> float:
    """Poll /health until it answers; fail at once, with the last log lines, if the server dies or
    its engine fails to start. ``down``: what else ended the wait, if anything (a cluster's node that
    stopped: the head's own death may follow it, so it is asked first)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if down is not None and (why := down()) is not None:
            raise VerifyError(why)
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
