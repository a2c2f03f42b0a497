"""vLLM's start-up decisions for each check, predicted in the built image before any server runs:
vLLM's own parser, engine config and model construction (``sparkbuild/image/startup_probe.py``), with
the image's entrypoint defaults and the check's ``serve_args``, and for a Spark image a GB10 FAKED
(capability 12.1, its name and memory, the toolkit's stub driver). The kernel-path gate
(``sparkbuild/upstream/kernelpath.py``) reads the lines vLLM logged meanwhile as it reads a real
server's log, so the prediction and the runner's verdict use one set of names and one rule.

What it proves: vLLM accepts the check's arguments as the image passes them, sizes its graphs and
context, and builds every layer of the check model with the backends named. What it cannot: that the
kernels run or compute right (no weight is loaded, no kernel launched), and the memory a real GPU
leaves (the faked device reports 119 GiB free, the GB10's unified memory less the OS's).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkbuild.errors import EngineError, VerifyError
from sparkbuild.image import startup_probe
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from sparkbuild.plan.matrix import Check, Target
from sparkbuild.upstream import kernelpath
from sparkbuild.util import kept, log
from sparkbuild.verify import checkmodel

if TYPE_CHECKING:
    from sparkbuild.verify.verify import VerifyResult

PROBE = Path(startup_probe.__file__).name
# Inside the probe's container.
MOUNT = "/opt/sparkbuild-startup"
# The probe's container is named so (and a random suffix): `docker ps` says what it is while it runs.
PROBE_NAME = "sparkbuild-startup-"
# The image's entrypoint code and serving defaults (dockerfiles/*/90-runtime.Dockerfile.j2).
SERVE_DEFAULTS = "/opt/sparkbuild/serve_defaults.py"
DEFAULTS_JSON = "/opt/sparkbuild/serve-defaults.json"
# The CUDA toolkit's stub driver in a devel base (NVIDIA's images and the bases made here).
STUB = "/usr/local/cuda/lib64/stubs/libcuda.so"
# What a GB10 run fakes, said in every report.
FAKED_GB10 = (
    "GPU FAKED as a GB10: torch.cuda and vLLM's CUDA platform report capability 12.1, its name and 119 GiB; "
    "the CUDA driver is the toolkit's stub; the model is built on the meta device, with every tensor it makes on the GPU "
    "(no weight loaded, no kernel run)"
)
# The probe's output is kept under the cache (this folder, sparkbuild.util.kept) by everything the probe
# reads (``inputs_key``): the same inputs again (a rehearsal run twice, a lane run again on an unchanged
# image) reuse it in place of a container that imports vLLM and torch (about a minute), and the gate
# judges it again each time.
KEPT = "startup"
# Bumped when what is kept changes shape.
KEPT_FORMAT = 1
# A model's files up to this size are hashed whole for the key (configs, tokenizers, every file of a check
# model); a larger one by its size and modification time (hashing a 65 GB model would take a minute).
WHOLE_BYTES = 16 * 2**20


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One check's start-up as vLLM's own code runs it: how far it got, what it refused, what it chose."""

    check: str
    args: tuple[str, ...]
    # parse, config, model: where vLLM refused; done: it built the model.
    stage: str
    error: str | None
    values: dict[str, Any] = field(default_factory=dict)
    # Per layer: {"layer", "kind", "backend"}.
    layers: tuple[dict[str, str], ...] = ()
    kernels: tuple[kernelpath.Chosen, ...] = ()
    # Every line vLLM logged for this check, as a server prints it (debug lines included).
    log: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.kernels)

    def problems(self, version: str) -> list[str]:
        """What fails the check by vLLM's own code: its refusal, or a backend the check does not accept
        (with the layers vLLM gave it)."""
        if self.error is not None:
            return [f"check {self.check}: vLLM refuses to start ({self.stage}): {self.error}"]
        lines = kernelpath.failures(self.kernels, version)
        for chosen in self.kernels:
            for backend, _ in chosen.found:
                named = [layer["layer"] for layer in self.layers if layer["kind"] == chosen.kind and layer["backend"] == backend]
                if backend not in chosen.expected and named:
                    lines.append(f"    {chosen.kind} {backend} on {len(named)} layer(s): {', '.join(named)}")
        return [f"check {self.check}: the kernel path vLLM will choose fails the gate:", *lines] if lines else []

    def summary(self) -> str:
        """``moe MARLIN x2, attention FLASHINFER x2`` (per kind, the backends and their layer counts)."""
        counts = Counter((layer["kind"], layer["backend"]) for layer in self.layers)
        return ", ".join(f"{kind} {backend} x{n}" for (kind, backend), n in sorted(counts.items())) or "no layers"

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "args": list(self.args),
            "stage": self.stage,
            "error": self.error,
            "values": self.values,
            "layers": list(self.layers),
            "kernels": [c.to_json() for c in self.kernels],
            "log": list(self.log),
            "ok": self.ok,
        }


