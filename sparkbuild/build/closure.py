"""The runtime image's dependency closure, resolved for the platform the image runs on (aarch64 for a
Spark) without emulation: every wheel the runtime stage installs must exist for that platform and
the image's Python, and torch must resolve to the CUDA build the target asks for.

The requirements are the runtime stage's own: torch, vLLM's ``install_requires`` (setup.py's
``get_requirements()`` run on the source tree, torch's companion pins included), the CUDA JIT
toolkit and the runtime extras. They are resolved by uv (``uv pip compile --python-platform
aarch64-manylinux_2_X --python-version 3.Y --only-binary :all:``): unlike pip's ``--platform``, uv
evaluates environment markers for the target platform, so torch's ``platform_machine`` markers
pick the right CUDA libraries. Its requirements file names each package's requirement chain
(``# via``); a missing wheel is named with uv's own explanation.

The local image (vLLM's CPU wheel on torch's CPU build) is resolved the same way for its platform
(``check_local``): on an x86_64 host the arm64 variant is proved as far as the indexes this host
reaches allow, and what could not be checked is said, never passed (verdict ``partial``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sparkbuild.config.options import Options, defaults
from sparkbuild.errors import BuildError, ConfigError, ToolMissingError
from sparkbuild.image import vllm_setup
from sparkbuild.plan import plan
from sparkbuild.plan.matrix import Target
from sparkbuild.util import cmd, log

# partial: every wheel but those named in ``unchecked`` resolved; those could not be checked from here.
Verdict = Literal["ok", "failed", "unreachable", "partial"]
MACHINE = {"linux/arm64": "aarch64", "linux/amd64": "x86_64"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
# torch's CUDA runtime wheel names the CUDA version it was built for.
_CUDA_RUNTIME = re.compile(r"^nvidia-cuda-runtime(?:-cu\d+)?$")


@dataclass(frozen=True, kw_only=True)
class Package:
    name: str
    version: str
    via: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Closure:
    target: str
    platform: str
    python: str
    requirements: tuple[str, ...]
    verdict: Verdict
    packages: tuple[Package, ...] = ()
    problems: tuple[str, ...] = ()
    relaxed: tuple[str, ...] = ()
    seconds: float = 0.0
    torch_cuda: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # What the verdict does not cover, each with why (``partial``): torch's CPU build where its index
    # does not answer from here.
    unchecked: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def _torch(self) -> str:
        return f"torch CUDA {self.torch_cuda}" if self.torch_cuda else "torch CPU"

    def cell(self) -> str:
        if self.verdict == "ok":
            return f"{len(self.packages)} wheels for {self.platform} py{self.python}, {self._torch()}"
        if self.verdict == "partial":
            return f"partial: {len(self.packages)} wheels for {self.platform} py{self.python}; NOT CHECKED: {self.unchecked[0]}"
        return f"{self.verdict}: {self.problems[0] if self.problems else ''}"

    def text(self) -> str:
        lines = [f"closure of {self.target} for {self.platform}, Python {self.python}: {self.verdict} ({self.seconds:.0f}s)"]
        if self.relaxed:
            lines.append(f"  RELAXED for this machine's package index: {', '.join(self.relaxed)}")
        if self.ok:
            build = f"the CUDA {self.torch_cuda} build" if self.torch_cuda else "the CPU build"
            lines.append(f"  {len(self.packages)} packages, every one a wheel for the platform; torch is {build}")
        if self.verdict == "partial":
            lines.append(
                f"  PROVED: {len(self.packages)} packages, every one a wheel for {self.platform} and Python {self.python}"
            )
            lines += [f"  NOT CHECKED: {u}" for u in self.unchecked]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "platform": self.platform,
            "python": self.python,
            "verdict": self.verdict,
            "torch_cuda": self.torch_cuda,
            "problems": list(self.problems),
            "unchecked": list(self.unchecked),
            "relaxed": list(self.relaxed),
            "packages": [{"name": p.name, "version": p.version, "via": list(p.via)} for p in self.packages],
            "requirements": list(self.requirements),
            "seconds": round(self.seconds, 1),
        }


def requirements(target: Target, tree: Path) -> tuple[str, ...]:
    """What the runtime stage installs besides the wheels built here (vLLM, FlashInfer and Triton
    built from the tags vLLM pins ask for what those releases on PyPI ask for)."""
    if target.cuda is None:
        raise ConfigError(f"{target.where}: a closure is for a CUDA image; {target.id} has no 'cuda:'")
    spark: dict[str, Any] = defaults()["spark_runtime"]
    relaxed = set(target.relax)
    own = [
        r
        for r in vllm_setup.requirements(tree, target.cuda) + vllm_setup.extras(tree, list(target.vllm_extras))
        if _name(r) not in relaxed
    ]
    jit = (
        (f"cuda-toolkit[{','.join(spark['jit_components'])}]=={target.cuda}.*",)
        if int(target.cuda.split(".")[0]) >= plan.JIT_WHEELS_FROM
        else ()  # CUDA 12: from NVIDIA's apt repository, not PyPI
    )
    return (f"torch=={target.torch}", *own, *sorted(relaxed), *jit, *target.runtime_extras)


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return match.group(1).lower().replace("_", "-") if match else ""


def check(target: Target, tree: Path, opts: Options) -> Closure:
    """Resolve the runtime closure of ``target`` for its own platform and Python (uv)."""
    python, glibc = _versions(target)
    wanted = requirements(target, tree)
    args, _ = plan.torch_source(target, opts)
    index = args.get("PIP_EXTRA_INDEX_URL")
    start = time.monotonic()
    done = _compile(wanted, target.platform, python, glibc, _index_flags(index=index))
    if done.returncode != 0:
        verdict: Verdict = "unreachable" if "error sending request" in done.stderr else "failed"
        packages: tuple[Package, ...] = ()
        cuda = None
        problems = _problems(done.stderr)
    else:
        packages = parse(done.stdout)
        cuda = torch_cuda(packages)
        problems = () if cuda == target.cuda else (_torch_problem(target, cuda),)
        verdict = "ok" if not problems else "failed"
    return Closure(
        target=target.id,
        platform=target.platform,
        python=python,
        requirements=wanted,
        verdict=verdict,
        packages=packages,
        problems=problems,
        relaxed=target.relax,
        seconds=time.monotonic() - start,
        torch_cuda=cuda,
    )


def check_local(target: Target, opts: Options) -> Closure:
    """Resolve the local image's runtime (torch's CPU build, then vLLM's CPU wheel on it, as the
    local stages install them) for the image's platform and Python.

    torch comes from where the build takes it (``plan.torch_source``): a wheel folder of this host
    that holds the platform's wheel, else PyTorch's CPU index. Where that index does not answer,
    everything else is still resolved (on a stand-in for torch, see ``_stand_in``) and the verdict
    is ``partial``: torch's CPU build and its own requirements are named as not checked."""
    python, glibc = _versions(target)
    wanted = (f"torch=={target.torch}", target.vllm.spec)
    args, wheels = plan.torch_source(target, opts)
    index = args.get("PIP_EXTRA_INDEX_URL")
    flags = _index_flags(index=index, links=wheels[0].parent if wheels else None)
    start = time.monotonic()
    done = _compile(wanted, target.platform, python, glibc, flags)
    unchecked: tuple[str, ...] = ()
    if done.returncode != 0 and index and _unreachable(done.stderr, index):
        unchecked = (
            f"torch=={target.torch} and what it requires: its wheel is on {index}, which does not answer from here "
            "(`sparkbuild closure` checks it where it does)",
        )
        with tempfile.TemporaryDirectory() as links:
            _stand_in(Path(links), target.torch)
            done = _compile(wanted, target.platform, python, glibc, _index_flags(links=Path(links)))
    packages: tuple[Package, ...] = ()
    problems: tuple[str, ...] = ()
    if done.returncode != 0:
        verdict: Verdict = "unreachable" if "error sending request" in done.stderr else "failed"
        problems = _problems(done.stderr)
    elif unchecked:
        verdict = "partial"
        packages = tuple(p for p in parse(done.stdout) if p.name != "torch")
    else:
        packages = parse(done.stdout)
        torch = next((p.version for p in packages if p.name == "torch"), None)
        if torch != target.torch:
            problems = (f"torch resolved to {torch} for {target.platform}; the target asks for {target.torch} (torch_index:)",)
        verdict = "failed" if problems else "ok"
    return Closure(
        target=target.id,
        platform=target.platform,
        python=python,
        requirements=wanted,
        verdict=verdict,
        packages=packages,
        problems=problems,
        seconds=time.monotonic() - start,
        unchecked=unchecked,
    )


