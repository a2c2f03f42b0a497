"""Preflight: what a Spark build will compile, proven before the long compile starts.

The vLLM stage's ``preflight`` target (``dockerfiles/spark/preflight.py``, in the build container)
runs vLLM's own CMake configure for the target's arch list and compiles the units the patch set
changed. Here, on the host, sparkbuild reads what it exported:

- the audit: every CUDA translation unit of ``compile_commands.json`` with the code it will get
  (``-gencode`` / ``--generate-code``), judged by check-binary's rule for the target's GPU
  (``gpu:``, the Spark's 12.1): a unit with no code that runs there fails, named; PTX-only units
  are listed apart (the driver JIT-compiles them on first load). A library none of whose units
  gets any code target is one the project builds for other GPUs only (flash-attention's FA3 for
  9.0a: its arch list intersects to nothing for 12.1a): listed apart as compiled for nothing, not
  a failure (the ``fa3-hopper-only`` patch keeps FA3 out of a build without 9.x); a unit without
  code in a library whose other units have code still fails. A unit that no extension vLLM's
  ``setup.py`` builds needs (``not_built``, by ninja's closure of its targets) is listed as
  configured and not built, and judged no further: the compile never runs it;
- the patched units: each must compile, and its object must carry code for the GPU (cuobjdump),
  kernel by kernel (check-binary's rule: no kernel with code for the GPU's family that cannot run).

A failure stops the target before the compile; the report goes to the summary and to
``sparkbuild-out/<target>/preflight/``.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from sparkbuild.build import binaries
from sparkbuild.build.binaries import Arch, Code
from sparkbuild.errors import BuildError
from sparkbuild.util import log

_GENCODE = re.compile(r"arch=compute_(\w+?),code=\[?([\w,]+)\]?")
_ARCH = re.compile(r"^(\d+?)(\d)([af]?)$")
_LIBRARY = re.compile(r"CMakeFiles/([^/]+)\.dir/")
Verdict = Literal["sass", "ptx-only", "none", "other-gpu", "not-built"]
# flash-attention's FA3 library: sm_90a kernels only (the fa3-hopper-only patch keeps it out of other builds).
FA3_LIBRARY = "_vllm_fa3_C"
# What nvcc compiles: a patch that changes one of these must have a unit compiled that holds it.
CUDA_SOURCES = (".cu", ".cuh")


def _arch(text: str) -> Arch:
    match = _ARCH.match(text)
    if match is None:
        raise BuildError(f"preflight: cannot read the arch '{text}' in a -gencode flag")
    return Arch(major=int(match[1]), minor=int(match[2]), suffix=match[3])


def gencodes(command: str) -> tuple[Code, ...]:
    """Every code target of an nvcc command line: ``sm_XX`` cubins and ``compute_XX`` PTX."""
    codes: list[Code] = []
    for _, targets in _GENCODE.findall(command):
        for target in targets.split(","):
            kind, _, arch = target.partition("_")
            if kind in ("sm", "compute"):
                codes.append(Code(kind="sass" if kind == "sm" else "ptx", arch=_arch(arch), name=target))
    return tuple(dict.fromkeys(codes))


@dataclass(frozen=True, kw_only=True)
class Unit:
    file: str
    library: str
    codes: tuple[Code, ...]
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "library": self.library, "codes": [c.label() for c in self.codes], "verdict": self.verdict}


def judge(codes: tuple[Code, ...], device: Arch) -> Verdict:
    if any(c.kind == "sass" and c.runs_on(device) for c in codes):
        return "sass"
    if any(c.kind == "ptx" and c.runs_on(device) for c in codes):
        return "ptx-only"
    return "none"


def audit(commands: list[dict[str, Any]], device: Arch, source: str, not_built: frozenset[str] = frozenset()) -> tuple[Unit, ...]:
    """Every CUDA unit of a ``compile_commands.json`` with its codes and verdict, by file name; a unit
    in ``not_built`` (no target vLLM's setup.py builds needs it) is listed as such and judged no further."""
    units = []
    for entry in commands:
        if not entry["file"].endswith(".cu"):
            continue
        command = shlex.join(entry["arguments"]) if "arguments" in entry else entry["command"]
        codes = gencodes(command)
        library = _LIBRARY.search(entry.get("output", "") or command)
        units.append(
            Unit(
                file=entry["file"].removeprefix(source.rstrip("/") + "/"),
                library=library[1] if library else "?",
                codes=codes,
                verdict="not-built" if entry["file"] in not_built else judge(codes, device),
            )
        )
    return tuple(sorted(_other_gpu(units), key=lambda u: u.file))


def _other_gpu(units: list[Unit]) -> list[Unit]:
    """Units of a library that gets no code target at all: built for other GPUs only (their arch
    list intersects to nothing with this one), so compiled for nothing here, not a defect."""
    coded = {u.library for u in units if u.codes}
    return [
        replace(u, verdict="other-gpu") if u.library not in coded and u.library != "?" and u.verdict != "not-built" else u
        for u in units
    ]


@dataclass(frozen=True, kw_only=True)
class Compiled:
    file: str
    ok: bool
    seconds: float
    codes: tuple[Code, ...] = ()
    runs: bool | None = None
    error: str = ""
    # The files the patch set changed that this unit is or includes.
    reaches: tuple[str, ...] = ()
    # The largest compiler process of this unit's compile, MB (a ccache hit: ccache's own).
    peak_rss_mb: int = 0
    # Compiled to be measured (SPARKBUILD_PREFLIGHT_MEASURE), not because a patch reaches it.
    measured: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "ok": self.ok,
            "seconds": self.seconds,
            "peak_rss_mb": self.peak_rss_mb,
            "measured": self.measured,
            "codes": [c.label() for c in self.codes],
            "runs_on_device": self.runs,
            "error": self.error,
            "reaches": list(self.reaches),
        }