@dataclass(frozen=True, kw_only=True)
class Startup:
    """Every check's prediction in one image."""

    image: str
    vllm: str
    platform: str
    faked: str | None
    predictions: tuple[Prediction, ...]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.predictions)

    def problems(self) -> list[str]:
        return [line for p in self.predictions for line in p.problems(self.vllm)]

    def require(self) -> None:
        """Fail the build, before anything is pushed, naming each check, its layer kind and backend."""
        if problems := self.problems():
            faked = f" ({self.faked})" if self.faked else ""
            raise VerifyError("\n".join([f"{self.image}: vLLM {self.vllm}'s own start-up code{faked}:", *problems]))

    def text(self) -> str:
        where = f"{self.faked}; {self.platform}" if self.faked else self.platform
        lines = [f"start-up predicted by vLLM {self.vllm}'s own code ({where}):"]
        for p in self.predictions:
            verdict = "ok" if p.ok else "FAILS"
            said = p.error if p.error is not None else f"{p.summary()}; kernel path: {kernelpath.text(p.kernels) or 'not gated'}"
            lines.append(f"  {p.check}: {verdict}: {said}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "vllm": self.vllm,
            "platform": self.platform,
            "faked": self.faked,
            "ok": self.ok,
            "checks": [p.to_json() for p in self.predictions],
        }


def cases(checks: Sequence[Check], models: dict[str, str]) -> list[dict[str, Any]]:
    """The probe's input: per check, the user's arguments as verify gives them to the image (its model
    where the probe mounts it, then ``serve_args``); the image's entrypoint adds its defaults."""
    return [{"name": c.name, "user": [models[c.name], *c.serve_args]} for c in checks]


def predict(
    engine: Engine,
    image: str,
    checks: Sequence[Check],
    models: dict[str, Path],
    *,
    gb10_stub: Path | None,
    cache: Path | None = None,
    timeout_s: float = 1800,
) -> Startup:
    """Run the probe once in ``image`` for every check (``models``: each check's model folder); with
    ``gb10_stub`` (a CUDA driver stub library) the GPU is faked as a GB10. With ``cache``, an earlier
    run's output for the same inputs is reused (``inputs_key``) and a new one is kept."""
    probe_cases, where = layout(checks, models)
    folder = None if cache is None else cache / KEPT
    key = "" if folder is None else inputs_key(engine, image, probe_cases, where, gb10_stub)
    shown = f"vLLM's start-up for {len(checks)} check(s) in {image}" + (" (a GB10 faked)" if gb10_stub else "")
    found = None if folder is None else kept.read(folder, key)
    if found is not None:
        log.info(f"{shown}: reused the probe's output for this image id, probe, arguments and models ({folder}/{key})")
        out = str(found["out"])
    else:
        with log.step(shown):
            out = _run_probe(engine, image, probe_cases, where, gb10_stub, timeout_s).strip().splitlines()[-1]
        if folder is not None:
            kept.write(folder, key, {"out": out})
    return read(image, out, checks, faked=FAKED_GB10 if gb10_stub is not None else None)


def layout(checks: Sequence[Check], models: Mapping[str, Path]) -> tuple[str, dict[str, str]]:
    """The probe's cases (JSON) and where each model folder is mounted for it."""
    where = {name: f"/models/{i}" for i, name in enumerate(sorted({str(p) for p in models.values()}))}
    return json.dumps(cases(checks, {c.name: where[str(models[c.name])] for c in checks})), where


