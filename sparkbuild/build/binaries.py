"""check-binary: which GPU code each kernel of a CUDA object, shared library or wheel carries, and
whether it runs on a GPU.

vLLM links every unit into a few libraries (``_C.abi3.so``), each unit compiled for its own arch
list, so a library can hold kernels built for the GPU beside kernels that are not. Each kernel
(``__global__`` function, by its mangled name) is therefore judged on its own, from the code the
library carries for it: its cubins (SASS) and its PTX.

Where the code comes from: ``cuobjdump -symbols`` prints every cubin's arch as nvcc wrote it
(``sm_120f``, ``sm_121a``; ``-lelf`` shows a family cubin as ``sm_120``) with its symbol table, whose
``FUNC ... ENTRY`` symbols are the kernels; PTX has no symbol table, so the ``.entry`` lines of
``cuobjdump -ptx`` name its kernels (streamed: vLLM's flash-attention library holds 650 MB of PTX).

A kernel's verdict for a GPU of compute capability X.Y (the DGX Spark's GB10: 12.1):

- ``sass``: a cubin of it runs there;
- ``ptx``: no cubin does, but PTX of it that the driver JIT-compiles there on first load;
- ``fails``: it has code for the GPU's family (major X: any sm_12x) but none that runs there, for
  example only ``sm_120a``: the mixed-arch build this check exists for. Named with its library;
- ``other``: its code is all for other GPUs (``sm_90a`` Hopper or ``sm_100a`` kernels). Listed as
  not for this GPU, not a failure: a wheel for many GPUs carries such kernels, and vLLM chooses its
  kernels by the GPU it meets.

The check fails on any ``fails`` kernel, and on a set of libraries where no kernel at all runs on
the GPU (a build for other GPUs only).

A kernel is known by its name within one library, and judged in each compilation unit that holds
it: a template kernel instantiated in two units is two kernels to the CUDA runtime, each launch site
running its own unit's instance (seen on an H100: the same ``tk<5>`` launched from an ``sm_90a``
unit ran, from an ``sm_100f`` unit of the same binary failed with "no kernel image is available").
It fails when one instance fails. cuobjdump does not say which unit a cubin came from; the
library's fatbin section does (one fatbin per unit), read by ``fatbin_entries``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sparkbuild.config import options
from sparkbuild.errors import BinaryCheckError, ConfigError, ToolMissingError
from sparkbuild.util import cmd

_BLOCK_RE = re.compile(r"^Fatbin (?P<kind>elf|ptx) code:$")
_HEADER_ARCH_RE = re.compile(r"^arch = sm_(?P<major>\d+?)(?P<minor>\d)(?P<suffix>[af]?)$")
_ENTRY_RE = re.compile(r"^\s*(?:\.(?:visible|weak|extern)\s+)*\.entry\s+(?P<name>[\w$.]+)")
_ASKED_RE = re.compile(r"^(?P<major>\d+)\.(?P<minor>\d)(?P<suffix>[af]?)$")
_LABEL_RE = re.compile(r"^(?P<prefix>sm|compute)_(?P<major>\d+?)(?P<minor>\d)(?P<suffix>[af]?)$")
_NO_DEVICE_CODE = "does not contain device code"
_FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
_FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
Verdict = Literal["sass", "ptx", "fails", "other"]
VERDICTS: tuple[Verdict, ...] = ("sass", "ptx", "other", "fails")


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

    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}"


@dataclass(frozen=True, kw_only=True, order=True)
class Code:
    kind: Literal["sass", "ptx"]
    arch: Arch
    name: str = ""

    def runs_on(self, device: Arch) -> bool:
        """Whether this code runs on a GPU of compute capability ``device`` (its suffix is ignored:
        a GPU has no suffix). NVIDIA's rules:

        - a cubin (SASS) for X.y runs on X.z for z >= y, never on another major ("Binary
          compatibility", CUDA Programming Guide 1.3 The CUDA platform,
          https://docs.nvidia.com/cuda/cuda-programming-guide/01-introduction/cuda-platform.html;
          "each cubin file targets a specific compute-capability version and is forward-compatible
          only with GPU architectures of the same major version number", Volta Compatibility Guide
          2, https://docs.nvidia.com/cuda/volta-compatibility-guide/);
        - plain PTX for X.y is JIT-compiled by the driver for any GPU of X.y or later, a newer
          major included (same sources: "PTX compatibility", "Just-in-time compilation");
        - family-specific code (``sm_120f``, ``compute_120f``, CUDA 12.9+) runs on the GPUs of its
          family, the same major X with minor >= y (sm_100f: 10.0 and 10.3; sm_120f: 12.0 and 12.1);
        - architecture-specific code (``sm_90a``, ``sm_120a``, ``compute_121a``) runs only on exactly
          that compute capability: no forward compatibility at all, not even within its family
          (CUDA Programming Guide 5.1 Compute Capabilities, "Feature availability",
          https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html;
          NVIDIA technical blog "NVIDIA Blackwell and NVIDIA CUDA 12.9 Introduce Family-Specific
          Architecture Features", 2025).
        """
        if self.kind == "ptx" and self.arch.suffix == "" and (self.arch.major, self.arch.minor) <= (device.major, device.minor):
            return True  # plain PTX: the driver JIT-compiles it for any later GPU
        if self.arch.major != device.major or self.arch.minor > device.minor:
            return False
        return self.arch.suffix != "a" or self.arch.minor == device.minor

    def label(self) -> str:
        prefix = "sm" if self.kind == "sass" else "compute"
        return f"{prefix}_{self.arch.major}{self.arch.minor}{self.arch.suffix}"

    @classmethod
    def from_label(cls, label: str) -> Code:
        """The code ``label()`` names (``sm_121a``, ``compute_90``)."""
        match = _LABEL_RE.match(label)
        if match is None:
            raise BinaryCheckError(f"'{label}' is not a code label like sm_121a or compute_90")
        arch = Arch(major=int(match["major"]), minor=int(match["minor"]), suffix=match["suffix"])
        return cls(kind="sass" if match["prefix"] == "sm" else "ptx", arch=arch)


@dataclass(frozen=True, kw_only=True)
class Kernel:
    name: str  # mangled, as in the cubin's symbol table and the PTX
    codes: tuple[Code, ...]  # all its code in the library
    verdict: Verdict
    # Its code in each compilation unit that holds it (a template kernel instantiated in two units
    # is two kernels to the runtime: each launch site runs its own unit's instance).
    units: tuple[tuple[Code, ...], ...] = ()

    def shown_codes(self) -> str:
        """``sm_121a, sm_90a``; when several units hold it: ``per unit: sm_121a | sm_120a``."""
        if len(self.units) < 2:
            return ", ".join(c.label() for c in self.codes)
        return "per unit: " + " | ".join(", ".join(c.label() for c in unit) for unit in self.units)

    def to_json(self) -> dict[str, object]:
        found: dict[str, object] = {"name": self.name, "verdict": self.verdict, "codes": [c.label() for c in self.codes]}
        if len(self.units) > 1:
            found["units"] = [[c.label() for c in unit] for unit in self.units]
        return found


def judge(codes: Iterable[Code], device: Arch) -> Verdict:
    """One kernel's verdict from the code one compilation unit carries for it (see the module's doc)."""
    found = tuple(codes)
    if any(c.kind == "sass" and c.runs_on(device) for c in found):
        return "sass"
    if any(c.kind == "ptx" and c.runs_on(device) for c in found):
        return "ptx"
    if any(c.arch.major == device.major for c in found):
        return "fails"
    return "other"


def judge_units(units: Iterable[Iterable[Code]], device: Arch) -> Verdict:
    """A kernel in several units fails when one of its instances fails; else the best one counts."""
    verdicts = {judge(unit, device) for unit in units}
    order: tuple[Verdict, ...] = ("fails", "sass", "ptx", "other")
    return next(v for v in order if v in verdicts)


@dataclass(frozen=True, kw_only=True)
class FileReport:
    path: Path  # a library inside a wheel: the wheel's path / the member's path
    codes: tuple[Code, ...]  # every cubin and PTX, kernels or not, each arch once
    device: Arch  # the GPU the kernels were judged for
    kernels: tuple[Kernel, ...] = ()

    @property
    def ok(self) -> bool | None:
        """None: no device code at all (a host library); False: a kernel fails."""
        if not self.codes:
            return None
        return not self.failing

    @property
    def runs(self) -> bool:
        """Whether some kernel runs on the GPU (from a cubin or by JIT)."""
        return any(k.verdict in ("sass", "ptx") for k in self.kernels)

    @property
    def failing(self) -> tuple[Kernel, ...]:
        return tuple(k for k in self.kernels if k.verdict == "fails")

    def counts(self) -> dict[Verdict, int]:
        return {v: sum(k.verdict == v for k in self.kernels) for v in VERDICTS}

    def runs_with(self) -> dict[str, int]:
        """The code the kernels that run are served by: for a ``sass`` kernel its cubins that run,
        for a ``ptx`` kernel its PTX that does (a kernel with two such counts under each)."""
        found: Counter[str] = Counter()
        for k in self.kernels:
            if k.verdict in ("sass", "ptx"):
                kind = "sass" if k.verdict == "sass" else "ptx"
                found.update(c.label() for c in k.codes if c.kind == kind and c.runs_on(self.device))
        return dict(sorted(found.items()))

    def other_archs(self) -> dict[str, int]:
        """The kernels not for this GPU, counted by the code they have (``sm_90a+sm_100f``)."""
        found = Counter("+".join(c.label() for c in k.codes) for k in self.kernels if k.verdict == "other")
        return dict(found.most_common())

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "codes": [c.label() for c in self.codes],
            "kernels_total": len(self.kernels),
            "counts": self.counts(),
            "runs_with": self.runs_with(),
            "other_archs": self.other_archs(),
            "failing": [k.to_json() for k in self.failing],
            "kernels": [k.to_json() for k in self.kernels],
        }


def rules() -> str:
    """This check-binary's identity (its module's sha256, 12 digits): a verdict kept under it was made
    by these very rules, and one kept under another is never read."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def kept_json(reports: Iterable[FileReport]) -> list[dict[str, Any]]:
    """``reports`` whole (every kernel's code per unit), for ``from_kept``: a verdict kept for later."""

    def labels(codes: Iterable[Code]) -> list[str]:
        return [c.label() for c in codes]

    return [
        {
            "path": str(r.path),
            "codes": labels(r.codes),
            "kernels": [
                {
                    "name": k.name,
                    "verdict": k.verdict,
                    "codes": labels(k.codes),
                    "units": [labels(u) for u in k.units],
                }
                for k in r.kernels
            ],
        }
        for r in reports
    ]