@dataclass(frozen=True, kw_only=True)
class Report:
    target: str
    device: Arch
    units: tuple[Unit, ...]
    compiled: tuple[Compiled, ...]
    stubbed: tuple[str, ...]
    changed_files: tuple[str, ...]
    configure_seconds: float
    compile_seconds: float
    # The largest compiler process of the patched units' compiles, MB (0: every one a ccache hit).
    peak_rss_mb: int = 0

    @property
    def failing_units(self) -> tuple[Unit, ...]:
        return tuple(u for u in self.units if u.verdict == "none")

    @property
    def failing_compiles(self) -> tuple[Compiled, ...]:
        return tuple(c for c in self.compiled if not c.ok or c.runs is False)

    @property
    def uncompiled_changes(self) -> tuple[str, ...]:
        """CUDA sources the patch set changed that no compiled unit is or includes: a patched
        kernel this build never compiles was not proven here, and does nothing in the image."""
        reached = {f for c in self.compiled for f in c.reaches}
        return tuple(f for f in self.changed_files if f.endswith(CUDA_SOURCES) and f not in reached)

    @property
    def ok(self) -> bool:
        return bool(self.units) and not self.failing_units and not self.failing_compiles and not self.uncompiled_changes

    def counts(self) -> dict[Verdict, int]:
        return {v: sum(u.verdict == v for u in self.units) for v in get_args(Verdict)}

    def by_library(self, verdict: Verdict) -> dict[str, int]:
        """How many units of each library have ``verdict``."""
        return dict(sorted(Counter(u.library for u in self.units if u.verdict == verdict).items()))

    def cell(self) -> str:
        """One summary-table cell: units, code targets, problems, seconds."""
        c = self.counts()
        text = f"{len(self.units)} units: {c['sass']} sass, {c['ptx-only']} ptx-only, {c['none']} none"
        if c["other-gpu"]:
            text += f", {c['other-gpu']} for other GPUs"
        if c["not-built"]:
            text += f", {c['not-built']} not built"
        patched = [c for c in self.compiled if not c.measured]
        text += f"; {sum(c not in self.failing_compiles for c in patched)}/{len(patched)} patched ok"
        if len(patched) < len(self.compiled):
            text += f"; {len(self.compiled) - len(patched)} measured"
        if self.uncompiled_changes:
            text += f"; {len(self.uncompiled_changes)} patched CUDA file(s) compiled by no unit"
        if self.stubbed:
            text += f"; {len(self.stubbed)} stubbed"
        return text + f"; {self.configure_seconds + self.compile_seconds:.0f}s"

    def text(self) -> str:
        lines = [f"preflight of {self.target} for sm_{self.device.major}{self.device.minor}{self.device.suffix}: {self.cell()}"]
        by_codes: dict[str, int] = {}
        for u in self.units:
            key = ", ".join(c.label() for c in u.codes) or "(no -gencode)"
            by_codes[key] = by_codes.get(key, 0) + 1
        lines += [f"  {n:4d} unit(s) get {key}" for key, n in sorted(by_codes.items(), key=lambda kv: -kv[1])]
        for u in self.units:
            listed = ", ".join(c.label() for c in u.codes) or "none"
            if u.verdict == "ptx-only":
                lines.append(f"  ptx-only (JIT on first load): {u.file} [{listed}]")
            elif u.verdict == "none":
                lines.append(f"  NO CODE FOR THIS GPU: {u.file} [{listed}]")
        for library, n in self.by_library("other-gpu").items():
            lines.append(
                f"  {library}: {n} unit(s) built for other GPUs only (no code target for this arch list): "
                "compiled for nothing here" + (" (fa3-hopper-only leaves FA3 out)" if library == FA3_LIBRARY else "")
            )
        for library, n in self.by_library("not-built").items():
            lines.append(f"  {library}: {n} unit(s) configured, not built (no extension vLLM's setup.py builds needs them)")
        for c in self.compiled:
            state = "ok" if c.ok and c.runs is not False else "FAILED"
            memory = f", {c.peak_rss_mb} MB" if c.peak_rss_mb else ""
            kind = "measured" if c.measured else "patched"
            lines.append(f"  {kind} unit {state}: {c.file} ({c.seconds:.0f}s{memory}) [{', '.join(x.label() for x in c.codes)}]")
            if c.error:
                lines.append("    " + c.error.strip().splitlines()[-1][:300])
        for f in self.uncompiled_changes:
            lines.append(f"  PATCHED BUT COMPILED BY NO UNIT: {f}")
        if self.peak_rss_mb:
            lines.append(f"  largest compiler process: {self.peak_rss_mb} MB")
        if self.stubbed:
            lines.append(f"  stubbed external projects (their units are stand-ins): {', '.join(self.stubbed)}")
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """What a lane's summary.json keeps: the verdict, the counts and every failing unit."""
        return {
            "ok": self.ok,
            "cell": self.cell(),
            "counts": self.counts(),
            "failing_units": [u.to_json() for u in self.failing_units],
            "failing_compiles": [c.to_json() for c in self.failing_compiles],
            "uncompiled_changes": list(self.uncompiled_changes),
            "stubbed": list(self.stubbed),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "device": str(self.device),
            "ok": self.ok,
            "counts": self.counts(),
            "units": [u.to_json() for u in self.units],
            "compiled": [c.to_json() for c in self.compiled],
            "stubbed": list(self.stubbed),
            "changed_files": list(self.changed_files),
            "uncompiled_changes": list(self.uncompiled_changes),
            "configure_seconds": self.configure_seconds,
            "compile_seconds": self.compile_seconds,
            "peak_rss_mb": self.peak_rss_mb,
        }

    def require(self) -> None:
        if self.ok:
            return
        problems = [f"{u.file} ({', '.join(c.label() for c in u.codes) or 'no code'})" for u in self.failing_units]
        problems += [f"{c.file} ({'does not compile' if not c.ok else 'no code for the GPU'})" for c in self.failing_compiles]
        if not self.units:
            problems.append("the configure listed no CUDA unit")
        said = [f"{len(problems)} unit(s) cannot serve sm_{self.device.major}{self.device.minor}: {'; '.join(problems)}"]
        said = said if problems else []
        if self.uncompiled_changes:
            said.append(
                f"the patch set changes {', '.join(self.uncompiled_changes)}, and no unit this configure compiles is or "
                "includes it: the patched code would not be in the image, and nothing here proved it builds"
            )
        raise BuildError(
            f"preflight of {self.target} failed before the compile: {'; '.join(said)}. Check the arch list and the "
            "patch set (cmake-arch-sm121 widens vLLM's arch lists, e2m1-software the FP4 conversion; a patch this "
            "target does not compile is not needed here: see `sparkbuild patch table`)"
        )