def _versions(target: Target) -> tuple[str, str]:
    """The runtime base's python3 and glibc: what its wheels must fit."""
    base = target.runtime_base
    if base.python is None or base.glibc is None:
        raise ConfigError(
            f"{target.where}: the runtime base '{base.name}' needs 'python:' and 'glibc:' in bases: "
            '(the versions its distribution ships, e.g. python: "3.12", glibc: "2.39" for Ubuntu 24.04)'
        )
    return base.python, base.glibc


def _index_flags(*, index: str | None = None, links: Path | None = None) -> list[str | Path]:
    """uv's flags for where torch is besides PyPI; every source is weighed as pip does."""
    flags: list[str | Path] = []
    if index:
        flags += ["--extra-index-url", index]
    if links is not None:
        flags += ["--find-links", links]
    return [*flags, "--index-strategy", "unsafe-best-match"] if flags else flags


# Resolutions that succeeded in this process, by their inputs: a rehearsal's targets often share one
# runtime (a target built from source and from the wheel, variants of one target), and each resolve
# asks PyPI again (about 10 s). Within one command the indexes are taken as unchanged.
_RESOLVED: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = {}


def _compile(
    wanted: tuple[str, ...], platform: str, python: str, glibc: str, flags: list[str | Path]
) -> subprocess.CompletedProcess[str]:
    """``uv pip compile`` of ``wanted`` for ``platform``; the requirements file comes back as stdout."""
    key = (*wanted, "|", platform, python, glibc, "|", *map(str, flags))
    if key in _RESOLVED:
        log.info(f"the same requirements for {platform} (Python {python}) were resolved earlier in this run: reusing it")
        return _RESOLVED[key]
    done = _uv_compile(wanted, platform, python, glibc, flags)
    if done.returncode == 0:
        _RESOLVED[key] = done
    return done