def inputs_key(engine: Engine, image: str, probe_cases: str, where: Mapping[str, str], gb10_stub: Path | None) -> str:
    """What the probe's output follows from, hashed: the image by id, the probe's own code, its cases
    (each check's name and arguments), every file of each model where it is mounted, the stub driver.
    The container has no network, so nothing else reaches it."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": KEPT_FORMAT, "image": engine.inspect(image)["Id"], "cases": probe_cases}).encode())
    digest.update(Path(startup_probe.__file__).read_bytes())
    for src, dst in sorted(where.items(), key=lambda item: item[1]):
        digest.update(f"\0{dst}\0{model_digest(Path(src))}".encode())
    digest.update(b"\0stub\0" + (gb10_stub.read_bytes() if gb10_stub is not None else b""))
    return digest.hexdigest()


def model_digest(folder: Path) -> str:
    """A model folder's files, hashed: each by its path and its bytes, or, past ``WHOLE_BYTES`` (a real
    model's weight shard), by its size and modification time, as make keys its inputs. Symlinks are
    followed (the Hugging Face cache's snapshots link each file to a blob outside the folder)."""
    digest = hashlib.sha256()
    for parent, dirs, names in os.walk(folder, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            path = Path(parent) / name
            size, mtime = (found := path.stat()).st_size, found.st_mtime_ns
            digest.update(f"\0{path.relative_to(folder).as_posix()}\0".encode())
            digest.update(path.read_bytes() if size <= WHOLE_BYTES else f"{size} bytes, modified {mtime}".encode())
    return digest.hexdigest()


def _run_probe(
    engine: Engine, image: str, probe_cases: str, where: Mapping[str, str], gb10_stub: Path | None, timeout_s: float
) -> str:
    """The probe's stdout, from one container of ``image`` (no network) with the models mounted ``where``."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        mounts: dict[Path, tuple[str, str]] = {Path(src): (dst, "ro") for src, dst in where.items()}
        (folder / "cases.json").write_text(probe_cases)
        (folder / PROBE).write_bytes(Path(startup_probe.__file__).read_bytes())
        command = ["python3", f"{MOUNT}/{PROBE}", f"{MOUNT}/cases.json", SERVE_DEFAULTS, DEFAULTS_JSON]
        if gb10_stub is not None:
            (folder / "libcuda.so").write_bytes(gb10_stub.read_bytes())
            command += ["--gb10", f"{MOUNT}/libcuda.so"]
        mounts[folder] = (MOUNT, "ro")
        try:
            return engine.output(image, command, mounts=mounts, timeout_s=timeout_s, name=f"{PROBE_NAME}{secrets.token_hex(4)}")
        except EngineError as exc:
            raise VerifyError(f"{image}: vLLM's start-up could not be run there: {exc}") from None


def unpredictable(check: Check) -> str | None:
    """Why vLLM's start-up cannot be predicted for ``check`` (None: it can)."""
    if check.kinds.multi_node is not None:
        # The probe is one process on one faked GPU; a cluster splits every layer over its nodes' ranks.
        return f"served across {check.kinds.multi_node.nodes} nodes: the prediction runs one process on one GPU"
    return None


def on_gb10(engine: Engine, image: str, target: Target, checks: Sequence[Check], cache: Path) -> Startup:
    """``checks`` predicted in ``image`` of Spark ``target``, a GB10 faked with its build base's stub
    driver, each check's model provided as verify provides it; logged, and raising where a check fails.
    A check whose start-up cannot be predicted (``unpredictable``) is left out, said."""
    predictable = []
    for check in checks:
        if why := unpredictable(check):
            log.info(f"check {check.name}: start-up not predicted: {why}")
        else:
            predictable.append(check)
    checks = predictable
    models = {c.name: checkmodel.provide(cache, c) for c in checks}
    with tempfile.TemporaryDirectory() as tmp:
        stub = engine.copy_out(plan.base_name(target.base, target.platform), STUB, Path(tmp))
        found = predict(engine, image, checks, models, gb10_stub=stub, cache=cache)
    log.info(found.text())
    return found


def read(image: str, out: str, checks: Sequence[Check], *, faked: str | None) -> Startup:
    """The probe's output judged: per check, the gate over the lines vLLM logged."""
    found: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    by_name = {c.name: c for c in checks}
    predictions = []
    for case in found["cases"]:
        check = by_name[case["name"]]
        # Only a model vLLM built has a kernel path to judge; a refusal is judged as itself.
        logged = "\n".join(case["log"])
        unverified_ok = check.accept_unverified_kernel_patterns
        done = case["stage"] == "done"
        kernels = kernelpath.gate(check.expected_kernels, logged, found["vllm"], accept_unverified=unverified_ok) if done else []
        predictions.append(
            Prediction(
                check=check.name,
                args=tuple(case["args"]),
                stage=case["stage"],
                error=case.get("error"),
                values=case.get("values", {}),
                layers=tuple(case.get("layers", ())),
                kernels=tuple(kernels),
                log=tuple(case["log"]),
            )
        )
    return Startup(image=image, vllm=found["vllm"], platform=found["platform"], faked=faked, predictions=tuple(predictions))


def mispredicted(found: Startup, served: Mapping[str, VerifyResult]) -> list[str]:
    """Where a server chose otherwise than its prediction (``served``: each check's verify result,
    with the kernels its log shows): the prediction was wrong, and the report says so."""
    lines = []
    for prediction in found.predictions:
        result = served.get(prediction.check)
        if result is None or prediction.error is not None:
            continue
        predicted = {c.kind: sorted(b for b, _ in c.found) for c in prediction.kernels}
        for chosen in result.kernels:
            was, got = predicted.get(chosen.kind), sorted(b for b, _ in chosen.found)
            if was is not None and was != got:
                lines.append(
                    f"check {prediction.check}: {chosen.kind}: predicted {'/'.join(was) or 'nothing'}, the server chose "
                    f"{'/'.join(got) or 'nothing'}: the start-up prediction ({found.faked or found.platform}) was wrong here"
                )
    return lines
