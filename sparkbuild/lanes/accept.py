"""``sparkbuild accept``: what a runner owner runs on a new Spark, and attaches to an issue.

One target, built (closure and preflight first, the binary check after), verified on the GPU with
its known answers and speed, and written up as ``accept.json`` and ``accept.md`` in
``sparkbuild-out/<target>/``: versions, commits, the audit, the binary check, the answers, the
speed, each step's time and the image's size. Every step runs that can (a failed build leaves no
image to verify); the report is always written and says which step failed and why.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbuild import __version__
from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError, FatalError
from sparkbuild.lanes import doctor, pipeline
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from sparkbuild.util import log
from sparkbuild.verify import verify


@dataclass
class Step:
    name: str
    ok: bool | None = None  # None: not run
    seconds: float = 0.0
    detail: str = ""
    # What failed it; the command exits with its code once the report is written.
    error: FatalError | None = None


@dataclass
class Acceptance:
    target: str
    steps: list[Step] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "ok": self.ok,
            "steps": [{"name": s.name, "ok": s.ok, "seconds": round(s.seconds, 1), "detail": s.detail} for s in self.steps],
            **self.facts,
        }

    def markdown(self) -> str:
        facts = self.facts
        lines = [f"## sparkbuild accept: {self.target}: {'PASSED' if self.ok else 'FAILED'}", ""]
        lines += ["| | |", "|---|---|"]
        for key in (
            "machine",
            "sparkbuild",
            "image",
            "image_size_gb",
            "vllm",
            "vllm_commit",
            "vllm_from",
            "torch",
            "cuda",
            "arch_list",
            "gpu",
        ):
            if key in facts:
                lines.append(f"| {key} | {facts[key]} |")
        lines += ["", "| step | result | time | detail |", "|---|---|---|---|"]
        for s in self.steps:
            result = {True: "ok", False: "FAILED", None: "not run"}[s.ok]
            lines.append(
                f"| {s.name} | {result} | {log.format_seconds(s.seconds)} | {s.detail.splitlines()[0] if s.detail else ''} |"
            )
        for key, title in (
            ("preflight", "Preflight audit"),
            ("check_binary", "Binary check"),
            ("checks", "Answers, kernel paths and speed"),
        ):
            if facts.get(key):
                body = facts[key] if isinstance(facts[key], str) else json.dumps(facts[key], indent=2)
                lines += ["", f"### {title}", "", "```", body, "```"]
        return "\n".join(lines) + "\n"


def accept(opts: Options) -> Acceptance:
    plans = plan.make(opts)
    if len(plans) != 1:
        raise ConfigError(f"accept takes one target; --only matches {len(plans)}: {', '.join(p.id for p in plans)}")
    (p,) = plans
    result = Acceptance(target=p.id)
    result.facts |= {
        "machine": f"{platform.node()} ({platform.machine()})",
        "sparkbuild": __version__,
        "vllm": p.target.version,
        "vllm_commit": p.target.vllm.commit or p.target.vllm.spec,
        "torch": p.target.torch,
        "cuda": p.target.cuda or "none",
        "arch_list": p.target.arch_list if p.target.cuda else "none",
        "gpu": p.target.gpu if p.target.cuda else "none",
        "content_tag": p.content_tag,
    }
    if p.choice is not None:
        result.facts["vllm_from"] = p.choice.text()
    doctor.require([p.target], opts, registry=False)
    engine = Engine()
    out = opts.out / p.id
    built = _step(result, "build", lambda: _build(engine, p, opts, result))
    if built:
        _step(result, "verify", lambda: _verify(engine, p, opts, result))
    else:
        result.steps.append(Step("verify", detail="no image: the build failed"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "accept.json").write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    (out / "accept.md").write_text(result.markdown(), encoding="utf-8")
    log.step_summary(result.markdown())
    return result


def _step(result: Acceptance, name: str, work: Callable[[], str]) -> bool:
    step = Step(name)
    result.steps.append(step)
    start = time.monotonic()
    try:
        with log.step(f"accept: {name}"):
            step.detail = work()
        step.ok = True
    except FatalError as exc:
        step.ok, step.detail, step.error = False, str(exc), exc
    finally:
        step.seconds = time.monotonic() - start
    return bool(step.ok)


def _build(engine: Engine, p: plan.TargetPlan, opts: Options, result: Acceptance) -> str:
    try:
        outcome = build.build(engine, p, opts)
    finally:
        folder = opts.out / p.id
        if (folder / "preflight" / "audit.txt").is_file():
            result.facts["preflight"] = (folder / "preflight" / "audit.txt").read_text(encoding="utf-8")
        if (folder / "check-binary.txt").is_file():
            result.facts["check_binary"] = (folder / "check-binary.txt").read_text(encoding="utf-8")
    image = engine.inspect(outcome.image)
    result.facts |= {"image": outcome.image, "image_size_gb": round(int(image["Size"]) / 1e9, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        installed = json.loads(engine.copy_out(outcome.image, "/opt/sparkbuild/installed.json", Path(tmp)).read_text())
    result.facts["installed"] = installed
    return outcome.summary()


def _verify(engine: Engine, p: plan.TargetPlan, opts: Options, result: Acceptance) -> str:
    gpus = p.target.profile == "spark"
    found = verify.verify_all(
        engine, result.facts["image"], p.target.checks, opts.out / p.id / "verify.json", cache=opts.cache, gpus=gpus
    )
    # Every check's result in order, the benchmarked one first.
    result.facts["checks"] = [found.results[name].to_json() for name in found.checks if name in found.results]
    found.require()
    return pipeline.verified_cell(found)
