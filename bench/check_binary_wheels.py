"""check-binary on upstream's published vLLM wheels, judged kernel by kernel for the DGX Spark's GPU.

Reproduce with:
  .venv/bin/python bench/check_binary_wheels.py [--version 0.33.0] [--arch 12.1] [--out FILE.json.gz]
  .venv/bin/python bench/check_binary_wheels.py --table bench/results/check-binary-vllm-0.33.0-....json.gz

The first form downloads each manylinux wheel of the release (aarch64 and x86_64) from PyPI's simple
index once, kept only when its sha256 matches the index's ``#sha256=`` link (sparkbuild's cache,
``downloads/``), runs check-binary on it and writes the raw result, every kernel of every library
with its code and verdict, as gzipped JSON (default: bench/results/, named by release, date and
machine), then prints the Markdown table of docs/check-binary.md. The second prints the table again
from a saved result, reading nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.build import binaries  # noqa: E402
from sparkbuild.config.options import Options  # noqa: E402
from sparkbuild.errors import BinaryCheckError  # noqa: E402
from sparkbuild.upstream import sources  # noqa: E402
from sparkbuild.util import cmd, host  # noqa: E402

MACHINES = ("aarch64", "x86_64")


def wheel_name(version: str, machine: str) -> str:
    return f"vllm-{version}-cp38-abi3-manylinux_2_28_{machine}.whl"


def check_release(version: str, device: binaries.Arch, cache: Path) -> dict[str, Any]:
    links = sources.index_links("vllm", suffix=".whl")
    tool = binaries.cuobjdump()
    found: dict[str, Any] = {
        "release": version,
        "device": str(device),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.machine(), "cpu": host.read_cpu().model, "python": platform.python_version()},
        "cuobjdump": next(line for line in cmd.run([tool, "--version"], capture=True).stdout.splitlines() if "release" in line),
        "sparkbuild_commit": _commit(),
        "wheels": [],
    }
    for machine in MACHINES:
        name = wheel_name(version, machine)
        if name not in links:
            raise SystemExit(f"PyPI has no {name}; see {sources.simple_index()}vllm/")
        wheel = sources.fetch(links[name], cache / "downloads")
        start = time.monotonic()
        reports = binaries.check([wheel], device)
        try:
            binaries.require(reports, device)
            error = None
        except BinaryCheckError as exc:
            error = str(exc)
        found["wheels"].append(
            {
                "file": name,
                "sha256": links[name].sha256,
                "url": links[name].url,
                "seconds": round(time.monotonic() - start, 1),
                "ok": error is None,
                "error": error,
                # Paths inside the wheel: where the wheel was cached does not matter.
                "libraries": [{**r.to_json(), "path": str(r.path.relative_to(wheel))} for r in reports],
            }
        )
    return found


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{label} {n}" for label, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def table(result: dict[str, Any]) -> str:
    """Per wheel, per library with device code: kernels, how many run from a cubin (by which),
    from PTX (by which), how many are not for this GPU (by their code), how many fail."""
    lines = [
        f"check-binary {result['date'][:10]}, vLLM {result['release']}, GPU {result['device']}, "
        f"{result['cuobjdump']}, on {result['machine']['platform']} ({result['machine']['cpu']})",
        "",
    ]
    for wheel in result["wheels"]:
        verdict = "passes" if wheel["ok"] else f"FAILS: {wheel['error']}"
        lines += [f"**{wheel['file']}** (sha256 `{wheel['sha256'][:16]}...`): {verdict}", ""]
        lines += [
            "| library | kernels | sm_121 code (cubin that runs) | JIT from PTX | not for this GPU | fails |",
            "|---|---:|---|---|---|---:|",
        ]
        no_code = []
        for lib in wheel["libraries"]:
            if lib["ok"] is None:
                no_code.append(lib["path"])
                continue
            c, runs = lib["counts"], lib["runs_with"]
            sass = {k: n for k, n in runs.items() if k.startswith("sm_")}
            ptx = {k: n for k, n in runs.items() if k.startswith("compute_")}
            lines.append(
                f"| `{lib['path']}` | {lib['kernels_total']} | {c['sass']} ({_counted(sass) or '-'}) | "
                f"{c['ptx']} ({_counted(ptx) or '-'}) | {c['other']} ({_counted(lib['other_archs']) or '-'}) | {c['fails']} |"
            )
        lines += ["", f"No device code: {', '.join(f'`{p}`' for p in no_code) or '-'}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="0.33.0", help="the vLLM release whose wheels to check")
    parser.add_argument("--arch", default="12.1", help="the GPU (compute capability) to judge for")
    parser.add_argument("--out", type=Path, help="where to write the raw result (.json.gz)")
    parser.add_argument("--table", type=Path, metavar="RESULT", help="print the table of a saved result and stop")
    args = parser.parse_args()
    if args.table:
        with gzip.open(args.table, "rt", encoding="utf-8") as saved:
            print(table(json.load(saved)))
        return
    result = check_release(args.version, binaries.Arch.parse(args.arch), Options.from_env().cache)
    day = result["date"][:10]
    out = args.out or ROOT / "bench" / "results" / f"check-binary-vllm-{args.version}-{day}-{platform.machine()}.json.gz"
    out.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same result gives the same bytes.
    with gzip.GzipFile(out, "wb", mtime=0) as raw:
        raw.write((json.dumps(result, indent=1) + "\n").encode())
    print(table(result))
    print(f"\nraw result: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
