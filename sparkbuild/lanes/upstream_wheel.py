"""Pin upstream's published vLLM wheel of a release for a platform, and judge it: what ``resolve``
writes into the lock's ``wheels`` table, and what ``rehearse`` pins for its own platform.

The wheel is found in the simple index (PyPI's, or ``SPARKBUILD_PYPI_SIMPLE``): the file of the
release whose tags fit the platform, its Python and glibc (a manylinux wheel no newer than the base's
glibc; cp3X-abi3 or the base's own cp3X), with its sha256 from the index's ``#sha256=`` link. It is
downloaded once (kept under ``$SPARKBUILD_CACHE/upstream-wheels/<sha256>/`` only when its sha256
matches) and read:

- check-binary on every shared library, kernel by kernel, for each GPU asked (``sparkbuild.build.binaries``);
- the CUDA major its extensions link (``DT_NEEDED libcudart.so.N``, read with pyelftools);
- the torch it requires (``Requires-Dist`` of its METADATA).

What was found for one wheel and GPU is kept beside the download (keyed by the check's own source),
so a second pin of the same file reads it instead of running cuobjdump over 700 MB again.
"""

from __future__ import annotations

import email.parser
import json
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from sparkbuild.build import binaries
from sparkbuild.errors import BinaryCheckError, SourceError
from sparkbuild.plan.lock import BinaryVerdict, WheelPin
from sparkbuild.upstream import sources
from sparkbuild.util import fsutil, log

CACHE = "upstream-wheels"
MACHINES = {"linux/arm64": "aarch64", "linux/amd64": "x86_64"}
_MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_(\w+)")
_LEGACY = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
_CUDART = re.compile(r"libcudart\.so\.(\d+)")


@dataclass(frozen=True, kw_only=True)
class Found:
    """What reading a wheel found, for one GPU."""

    verdict: BinaryVerdict
    cuda: str | None
    torch: str | None


def fits(filename: str, platform: str, python: str, glibc: str) -> bool:
    """Whether the wheel installs on ``platform`` with CPython ``python`` (``3.12``) and glibc ``glibc``."""
    try:
        _, _, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return False
    machine = MACHINES[platform]
    py = int(python.split(".")[1])
    libc = tuple(int(n) for n in glibc.split("."))
    for tag in tags:
        if not _python_fits(tag.interpreter, tag.abi, py):
            continue
        legacy = tag.platform.removesuffix(f"_{machine}") if tag.platform.endswith(f"_{machine}") else None
        if legacy in _LEGACY and _LEGACY[legacy] <= libc:
            return True
        m = _MANYLINUX.fullmatch(tag.platform)
        if m and m.group(3) == machine and (int(m.group(1)), int(m.group(2))) <= libc:
            return True
    return False


def _python_fits(interpreter: str, abi: str, minor: int) -> bool:
    if interpreter.startswith("cp3") and interpreter[3:].isdigit():
        wheel_minor = int(interpreter[3:])
        return (abi == "abi3" and wheel_minor <= minor) or (abi.startswith("cp3") and wheel_minor == minor)
    return interpreter in ("py3", f"py3{minor}") and abi == "none"


def pin(
    version: str, platform: str, gpus: tuple[str, ...], *, python: str, glibc: str, cache: Path, index: str | None = None
) -> WheelPin:
    """Upstream's wheel of vLLM ``version`` for ``platform``, downloaded, checked and judged for ``gpus``;
    with ``missing`` set (and nothing downloaded) when the index has none that fits."""
    where = index or sources.simple_index()
    links = sources.index_links("vllm", where, suffix=".whl")
    release = sorted(n for n in links if n.startswith(f"vllm-{version}-"))
    fitting = [n for n in release if fits(n, platform, python, glibc)]
    if not fitting:
        missing = (
            f"the index {where} has no vLLM {version} wheel for {platform} (CPython {python}, glibc {glibc}); "
            f"it has: {', '.join(release) or 'none of that release'}"
        )
        return WheelPin(version=version, platform=platform, index=where, missing=missing)
    assert gpus, "a wheel is pinned for the GPUs of the targets that use it"
    link = links[fitting[-1]]
    wheel = download(link, cache)
    found = {gpu: judge(wheel, link.sha256, gpu, cache) for gpu in gpus}
    first = found[gpus[0]]
    return WheelPin(
        version=version,
        platform=platform,
        index=where,
        filename=link.filename,
        url=link.url,
        sha256=link.sha256,
        torch=first.torch,
        cuda=first.cuda,
        check_binary={gpu: f.verdict for gpu, f in found.items()},
    )