def from_kept(data: list[dict[str, Any]], device: Arch) -> tuple[FileReport, ...]:
    """The reports ``kept_json`` wrote, for ``device``."""

    def codes(labels: list[str]) -> tuple[Code, ...]:
        return tuple(Code.from_label(label) for label in labels)

    return tuple(
        FileReport(
            path=Path(r["path"]),
            codes=codes(r["codes"]),
            device=device,
            kernels=tuple(
                Kernel(name=k["name"], verdict=k["verdict"], codes=codes(k["codes"]), units=tuple(codes(u) for u in k["units"]))
                for k in r["kernels"]
            ),
        )
        for r in data
    )


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


def _blocks(lines: Iterable[str], path: Path) -> Iterator[tuple[Literal["elf", "ptx"], int, Arch, str]]:
    """(kind, n, arch, line) for each line of cuobjdump's output inside a fatbin block: the n-th
    block of its kind (counted from 0)."""
    kind: Literal["elf", "ptx"] | None = None
    arch: Arch | None = None
    seen = {"elf": -1, "ptx": -1}
    for raw in lines:
        line = raw.rstrip("\n")
        block = _BLOCK_RE.match(line)
        if block is not None:
            kind, arch = ("elf" if block["kind"] == "elf" else "ptx"), None
            seen[kind] += 1
            continue
        if kind is None:
            continue
        if arch is None:
            header = _HEADER_ARCH_RE.match(line)
            if header is not None:
                arch = Arch(major=int(header["major"]), minor=int(header["minor"]), suffix=header["suffix"])
            elif line.startswith("arch = "):
                raise BinaryCheckError(f"{path}: cannot read the arch '{line}' in cuobjdump's output")
            continue
        yield kind, seen[kind], arch, line


