"""Time a cold and a no-op local nightly, and record the image's verify benchmark.

Reproduce with:  .venv/bin/python bench/nightly.py [--out bench/results/nightly.json]

The first run uses a fresh cache and registry (the base image and BuildKit's layer cache stay in
the Docker engine, so "cold" means cold for sparkbuild, not for the engine); the second run has
nothing to do. Wall-clock numbers: compare only runs on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def nightly(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sparkbuild", "nightly", "--profile", "local"], env=env, cwd=ROOT, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nightly.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-") as tmp:
        env = {**os.environ, "SPARKBUILD_CACHE": f"{tmp}/cache", "SPARKBUILD_OUT": f"{tmp}/out", "SPARKBUILD_REGISTRY": ""}
        first, second = nightly(env), nightly(env)
        verify = json.loads(next(Path(tmp, "out").glob("*/verify.json")).read_text())
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "arch": platform.machine()},
        "first_nightly_s": round(first, 1),
        "second_nightly_s": round(second, 2),
        "server_startup_s": round(verify["startup_s"], 1),
        "bench": verify["bench"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