def read(folder: Path, target: str, gpu: str) -> Report:
    """The report of what a preflight-report build exported into ``folder``, judged for ``gpu``."""
    data = json.loads((folder / "preflight.json").read_text(encoding="utf-8"))
    commands = json.loads((folder / "compile_commands.json").read_text(encoding="utf-8"))
    device = Arch.parse(gpu)
    compiled = []
    for entry in data["compiled"]:
        codes: tuple[Code, ...] = ()
        runs: bool | None = None
        if entry["ok"] and entry.get("object"):
            report = binaries.check_file(folder / entry["object"], device)
            # No kernel of a patched unit may fail, and one must run on the GPU, unless the unit has
            # none (host code beside __device__ helpers: nvfp4_quant_entry.cu).
            codes, runs = report.codes, None if report.ok is None else bool(report.ok and (report.runs or not report.kernels))
        compiled.append(
            Compiled(
                file=entry["file"].removeprefix(data["source"].rstrip("/") + "/"),
                ok=bool(entry["ok"]),
                seconds=float(entry.get("seconds", 0.0)),
                codes=codes,
                runs=runs,
                error=str(entry.get("error", "")),
                reaches=tuple(entry.get("reaches", ())),
                peak_rss_mb=int(entry.get("peak_rss_mb", 0)),
                measured=bool(entry.get("measured", False)),
            )
        )
    return Report(
        target=target,
        device=device,
        units=audit(commands, device, data["source"], frozenset(data.get("not_built", ()))),
        compiled=tuple(compiled),
        stubbed=tuple(data.get("stubbed", ())),
        changed_files=tuple(data.get("changed_files", ())),
        configure_seconds=float(data.get("configure_seconds", 0.0)),
        compile_seconds=float(data.get("compile_seconds", 0.0)),
        peak_rss_mb=int(data.get("peak_rss_mb", 0)),
    )


def save(report: Report, folder: Path) -> None:
    (folder / "audit.json").write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    (folder / "audit.txt").write_text(report.text() + "\n", encoding="utf-8")
    log.info(report.text())