@dataclass(frozen=True)
class FatbinEntry:
    unit: int  # which fatbin of the section: nvcc writes one per compilation unit
    kind: Literal["elf", "ptx"]
    sm: int  # 10 * major + minor (the suffix is not in the entry's header)


def fatbin_entries(path: Path) -> dict[str, list[FatbinEntry]] | None:
    """The cubins (``elf``) and PTX (``ptx``) of each fatbin in ``path``'s fatbin section, each kind in
    the order of the section, which is the order cuobjdump prints them in; None when ``path`` has no
    such section (a cubin or fatbin file given as is: one unit).

    The section (``.nv_fatbin``; ``__nv_relfatbin`` when there is no executable one, as cuobjdump
    chooses) holds one fatbin per compilation unit: a 16-byte header (magic 0xBA55ED50, version u16,
    header size u16, size u64), then entries, each a header (kind u16: 1 PTX, 2 ELF; u16; header size
    u32; payload size u64; ...; the sm number u32 at byte 28) and its payload, compressed or not.
    pyelftools reads the ELF file (the library of the field); the fatbin layout is read here and
    checked against cuobjdump's own listing by the caller.
    """
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    with path.open("rb") as stream:
        try:
            elf = ELFFile(stream)
        except ELFError:
            return None
        section = next((s for s in map(elf.get_section_by_name, _FATBIN_SECTIONS) if s is not None), None)
        if section is None or elf.get_machine_arch() == "CUDA":  # a cubin: its own symbols, no fatbin
            return None
        data: bytes = section.data()
    entries: dict[str, list[FatbinEntry]] = {"elf": [], "ptx": []}
    offset, unit = 0, 0
    while offset < len(data):
        if data[offset : offset + 4] != _FATBIN_MAGIC:
            if data[offset : offset + 8].strip(b"\0"):
                raise BinaryCheckError(f"{path}: unexpected bytes at offset {offset} of its fatbin section (not a fatbin header)")
            offset += 8  # zero padding between fatbins
            continue
        header_size, size = struct.unpack_from("<HQ", data, offset + 6)
        entry, end = offset + header_size, offset + header_size + size
        while entry < end:
            kind, entry_header, payload = struct.unpack_from("<H2xIQ", data, entry)
            (sm,) = struct.unpack_from("<I", data, entry + 28)
            if kind in (1, 2):
                entries["ptx" if kind == 1 else "elf"].append(FatbinEntry(unit=unit, kind="ptx" if kind == 1 else "elf", sm=sm))
            entry += entry_header + payload
        offset, unit = end, unit + 1
    return entries


