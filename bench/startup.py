"""Start-up: the import time of each of sparkbuild's modules, and a local nightly with nothing to do.

Reproduce with:  .venv/bin/python bench/startup.py [--runs 5] [--cache DIR] [--out bench/results/startup.json]
                 .venv/bin/python bench/startup.py --imports-only   (no Docker needed)
                 .venv/bin/python bench/startup.py --nightly-only

- Imports: each module is imported in a new process under ``python -X importtime``; its figure is
  the median over --runs of the cumulative microseconds importtime reports for it (the module and
  everything it loads first). The slowest third-party packages a no-op nightly loads are listed too.
- The no-op nightly is the README's first command run a second time: ``sparkbuild nightly --profile
  local`` with the cache in --cache (default: a folder of its own under ~/.cache, its check models
  shared with sparkbuild's own model cache). One untimed nightly first makes the cache what a second
  run finds (it builds, verifies and publishes what it must: minutes the first time). Then --runs
  more, each timed (wall time, the CPU time of the process), and --runs under importtime for the
  part of it spent importing.

Wall-clock numbers: compare only runs on the same machine; the machine is recorded with them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sparkbuild  # noqa: E402
from sparkbuild.config import options  # noqa: E402
from sparkbuild.util import host  # noqa: E402

PACKAGE = sparkbuild.__name__
_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s+)(\S+)$")


def modules() -> list[str]:
    """Every module of the package (the scripts that run inside images included), by dotted name."""
    package = Path(sparkbuild.__file__).resolve().parent
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__main__" or ("resources" in parts and parts[-1] != "packaged"):
            continue  # an entry point runs when imported; resources' scripts run in images, with vLLM
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def importtime(stderr: str) -> dict[str, tuple[int, int]]:
    """importtime's lines: module -> (cumulative us, indentation), the first time each is named."""
    found: dict[str, tuple[int, int]] = {}
    for line in stderr.splitlines():
        m = _LINE.match(line)
        if m and m.group(4) not in found:
            found[m.group(4)] = (int(m.group(2)), len(m.group(3)))
    return found


def module_import_us(name: str, runs: int) -> int:
    times = []
    for _ in range(runs):
        args = [sys.executable, "-X", "importtime", "-c", f"import {name}"]
        done = subprocess.run(args, capture_output=True, text=True, check=True)
        times.append(importtime(done.stderr)[name][0])
    return int(statistics.median(times))


def nightly(env: dict[str, str], profile: bool) -> tuple[float, float, str]:
    """(wall s, CPU s of the process, its stderr) of one local nightly."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    args = [sys.executable, *(("-X", "importtime") if profile else ()), "-m", PACKAGE, "nightly", "--profile", "local"]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the nightly failed with exit {done.returncode}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stderr


def top_level_us(found: dict[str, tuple[int, int]]) -> int:
    """What importing cost in all: the sum of the outermost imports (importtime's least indented)."""
    least = min(indent for _, indent in found.values())
    return sum(us for us, indent in found.values() if indent == least)


def heaviest_packages(found: dict[str, tuple[int, int]], count: int = 12) -> dict[str, float]:
    """The third-party packages with the most cumulative import time, in ms (top-level names only)."""
    third = {name: us for name, (us, _) in found.items() if "." not in name and name != PACKAGE and not _stdlib(name)}
    return {name: round(us / 1000, 1) for name, us in sorted(third.items(), key=lambda kv: -kv[1])[:count]}


def _stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names or name.startswith("_")


def machine() -> dict[str, object]:
    cpu = host.read_cpu()
    memory = host.memory_gb()
    return {
        "arch": platform.machine(),
        "cpu": cpu.model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gb": round(memory, 1) if memory else None,
        "python": platform.python_version(),
        # False under PYTHONDONTWRITEBYTECODE: every run compiles sparkbuild's own sources (tens of ms).
        "bytecode_cached": not sys.flags.dont_write_bytecode,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=options.default_cache().with_name("sparkbuild-bench-startup"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup.json")
    parser.add_argument("--imports-only", action="store_true", help="only the import time of each module")
    parser.add_argument("--nightly-only", action="store_true", help="only the no-op nightly")
    args = parser.parse_args()

    result: dict[str, object] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(),
        "command": " ".join(sys.argv[1:]) or "(defaults)",
    }
    if not args.nightly_only:
        per_module = {name: module_import_us(name, args.runs) for name in modules()}
        result["import_ms"] = {name: round(us / 1000, 1) for name, us in sorted(per_module.items(), key=lambda kv: -kv[1])}
    if not args.imports_only:
        models = options.default_cache() / "models"
        args.cache.mkdir(parents=True, exist_ok=True)
        if not (args.cache / "models").exists():
            models.mkdir(parents=True, exist_ok=True)
            (args.cache / "models").symlink_to(models)
        env = {**os.environ, "SPARKBUILD_CACHE": str(args.cache), "SPARKBUILD_OUT": str(args.cache / "out")}
        env["SPARKBUILD_REGISTRY"] = ""  # the embedded registry, in the cache
        nightly(env, profile=False)  # makes the cache what a second run finds
        runs = [nightly(env, profile=False) for _ in range(args.runs)]
        # Timed apart: importtime's own bookkeeping would add to the wall time.
        imports = [importtime(nightly(env, profile=True)[2]) for _ in range(args.runs)]
        result["noop_nightly"] = {
            "runs": args.runs,
            "wall_s_median": round(statistics.median(wall for wall, _, _ in runs), 2),
            "wall_s": [round(wall, 2) for wall, _, _ in runs],
            "cpu_s_median": round(statistics.median(cpu for _, cpu, _ in runs), 2),
            "import_s_median": round(statistics.median(top_level_us(found) for found in imports) / 1e6, 2),
            "heaviest_packages_ms": heaviest_packages(imports[-1]),
            "modules_loaded": sorted(name for name in imports[-1] if name.split(".")[0] == PACKAGE),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