def download(link: sources.IndexLink, cache: Path) -> Path:
    """The wheel in the cache, by its sha256 (downloaded and checked once)."""
    return sources.fetch(link, cache / CACHE / link.sha256)


def judge(wheel: Path, sha256: str, gpu: str, cache: Path) -> Found:
    """check-binary of ``wheel`` for ``gpu``, its CUDA and torch: from the cache when this wheel was
    judged for this GPU by this check-binary before."""
    kept = cache / CACHE / sha256 / f"judged-{gpu}-{binaries.rules()}.json"
    if kept.is_file():
        data = json.loads(kept.read_text(encoding="utf-8"))
        return Found(verdict=BinaryVerdict(**data["verdict"]), cuda=data["cuda"], torch=data["torch"])
    with log.step(f"check-binary of {wheel.name} for GPU {gpu}"):
        verdict, cuda = inspect(wheel, gpu)
    found = Found(verdict=verdict, cuda=cuda, torch=required_torch(wheel))
    fsutil.write_text(kept, json.dumps({"verdict": vars(found.verdict), "cuda": found.cuda, "torch": found.torch}) + "\n")
    return found


def inspect(wheel: Path, gpu: str) -> tuple[BinaryVerdict, str | None]:
    """check-binary's verdict on every shared library of ``wheel`` for ``gpu``, and the CUDA major they
    link; each library unpacked alone (vLLM's are up to 300 MB)."""
    device = binaries.Arch.parse(gpu)
    tool = binaries.cuobjdump()
    reports: list[binaries.FileReport] = []
    majors: set[str] = set()
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise SourceError(f"{wheel}: not a wheel (not a zip archive); delete it and pin again") from None
    with archive, tempfile.TemporaryDirectory(prefix="sparkbuild-wheel-") as tmp:
        for member in sorted(n for n in archive.namelist() if n.endswith(".so") or ".so." in n.rsplit("/", 1)[-1]):
            # zipfile drops absolute and '..' parts of member names, so nothing lands outside tmp.
            unpacked = Path(archive.extract(member, tmp))
            majors |= {m.group(1) for name in binaries.needed(unpacked) if (m := _CUDART.fullmatch(name))}
            reports.append(binaries.check_file(unpacked, device, tool, shown_as=Path(member)))
            unpacked.unlink()
    log.info(binaries.table(tuple(reports), device) if reports else f"{wheel.name}: no shared library")
    return verdict_of(tuple(reports), device), (",".join(sorted(majors)) or None)


def verdict_of(reports: tuple[binaries.FileReport, ...], device: binaries.Arch) -> BinaryVerdict:
    counts = {v: sum(r.counts()[v] for r in reports) for v in binaries.VERDICTS}
    kernels = sum(len(r.kernels) for r in reports)
    error = ""
    if not any(r.ok is not None for r in reports):
        error = "no library of the wheel holds GPU code"
    else:
        try:
            binaries.require(reports, device)
        except BinaryCheckError as exc:
            error = str(exc)
    return BinaryVerdict(
        ok=not error,
        libraries=sum(r.ok is not None for r in reports),
        kernels=kernels,
        sass=counts["sass"],
        ptx=counts["ptx"],
        other=counts["other"],
        fails=counts["fails"],
        error=error[:600],
    )


def required_torch(wheel: Path) -> str | None:
    """The wheel's own torch requirement (``torch==2.14.0``), from its METADATA; None when it names none."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise SourceError(f"{wheel.name}: expected one .dist-info/METADATA, found {len(names)}")
        metadata = email.parser.Parser().parsestr(archive.read(names[0]).decode("utf-8"))
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(str(line))
        if req.name == "torch" and (req.marker is None or "extra" not in str(req.marker)):
            return str(req)
    return None