def read_code(path: Path, tool: Path | None = None) -> tuple[tuple[Code, ...], dict[str, dict[int, set[Code]]]] | None:
    """Every cubin and PTX in ``path`` and, per kernel name, the code each compilation unit has for
    it; None when ``path`` has no device code."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    exe = tool or cuobjdump()
    entries = fatbin_entries(path)
    codes: set[Code] = set()
    kernels: dict[str, dict[int, set[Code]]] = {}

    def unit_of(kind: Literal["elf", "ptx"], n: int, arch: Arch) -> int:
        if entries is None:
            return 0
        found = entries[kind][n] if n < len(entries[kind]) else None
        if found is None or found.sm != 10 * arch.major + arch.minor:
            raise BinaryCheckError(
                f"{path}: cuobjdump's {kind} code #{n + 1} ({arch}) is not the fatbin section's "
                f"({'none' if found is None else found.sm}): cannot tell its compilation unit"
            )
        return found.unit

    try:
        for kind, n, arch, line in _blocks(cmd.lines([exe, "-symbols", path]), path):
            code = Code(kind="sass" if kind == "elf" else "ptx", arch=arch)
            codes.add(code)
            parts = line.split()
            # "FUNC  GLOBAL  DEFAULT  ENTRY  name": a kernel; other FUNCs are device functions.
            if kind == "elf" and len(parts) >= 5 and parts[0] == "FUNC" and "ENTRY" in parts[1:-1]:
                kernels.setdefault(parts[-1], {}).setdefault(unit_of(kind, n, arch), set()).add(code)
        if any(c.kind == "ptx" for c in codes):
            for kind, n, arch, line in _blocks(_ptx_lines(cmd.lines([exe, "-ptx", path])), path):
                entry = _ENTRY_RE.match(line) if kind == "ptx" else None
                if entry is not None:
                    unit = unit_of(kind, n, arch)
                    kernels.setdefault(entry["name"], {}).setdefault(unit, set()).add(Code(kind="ptx", arch=arch))
    except subprocess.CalledProcessError as exc:
        if _NO_DEVICE_CODE in (exc.stderr or ""):
            return None
        raise BinaryCheckError(f"{cmd.show(exc.cmd)} failed (exit {exc.returncode}): {(exc.stderr or '').strip()}") from None
    return tuple(sorted(codes)), kernels


def _ptx_lines(lines: Iterable[str]) -> Iterator[str]:
    """The lines of ``cuobjdump -ptx`` that name a block, its arch or a kernel: a vLLM library holds
    millions of lines of PTX, and a regular expression on each took most of check-binary's time."""
    for line in lines:
        if ".entry" in line or line.startswith(("Fatbin ", "arch = ")):
            yield line