def _uv_compile(
    wanted: tuple[str, ...], platform: str, python: str, glibc: str, flags: list[str | Path]
) -> subprocess.CompletedProcess[str]:
    platform_name = f"{MACHINE[platform]}-manylinux_{glibc.replace('.', '_')}"
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "runtime-requirements.txt"
        req.write_text("\n".join(wanted) + "\n", encoding="utf-8")
        out = Path(tmp) / "closure.txt"
        uv_args: list[str | Path] = [
            _uv(), "pip", "compile", "--no-config", "--quiet", "--no-header", "--only-binary", ":all:",
            "--python-platform", platform_name, "--python-version", python, "--output-file", out, req, *flags,
        ]  # fmt: skip
        # One line per statement in uv's explanations, whatever the terminal's width.
        done = cmd.run(uv_args, capture=True, check=False, env={"COLUMNS": "10000", "NO_COLOR": "1"})
        text = out.read_text(encoding="utf-8") if out.is_file() else ""
    return subprocess.CompletedProcess(done.args, done.returncode, text, done.stderr)


def _unreachable(stderr: str, index: str) -> bool:
    """uv could not reach ``index`` (a connection or DNS failure on one of its URLs)."""
    return "error sending request" in stderr and index.rstrip("/") in stderr


def _stand_in(folder: Path, version: str) -> Path:
    """A wheel named ``torch`` ``version`` that requires nothing, for a resolve where torch's index
    does not answer: vLLM's exact pin (``torch==2.13.0+cpu``) and its companions' pins
    (``torchvision``'s ``torch==2.13.0``) resolve on it as on the real wheel, so every other wheel is
    the one the build installs. It is never installed, and torch with its own requirements is reported
    as not checked."""
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: sparkbuild\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def _uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        raise ToolMissingError("the dependency closure needs uv: pip install uv (a dependency of sparkbuild)") from None
    return str(find_uv_bin())


def parse(text: str) -> tuple[Package, ...]:
    """``name==version`` lines of a uv requirements file, each with the requirements it is there for."""
    found: list[Package] = []
    name = version = ""
    via: list[str] = []

    def flush() -> None:
        if name:
            found.append(Package(name=name, version=version, via=tuple(via)))

    for line in text.splitlines():
        if match := _PIN.match(line):
            flush()
            name, version, via = match.group(1).lower(), match.group(2), []
        elif line.strip().startswith("#"):
            entry = line.strip().lstrip("#").strip()
            entry = entry.removeprefix("via").strip()
            if entry and not entry.startswith("from "):
                via.append(entry)
    flush()
    return tuple(found)


def torch_cuda(packages: tuple[Package, ...]) -> str | None:
    """The CUDA version torch resolved to: its local version (``+cu129``), else the CUDA runtime wheel
    torch itself pulls in (through its own requirements, not the image's JIT toolkit); None for a
    CPU build."""
    torch = next((p for p in packages if p.name == "torch"), None)
    if torch is None:
        return None
    if match := re.search(r"\+cu(\d+)(\d)$", torch.version):
        return f"{match.group(1)}.{match.group(2)}"
    runtime = next((p for p in packages if _CUDA_RUNTIME.match(p.name) and p.name in requires(packages, "torch")), None)
    return ".".join(runtime.version.split(".")[:2]) if runtime else None


def requires(packages: tuple[Package, ...], name: str) -> set[str]:
    """Every package ``name`` brings in, directly or not (the ``via`` links, followed backwards)."""
    found: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        for p in packages:
            if current in p.via and p.name not in found:
                found.add(p.name)
                todo.append(p.name)
    return found


def _torch_problem(target: Target, found: str | None) -> str:
    build = "a CPU build" if found is None else f"the CUDA {found} build"
    return (
        f"torch=={target.torch} resolves to {build} for {target.platform}; the target asks for CUDA {target.cuda}. "
        "Name a torch whose wheel for this platform is a CUDA build (torch_index: the PyTorch index of that CUDA)"
    )


def _problems(stderr: str) -> tuple[str, ...]:
    """uv's explanation: the failing requirement with its chain ("Because A depends on B and B has no wheels...")."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    kept = [
        line.removeprefix("cause:").strip()
        for line in lines
        if line.startswith(("cause:", "hint:", "error:")) or "Because" in line
    ]
    return tuple(dict.fromkeys(kept or lines[-5:]))


def require(found: Closure) -> None:
    if found.ok:
        return
    what = "cannot be installed" if found.verdict == "failed" else "cannot be checked here"
    why = found.problems if found.verdict != "partial" else tuple(f"not checked: {u}" for u in found.unchecked)
    raise BuildError(f"the runtime of {found.target} {what} for {found.platform}, Python {found.python}: {'; '.join(why)}")


def log_closure(found: Closure) -> None:
    (log.info if found.ok else log.warning)(found.text())
