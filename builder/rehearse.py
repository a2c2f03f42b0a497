"""``sparkbuild rehearse``: build a Spark target's stages here, for real, in minutes instead of hours.

The Spark templates themselves are rendered for this machine's platform on bases made here (the
matrix's ``rehearsal: bases:`` maps each NVIDIA image to a ``cuda_wheels`` base) and built with
BuildKit: the source stage (pinned commits from a git remote, the real patch engine), FlashInfer
(its real wheel; no AOT module), vLLM, and the runtime stage with its real requirements and image
checks. One thing alone is swapped: vLLM's kernel compile. In its place the vLLM stage runs the
preflight (vLLM's own configure, audited for the target GPU, and the patched units compiled and
checked), then builds a Python-only vLLM wheel so the runtime stage runs for real.

What only the runner proves: the full kernel compile, the binary check of the compiled
extensions, FlashInfer's AOT modules and cubin download, and serving on the GPU.

``--offline`` takes every source from PyPI or makes a marked stand-in (``builder.offline``) and
serves them from a local git daemon: the rehearsal then needs no GitHub at all.
"""

from __future__ import annotations

import json
import platform as host
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import requests

from builder import build, closure, gitrepo, log, offline, plan, preflight, sources
from builder.engine import Engine
from builder.errors import ConfigError, FatalError, SourceError
from builder.matrix import Base, Matrix, Target
from builder.options import Options

REPOSITORY = "sparkbuild/rehearsal"


def build_platform() -> str:
    """The platform this machine builds natively: no emulation."""
    return {"x86_64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}.get(host.machine(), "linux/amd64")


def rehearsal_target(target: Target, m: Matrix) -> Target:
    """``target`` as the rehearsal builds it: this platform, bases made here, vLLM's compile swapped."""

    def swap(base: Base) -> Base:
        if base.image is None:
            return base  # made here already
        if base.name not in m.rehearsal.bases:
            raise ConfigError(
                f"{m.file}: rehearsal: bases: has no stand-in for '{base.name}' ({base.image}), which "
                f"{target.id} uses; map it to a base made here, e.g. `{base.name}: trixie-cuda-13.0-devel`"
            )
        return m.rehearsal.bases[base.name]

    return replace(
        target,
        platform=m.rehearsal.platform or build_platform(),
        base=swap(target.base),
        source_base=swap(target.source_base),
        runtime_base=swap(target.runtime_base),
        ptxas_base=swap(target.ptxas_base),
        compile="rehearse",
        relax=m.rehearsal.relax,
        repository=REPOSITORY,
    )


@dataclass
class Rehearsal:
    target: str
    status: str = "pending"
    image: str | None = None
    stages: tuple[build.StageOutcome, ...] = ()
    closure: closure.Closure | None = None
    preflight: preflight.Report | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    sources: str = ""
    relaxed: tuple[str, ...] = ()
    error: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "status": self.status,
            "image": self.image,
            "stages": [s.to_json() for s in self.stages],
            "closure": self.closure.to_json() if self.closure else None,
            "preflight": self.preflight.to_json() if self.preflight else None,
            "checks": self.checks,
            "sources": self.sources,
            "relaxed": list(self.relaxed),
            "error": self.error,
            "seconds": round(self.seconds, 1),
        }


def rehearse(opts: Options, *, offline_sources: bool) -> list[Rehearsal]:
    """Rehearse every selected Spark target; every target is tried, failures are reported per target."""
    m = plan.load_matrix(opts)
    targets = plan.select(tuple(t for t in m.targets if t.profile == "spark" and t.vllm.kind != "candidate"), opts.only, None)
    results = [Rehearsal(target=t.id) for t in targets]
    engine = Engine()
    with ExitStack() as stack:
        url = stack.enter_context(gitrepo.daemon(opts.cache / "offline")) if offline_sources else None
        for target, result in zip(targets, results, strict=True):
            with log.step(f"Rehearsing {target.id}"):
                _one(engine, m, target, opts, url, result)
    return results


def _one(engine: Engine, m: Matrix, target: Target, opts: Options, url: str | None, result: Rehearsal) -> None:
    start = time.monotonic()
    try:
        rehearsed = rehearsal_target(target, m)
        result.relaxed = rehearsed.relax
        if url is not None:
            found = offline.prepare(rehearsed, opts.cache)
            result.sources = offline.describe(found)
            log.info(result.sources)
            rehearsed = found.apply(rehearsed)
        _require_torch_index(rehearsed)
        # The closure of the image as the runner builds it (its platform and runtime base), with
        # this machine's relaxed pins.
        result.status = "closure"
        tree = sources.vllm_sdist(target.vllm.version, opts.cache)
        result.closure = closure.check(replace(target, relax=rehearsed.relax), tree, opts)
        closure.log_closure(result.closure)
        closure.require(result.closure)
        p = plan.plan_target(rehearsed, m.patch_folders, opts)
        if url is not None:
            # The daemon's address: where the source stages fetch from, not part of any hash.
            p = replace(p, source_args={**p.source_args, "SPARKBUILD_GIT_INSTEADOF": f"{url}/={offline.URL}/"})
        result.status = "preflight"
        result.preflight = build.run_preflight(engine, p, opts)
        result.preflight.require()
        result.status = "building"
        outcome = build.build(engine, p, opts, check_first=False)
        result.image, result.stages = outcome.image, outcome.stages
        result.checks = _image_checks(engine, outcome.image)
        result.status = "rehearsed"
    except FatalError as exc:
        result.status, result.error = f"failed ({result.status})", str(exc)
        log.error(f"{target.id}: {exc}")
    finally:
        result.seconds = time.monotonic() - start


def _require_torch_index(target: Target) -> None:
    """A rehearsal installs torch for real: say at once when its index cannot be reached from here."""
    args, _ = plan.torch_source(target, Options.from_env())
    index = args.get("PIP_EXTRA_INDEX_URL")
    if not index:
        return
    try:
        requests.head(index.rstrip("/") + "/torch/", timeout=10, allow_redirects=True)
    except requests.RequestException as exc:
        raise SourceError(
            f"{target.id} installs torch {target.torch} from {index}, which this machine cannot reach ({type(exc).__name__}); "
            "rehearse it where that index answers, or give the target a torch that PyPI serves (torch_index: pypi)"
        ) from None


def _image_checks(engine: Engine, image: str) -> dict[str, Any]:
    """What the runtime stage's image check found (it fails the build on any problem)."""
    with tempfile.TemporaryDirectory() as tmp:
        found = engine.copy_out(image, "/opt/sparkbuild/installed.json", Path(tmp))
        data: dict[str, Any] = json.loads(found.read_text(encoding="utf-8"))
    return data


def table(results: list[Rehearsal]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.target}: {r.status} in {log.format_seconds(r.seconds)}")
        if r.sources:
            lines += ["  " + line for line in r.sources.splitlines()]
        if r.relaxed:
            lines.append(f"  RELAXED for this machine's package index (the runner installs vLLM's pins): {', '.join(r.relaxed)}")
        if r.stages:
            lines.append("  stages: " + ", ".join(f"{s.name} {s.action} ({s.seconds:.0f}s)" for s in r.stages))
        if r.closure:
            lines += ["  " + line for line in r.closure.text().splitlines()]
        if r.preflight:
            lines += ["  " + line for line in r.preflight.text().splitlines()]
        if r.checks:
            lines.append("  image checks: " + ", ".join(f"{k} ok" for k in r.checks if k != "vllm_path"))
        if r.error:
            lines.append(f"  error: {r.error}")
    return "\n".join(lines)
