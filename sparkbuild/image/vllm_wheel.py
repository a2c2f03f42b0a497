"""Run in a Spark target's vLLM stage when vLLM comes from upstream's published wheel (no compile).

1. pip downloads the pinned wheel with ``--require-hashes``: a file whose sha256 is not the lock's
   stops the stage, and the line ``sparkbuild-wheel: sha256 mismatch ...`` tells sparkbuild why;
2. the patch set is applied with sparkbuild's own patch engine to the wheel's files, unpacked
   (``wheel unpack``), with ``--installed``: a patch may change the ``vllm/`` package's Python files
   only, or the stage fails naming the file; a wheel some patch changed is repacked (``wheel pack``
   writes its RECORD anew), an unchanged one is upstream's file as it is;
3. the files the runtime stage reads from ``/wheels``, as a source build writes them:
   ``vllm-requirements.txt`` (the wheel's own Requires-Dist, with the extras asked for),
   ``vllm-sources.txt`` (the wheel's URL and sha256), ``vllm-build-env.txt``, ``vllm-preflight.json``
   (no compile ran) and ``vllm-patches.json`` (the patch engine's record).

Runs on the build platform (no emulation: nothing here executes the wheel's code), with the Python,
pip, ``wheel`` and ``packaging`` of Debian or Ubuntu (the stage installs them). Every command is
printed before it runs.
"""

from __future__ import annotations

import argparse
import calendar
import email.parser
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

MARK = "sparkbuild-wheel:"
RECORD = ".sparkbuild-patches.json"
# pip's report of a file whose hash is not the one asked for (pip/_internal/exceptions.py, HashMismatch).
_PIP_MISMATCH = "DO NOT MATCH THE HASHES"
_GOT = re.compile(r"Got\s+([0-9a-f]{64})")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


class WheelError(Exception):
    """The stage cannot go on; the message says why (printed with the mark sparkbuild reads)."""


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    print("+ " + shlex.join(args), flush=True)
    done = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
    sys.stdout.write(done.stdout)
    sys.stdout.write(done.stderr)
    sys.stdout.flush()
    return done


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def platform_tag(filename: str) -> str:
    """The platform tag of a wheel's file name (``manylinux_2_28_aarch64``): pip downloads for it."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5:
        raise WheelError(f"{filename} is not a wheel's file name")
    return parts[-1].split(".")[0]


def download(url: str, filename: str, sha256: str, into: Path) -> Path:
    """The wheel at ``url``, checked by pip against ``sha256``; a mismatch says so with the mark."""
    requirement = into / "requirement.txt"
    requirement.write_text(f"vllm @ {url} --hash=sha256:{sha256}\n", encoding="utf-8")
    done = run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--require-hashes",
            "--only-binary=:all:",
            "--platform",
            platform_tag(filename),
            "--dest",
            str(into / "download"),
            "--requirement",
            str(requirement),
        ]
    )
    output = done.stdout + done.stderr
    if done.returncode != 0 and _PIP_MISMATCH in output:
        got = _GOT.search(output)
        print(f"{MARK} sha256 mismatch {filename} expected {sha256} got {got.group(1) if got else 'unknown'}", flush=True)
        raise WheelError(f"{filename}: pip's hash check failed (the lock pins sha256 {sha256})")
    if done.returncode != 0:
        raise WheelError(f"pip could not download {url} (exit {done.returncode})")
    wheel = into / "download" / filename
    if not wheel.is_file():
        found = ", ".join(p.name for p in (into / "download").iterdir())
        raise WheelError(f"pip downloaded {found}, not {filename}")
    if sha256_of(wheel) != sha256:  # pip checked it; this says so in the log, with the value
        raise WheelError(f"{wheel}: sha256 {sha256_of(wheel)} is not {sha256}")
    print(f"{filename}: sha256 {sha256} as the lock pins", flush=True)
    return wheel


def rebuilt(args: argparse.Namespace, wheel: Path, work: Path) -> Path:
    """The wheel the runtime installs, in ``args.out``: upstream's file as it is, or, where a patch
    changed its Python files or a rehearsal relaxes a bound, unpacked, changed and repacked (``wheel
    pack`` writes its RECORD anew). The patch engine's record goes to ``vllm-patches.json``."""
    out: Path = args.out
    if not args.names and not args.relax:
        return Path(shutil.copy2(wheel, out / wheel.name))
    run_or_fail([sys.executable, "-m", "wheel", "unpack", "--dest", str(work / "unpacked"), str(wheel)])
    (tree,) = (work / "unpacked").iterdir()
    changed = bool(args.names) and patch(tree, args, out)
    changed = relax_metadata(tree, args.relax) or changed
    if not changed:
        return Path(shutil.copy2(wheel, out / wheel.name))
    (work / "packed").mkdir()
    # Every member dated as upstream's newest (wheel pack reads SOURCE_DATE_EPOCH), not as the time the
    # patch wrote it: two builds of one lock make the same bytes (`sparkbuild reproduce`).
    epoch = {**os.environ, "SOURCE_DATE_EPOCH": str(newest_member(wheel))}
    run_or_fail([sys.executable, "-m", "wheel", "pack", "--dest-dir", str(work / "packed"), str(tree)], env=epoch)
    (made,) = (work / "packed").glob("*.whl")
    # wheel pack names the file by the Tag of its WHEEL file, which upstream's auditwheel left as
    # linux_<arch> when it renamed the file manylinux: the repacked wheel keeps upstream's name.
    return Path(shutil.move(made, out / wheel.name))


