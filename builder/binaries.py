"""check-binary: which GPU code a CUDA object or shared library carries, and whether it runs on an arch.

``cuobjdump -lelf -lptx`` lists the cubins (SASS) and PTX in a file. A cubin runs on the asked
arch when it is for the same major and a minor not above it, except that an arch-specific cubin
(``sm_120a``) runs only on exactly that arch. cuobjdump prints a family cubin (``sm_120f``) as
``sm_120``: both run on every 12.x. PTX is JIT-compiled by the driver for the device it meets:
plain PTX runs on any later arch, a newer major included (``compute_80`` runs on sm_121), family
PTX within its major, arch-specific PTX only on its own arch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from builder import cmd, options
from builder.errors import BinaryCheckError, ConfigError, ToolMissingError

_LINE_RE = re.compile(r"^(ELF|PTX) file\s+\d+:\s+(?P<name>\S+)$")
_ARCH_RE = re.compile(r"\.sm_(?P<major>\d+?)(?P<minor>\d)(?P<suffix>[af]?)\.(cubin|ptx)$")
_ASKED_RE = re.compile(r"^(?P<major>\d+)\.(?P<minor>\d)(?P<suffix>[af]?)$")


@dataclass(frozen=True, kw_only=True, order=True)
class Arch:
    major: int
    minor: int
    suffix: str = ""

    @classmethod
    def parse(cls, text: str) -> Arch:
        match = _ASKED_RE.match(text.strip())
        if match is None:
            raise ConfigError(f"--arch '{text}' is not an arch like 12.1a, 12.0f or 12.1")
        return cls(major=int(match["major"]), minor=int(match["minor"]), suffix=match["suffix"])

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"


@dataclass(frozen=True, kw_only=True)
class Code:
    kind: Literal["sass", "ptx"]
    arch: Arch
    name: str

    def runs_on(self, device: Arch) -> bool:
        if self.kind == "ptx" and self.arch.suffix == "" and (self.arch.major, self.arch.minor) <= (device.major, device.minor):
            return True  # plain PTX: the driver JIT-compiles it for any later GPU
        if self.arch.major != device.major or self.arch.minor > device.minor:
            return False
        return self.arch.suffix != "a" or self.arch.minor == device.minor

    def label(self) -> str:
        prefix = "sm" if self.kind == "sass" else "compute"
        return f"{prefix}_{self.arch.major}{self.arch.minor}{self.arch.suffix}"


@dataclass(frozen=True, kw_only=True)
class FileReport:
    path: Path
    codes: tuple[Code, ...]
    # None: the file carries no GPU code at all (a plain host library).
    ok: bool | None
    # Same-major code that cannot run on the device: a sign that some kernels lack it.
    foreign: tuple[Code, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "codes": [c.label() for c in self.codes],
            "not_runnable": [c.label() for c in self.foreign],
        }


def cuobjdump() -> Path:
    """cuobjdump: SPARKBUILD_CUOBJDUMP, the PATH, or PyPI's nvidia-cuda-cuobjdump in this environment."""
    chosen = options.env("SPARKBUILD_CUOBJDUMP")
    if chosen:
        return Path(chosen)
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    spec = importlib.util.find_spec("nvidia")
    for folder in spec.submodule_search_locations or [] if spec else []:
        for candidate in sorted(Path(folder).glob("*/bin/cuobjdump")):
            return candidate
    raise ToolMissingError("check-binary needs cuobjdump: pip install nvidia-cuda-cuobjdump (or put CUDA's bin/ on PATH)")


def list_code(path: Path, tool: Path | None = None) -> tuple[Code, ...] | None:
    """The cubins and PTX in ``path``; None when it has no device code."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    args: list[str | os.PathLike[str]] = [tool or cuobjdump(), "-lelf", "-lptx", path]
    result = cmd.run(args, capture=True, check=False)
    if "does not contain device code" in result.stdout + result.stderr:
        return None
    if result.returncode != 0:
        raise BinaryCheckError(f"{cmd.show(args)} failed (exit {result.returncode}): {result.stderr.strip()}")
    codes = []
    for line in result.stdout.splitlines():
        match = _LINE_RE.match(line.strip())
        if match is None:
            continue
        arch = _ARCH_RE.search(match["name"])
        if arch is None:
            raise BinaryCheckError(f"{path}: cannot read the arch of '{match['name']}' in cuobjdump's listing")
        codes.append(
            Code(
                kind="sass" if line.startswith("ELF") else "ptx",
                arch=Arch(major=int(arch["major"]), minor=int(arch["minor"]), suffix=arch["suffix"]),
                name=match["name"],
            )
        )
    return tuple(codes)


def check_file(path: Path, device: Arch, tool: Path | None = None) -> FileReport:
    codes = list_code(path, tool)
    if codes is None:
        return FileReport(path=path, codes=(), ok=None)
    foreign = tuple(c for c in codes if c.arch.major == device.major and not c.runs_on(device))
    return FileReport(path=path, codes=codes, ok=any(c.runs_on(device) for c in codes), foreign=foreign)


def check(paths: list[Path], device: Arch) -> tuple[FileReport, ...]:
    """One report per file; folders are searched for ``*.so`` and ``*.o``."""
    tool = cuobjdump()
    files: list[Path] = []
    for path in paths:
        files += sorted(p for p in path.rglob("*") if p.suffix in (".so", ".o") and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"no files to check in {', '.join(map(str, paths))}")
    return tuple(check_file(f, device, tool) for f in files)


def table(reports: tuple[FileReport, ...], device: Arch) -> str:
    lines = [f"GPU code for sm_{device.major}{device.minor}{device.suffix}:"]
    for r in reports:
        verdict = {True: "ok", False: "NO CODE FOR THIS ARCH", None: "no device code"}[r.ok]
        listed = ", ".join(dict.fromkeys(c.label() for c in r.codes)) or "-"
        lines.append(f"  {verdict:<22} {r.path}  [{listed}]")
        if r.ok and r.foreign:
            cannot = ", ".join(dict.fromkeys(c.label() for c in r.foreign))
            lines.append(f"  {'':<22}   also {cannot}, which cannot run here: kernels built only for it are missing")
    return "\n".join(lines)


def require(reports: tuple[FileReport, ...], device: Arch) -> None:
    bad = [r for r in reports if r.ok is False]
    if bad:
        names = "; ".join(f"{r.path} ({', '.join(dict.fromkeys(c.label() for c in r.codes))})" for r in bad)
        raise BinaryCheckError(f"{len(bad)} file(s) have no GPU code that runs on sm_{device.major}{device.minor}: {names}")