def check_file(path: Path, device: Arch, tool: Path | None = None, shown_as: Path | None = None) -> FileReport:
    """The report of one object or library; ``shown_as`` is the path it is named by (a wheel member)."""
    found = read_code(path, tool)
    name = shown_as or path
    if found is None:
        return FileReport(path=name, codes=(), device=device)
    codes, by_name = found
    kernels = tuple(
        Kernel(
            name=kernel,
            codes=tuple(sorted(set().union(*units.values()))),
            verdict=judge_units(units.values(), device),
            units=tuple(tuple(sorted(units[u])) for u in sorted(units)),
        )
        for kernel, units in sorted(by_name.items())
    )
    return FileReport(path=name, codes=codes, kernels=kernels, device=device)


def _is_library(name: str) -> bool:
    """A shared library or object, by its name (a path inside a wheel, or a file name)."""
    base = name.rsplit("/", 1)[-1]
    return base.endswith((".so", ".o")) or ".so." in base


def check_wheel(wheel: Path, device: Arch, tool: Path) -> list[FileReport]:
    """One report per shared library in ``wheel``, each unpacked alone (vLLM's are up to 300 MB)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ConfigError(f"{wheel}: not a wheel (not a zip archive)") from None
    reports = []
    with archive, tempfile.TemporaryDirectory(prefix="sparkbuild-check-binary-") as tmp:
        for member in sorted(n for n in archive.namelist() if _is_library(n)):
            # zipfile drops absolute and '..' parts of member names, so nothing lands outside tmp.
            unpacked = Path(archive.extract(member, tmp))
            reports.append(check_file(unpacked, device, tool, shown_as=wheel / member))
            unpacked.unlink()
    return reports


def check(paths: list[Path], device: Arch) -> tuple[FileReport, ...]:
    """One report per file: folders are searched for ``*.so`` (``*.so.1`` too) and ``*.o``, wheels
    (``.whl``) opened and each shared library in them checked."""
    tool = cuobjdump()
    reports: list[FileReport] = []
    for path in paths:
        if path.is_dir():
            reports += [
                check_file(f, device, tool) for f in sorted(p for p in path.rglob("*") if _is_library(p.name) and p.is_file())
            ]
        elif path.suffix == ".whl":
            found = check_wheel(path, device, tool)
            if not found:
                raise ConfigError(f"{path}: the wheel holds no shared library (*.so) to check")
            reports += found
        else:
            reports.append(check_file(path, device, tool))
    if not reports:
        raise ConfigError(f"no files to check in {', '.join(map(str, paths))}")
    return tuple(reports)


def demangled(names: Iterable[str]) -> dict[str, str]:
    """C++ names for mangled ones, by binutils' c++filt (one process for all); without c++filt
    the names stay mangled and the table says so."""
    wanted = sorted(set(names))
    tool = shutil.which("c++filt")
    if not wanted or tool is None:
        return {n: n for n in wanted}
    done = cmd.run([tool], capture=True, stdin="\n".join(wanted).encode())
    return dict(zip(wanted, done.stdout.splitlines(), strict=True))


def _common_folder(paths: list[Path]) -> Path | None:
    """The folder (or wheel) all ``paths`` are in, named once atop the table; None for one file."""
    if len(paths) < 2 or len({p.is_absolute() for p in paths}) > 1:
        return None
    top = Path(os.path.commonpath([str(p) for p in paths]))
    return top if top != Path(top.anchor) and top not in paths else None


def _short(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(reports: tuple[FileReport, ...], device: Arch) -> str:
    """Counts per library, then what is not for this GPU, then every failing kernel."""
    with_code = [r for r in reports if r.ok is not None]
    top = _common_folder([r.path for r in reports])
    shown = {r.path: str(r.path.relative_to(top)) if top else str(r.path) for r in reports}
    lines = [
        f"check-binary for a GPU of compute capability {device.major}.{device.minor} ({device.sm()}): "
        f"{len(reports)} file(s), {len(with_code)} with GPU code" + (f", in {top}" if top else ""),
        f"  {'verdict':<8} {'kernels':>7} {'sass':>6} {'ptx':>5} {'other':>6} {'FAILS':>5}  library",
    ]
    for r in reports:
        if r.ok is None:
            lines.append(f"  {'-':<8} {'':>7} {'':>6} {'':>5} {'':>6} {'':>5}  {shown[r.path]} (no device code)")
            continue
        c = r.counts()
        verdict = "FAILS" if not r.ok else ("ok" if r.runs or not r.kernels else "other")
        lines.append(
            f"  {verdict:<8} {len(r.kernels):>7} {c['sass']:>6} {c['ptx']:>5} {c['other']:>6} {c['fails']:>5}  {shown[r.path]}"
        )
    lines.append(
        f"  (sass: a cubin runs on {device.sm()}; ptx: JIT-compiled from PTX on first load; other: code only for "
        f"other GPUs; FAILS: code for {device.sm()[:-1]}x, none that runs on {device.sm()})"
    )
    for r in with_code:
        if r.runs:
            lines.append(f"  {shown[r.path]}: runs with " + ", ".join(f"{label} ({n})" for label, n in r.runs_with().items()))
        if r.other_archs():
            lines.append(
                f"  {shown[r.path]}: not for this GPU: " + "; ".join(f"{n} [{archs}]" for archs, n in r.other_archs().items())
            )
    failing = [(r, k) for r in reports for k in r.failing]
    if failing:
        names = demangled(k.name for _, k in failing)
        lines.append(f"FAILING: {len(failing)} kernel(s) have code for {device.sm()[:-1]}x but none that runs on {device.sm()}:")
        lines += [f"  {shown[r.path]}: {_short(names[k.name])} [{k.shown_codes()}]" for r, k in failing]
        if shutil.which("c++filt") is None:
            lines.append("  (names mangled: no c++filt on PATH; install binutils to read them)")
    return "\n".join(lines)


def require(reports: tuple[FileReport, ...], device: Arch) -> None:
    """Fail on any failing kernel (named with its library), and when nothing at all runs on the GPU."""
    failing = [(r, k) for r in reports for k in r.failing]
    if failing:
        shown = "; ".join(f"{r.path}: {k.name} ({k.shown_codes()})" for r, k in failing[:20])
        more = f"; and {len(failing) - 20} more" if len(failing) > 20 else ""
        raise BinaryCheckError(
            f"{len(failing)} kernel(s) have code for {device.sm()[:-1]}x but none that runs on {device.sm()}: {shown}{more}. "
            f"Build their units for {device.sm()}a, {device.sm()[:-1]}0f or {device.sm()} (or add PTX they can JIT from)"
        )
    # Device code without kernels (a unit of host code and __device__ helpers) has nothing to launch.
    with_kernels = [r for r in reports if r.kernels]
    if with_kernels and not any(r.runs for r in with_kernels):
        archs = sorted({c.label() for r in with_kernels for k in r.kernels for c in k.codes})
        raise BinaryCheckError(
            f"no kernel in {', '.join(str(r.path) for r in with_kernels)} runs on {device.sm()}: "
            f"their code is only for other GPUs ({', '.join(archs)})"
        )


def needed(path: Path) -> tuple[str, ...]:
    """The shared libraries ``path`` names in its dynamic section (DT_NEEDED), in order; () for a
    file that is not a dynamic ELF object. Read with pyelftools, as the fatbin section is."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with path.open("rb") as stream:
        try:
            elf = ELFFile(stream)
        except ELFError:
            return ()
        dynamic = elf.get_section_by_name(".dynamic")
        if not isinstance(dynamic, DynamicSection):
            return ()
        return tuple(str(getattr(tag, "needed", "")) for tag in dynamic.iter_tags() if tag.entry.d_tag == "DT_NEEDED")