def newest_member(wheel: Path) -> int:
    """The time of the newest member of ``wheel``, as seconds since 1970 (zip times are UTC here:
    the wheel tools write them from SOURCE_DATE_EPOCH or a UTC clock)."""
    with zipfile.ZipFile(wheel) as archive:
        newest = max(info.date_time for info in archive.infolist())
    return calendar.timegm((*newest, 0, 0, 0))


def patch(tree: Path, args: argparse.Namespace, out: Path) -> bool:
    """The patch set applied to the unpacked wheel's Python files; whether a patch changed one."""
    command = [sys.executable, "-m", "sparkbuild.patch", "apply", "--installed", "--source", str(tree)]
    command += ["--version", args.version, "--patches", str(args.patches), *[a for n in args.names for a in ("--patch", n)]]
    run_or_fail(command, env={**os.environ, "PYTHONPATH": str(args.engine)})
    record = tree / RECORD
    results = json.loads(record.read_text(encoding="utf-8"))["results"]
    shutil.move(record, out / "vllm-patches.json")  # the record is the build's, not a file of the wheel
    return any(r["status"] == "applies" for r in results)


def relax_metadata(tree: Path, relax: list[str]) -> bool:
    """A rehearsal's relaxed requirements dropped from the wheel's own METADATA too (as a source
    rehearsal drops them from the requirements files it builds from), or ``pip check`` in the runtime
    holds the image to the bound this machine's index cannot meet. Whether anything changed."""
    if not relax:
        return False
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names = {canonicalize_name(n) for n in relax}
    (metadata,) = tree.glob("*.dist-info/METADATA")
    lines = metadata.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if line.startswith("Requires-Dist: "):
            req = Requirement(line.removeprefix("Requires-Dist: "))
            if canonicalize_name(req.name) in names and req.specifier and "extra" not in str(req.marker or ""):
                print(f"rehearsal: {req} -> {req.name} in {metadata.name} (rehearsal: relax:)", flush=True)
                lines[i] = f"Requires-Dist: {req.name}"
    text = "\n".join(lines)
    if text == metadata.read_text(encoding="utf-8"):
        return False
    metadata.write_text(text, encoding="utf-8")
    return True


def run_or_fail(args: list[str], env: dict[str, str] | None = None) -> None:
    done = run(args, env)
    if done.returncode != 0:
        raise WheelError(f"{shlex.join(args[:5])} ... failed (exit {done.returncode}); see above")


def requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise WheelError(f"{wheel.name}: expected one .dist-info/METADATA, found {len(names)}")
        metadata = email.parser.Parser().parsestr(archive.read(names[0]).decode("utf-8"))
    return [str(r) for r in metadata.get_all("Requires-Dist") or []]


def requirements(lines: list[str], extras: list[str], relax: list[str]) -> list[str]:
    """What the runtime installs for vLLM: its requirements, plus those of ``extras``, with the
    version bounds of ``relax`` dropped (a rehearsal's index gaps), in the wheel's order."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    relaxed = {canonicalize_name(n) for n in relax}
    found: list[str] = []
    declared: set[str] = set()
    for line in lines:
        req = Requirement(line)
        marker = str(req.marker) if req.marker else ""
        if "extra" in marker:
            names = [e for e in extras if req.marker is not None and req.marker.evaluate({"extra": e})]
            declared |= set(re.findall(r'extra == "([^"]+)"', marker))
            if not names:
                continue
            req.marker = None  # the extra is asked for: its requirement is one of vLLM's here
        if canonicalize_name(req.name) in relaxed:
            req.specifier = type(req.specifier)("")
            req.marker = None
        found.append(str(req))
    unknown = [e for e in extras if e not in declared]
    if unknown:
        raise WheelError(f"the wheel declares no extra {', '.join(unknown)}; it has {', '.join(sorted(declared))}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 vllm_wheel.py")
    parser.add_argument("--url", required=True)
    parser.add_argument("--filename", required=True)
    parser.add_argument("--sha256", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--extra", action="append", default=[], help="one of vLLM's extras (repeatable)")
    parser.add_argument("--relax", action="append", default=[], help="a requirement whose version bound is dropped")
    parser.add_argument("--patches", type=Path, default=None)
    parser.add_argument("--patch", dest="names", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", type=Path, default=Path("/opt/sparkbuild/lib"), help="where sparkbuild's patch engine is")
    # A fixed folder, not a random one: the patch record names the tree it patched, and two builds of
    # one lock write the same record (`sparkbuild reproduce`). The build step's file system is its own.
    parser.add_argument("--work", type=Path, default=Path("/opt/sparkbuild/work"), help="an empty or missing folder to work in")
    args = parser.parse_args(argv)
    if not args.url:
        print("error: no --url: the build passes the wheel's URL as VLLM_WHEEL_URL (from the lock)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work: Path = args.work
    if work.exists() and any(work.iterdir()):
        print(f"error: --work {work} is not empty; give an empty or missing folder", file=sys.stderr)
        return 2
    try:
        work.mkdir(parents=True, exist_ok=True)
        try:
            wheel = download(args.url, args.filename, args.sha256, work)
            built = rebuilt(args, wheel, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        write_records(args, built)
    except WheelError as exc:
        print(f"{MARK} error {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def write_records(args: argparse.Namespace, built: Path) -> None:
    """The files a source build leaves beside its wheel, for the runtime stage and publish."""
    out: Path = args.out
    found = requirements(requires(built), args.extra, args.relax)
    (out / "vllm-requirements.txt").write_text("\n".join(found) + "\n", encoding="utf-8")
    sources = f"{args.url} sha256:{args.sha256}\n"
    if sha256_of(built) != args.sha256:
        sources += f"  repacked {built.name} sha256:{sha256_of(built)}\n"
    (out / "vllm-sources.txt").write_text(sources, encoding="utf-8")
    (out / "vllm-build-env.txt").write_text(f"VLLM_FROM=wheel VLLM_WHEEL={args.filename} VLLM_WHEEL_SHA256={args.sha256}\n")
    preflight = {
        "vllm_from": "wheel",
        "compile": "none",
        "wheel": {"filename": args.filename, "url": args.url, "sha256": args.sha256},
        "why": "vLLM from upstream's wheel: nothing was compiled, so there was no preflight; check-binary judges its kernels",
    }
    (out / "vllm-preflight.json").write_text(json.dumps(preflight, indent=2) + "\n", encoding="utf-8")
    print(f"{built.name}: {len(found)} requirements; records in {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
