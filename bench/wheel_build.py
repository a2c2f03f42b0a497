"""Time a Spark target's rehearsal from nothing to a checked image, built from upstream's wheel and
built from source, one beside the other.

Reproduce with:  .venv/bin/python bench/wheel_build.py [--out bench/results/wheel-build.json] [--keep]

The shipped vllm-0.33.0-cu130-sm121 target (no patch), rehearsed with ``sparkbuild rehearse
--offline`` from one matrix that holds it twice: ``vllm_from: wheel`` (upstream's x86_64 wheel here, the
real kernels; no compile) and ``vllm_from: source`` (preflight, and the rehearsal's Python-only wheel in
place of the kernel compile). Each run ends with a checked image: the runtime stage's image check
(the wheel's compiled modules imported), and for the wheel check-binary on the image's extensions.

"From nothing", for each run:

- every stage is built anew: the run uses a copy of the Spark templates (``SPARKBUILD_DOCKERFILES``)
  with a ``LABEL`` holding a fresh nonce after each ``FROM``, so no layer of BuildKit's cache matches
  any stage (FlashInfer's, vLLM's, the runtime, and the build environment they share);
- sparkbuild's cache is a new folder: the sdists are downloaded and the offline git repositories made
  again, and for the wheel, upstream's wheel is pinned for real (PyPI's index, the download checked by
  sha256, check-binary for GPU 12.1);

kept: the bases (Debian trixie with CUDA from NVIDIA's PyPI wheels, made once; a runner pulls NVIDIA's
images), and BuildKit's cache mounts (pip's download cache and ccache, which a runner keeps too; no
patched unit is compiled here). Each run's images are removed after it (``--keep`` keeps them).

On the runner the source build compiles vLLM's kernels (about an hour on a Spark, three when cold),
which a rehearsal swaps for preflight: these figures compare what both modes share plus preflight,
not the compile. Wall-clock numbers on a shared machine: compare only runs on the same machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.util import host  # noqa: E402

TARGET = "vllm-0.33.0-cu130-sm121"
MODES = ("wheel", "source")


def matrix(folder: Path) -> Path:
    """The shipped matrix with its 0.33.0 target once per mode (ids ``<target>-<mode>``)."""
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    index = next(i for i, t in enumerate(data["targets"]) if t.get("id") == TARGET)
    shipped = data["targets"].pop(index)
    data["targets"][index:index] = [{**shipped, "id": f"{TARGET}-{mode}", "vllm_from": mode} for mode in MODES]
    data["patches_dir"] = str(ROOT / "patches")
    path = folder / "matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def templates(folder: Path, nonce: str) -> Path:
    """A copy of the packaged templates with a LABEL of ``nonce`` after every FROM of the Spark profile."""
    copy = folder / f"dockerfiles-{nonce}"
    shutil.copytree(ROOT / "dockerfiles", copy)
    for path in (copy / "spark").glob("*.j2"):
        text = path.read_text()
        text = re.sub(r"^(FROM [^\n]+)$", rf'\1\nLABEL io.sparkbuild.bench="{nonce}"', text, flags=re.MULTILINE)
        path.write_text(text)
    return copy


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def run_mode(mode: str, path: Path, work: Path, keep: bool) -> dict[str, Any]:
    nonce = uuid.uuid4().hex[:12]
    env = {
        **os.environ,
        "SPARKBUILD_DOCKERFILES": str(templates(work, nonce)),
        "SPARKBUILD_CACHE": str(work / f"cache-{mode}"),
        "SPARKBUILD_OUT": str(work / f"out-{mode}"),
    }
    only = f"{TARGET}-{mode}"
    args = [sys.executable, "-m", "sparkbuild", "rehearse", "--offline", "--json", "--matrix", str(path), "--only", only]
    print("+ " + " ".join(args), file=sys.stderr, flush=True)
    load = uptime()
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    (work / f"rehearse-{mode}.log").write_text(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{mode}: rehearse failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    (result,) = json.loads(done.stdout)
    inspect = ["docker", "image", "inspect", "--format", "{{.Size}}", result["image"]]
    size = subprocess.run(inspect, capture_output=True, text=True, check=False)
    found = {
        "mode": mode,
        "total_s": round(seconds, 1),
        "nonce": nonce,
        "uptime_before": load,
        "uptime_after": uptime(),
        "kernels": result["kernels"],
        "why": result["vllm_from"]["why"],
        "stages": result["stages"],
        "preflight_units": None if result["preflight"] is None else len(result["preflight"]["units"]),
        "check_binary_libraries": None if result["check_binary"] is None else len(result["check_binary"]["libraries"]),
        "image_bytes": int(size.stdout.strip() or 0),
        "pinned_in_s": _pinned_seconds(done.stderr),
    }
    if not keep:
        refs = [s["ref"] for s in result["stages"]]
        subprocess.run(["docker", "image", "rm", *refs], capture_output=True, check=False)
    return found


def _pinned_seconds(log: str) -> str | None:
    """How long pinning upstream's wheel took: the rehearsal logs the step with its time."""
    match = re.search(r"<== Upstream's vLLM \S+ wheel for \S+ \(the rehearsal's platform\): done in (\S+)", log)
    return match.group(1) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "wheel-build.json")
    parser.add_argument("--keep", action="store_true", help="keep each run's images")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-wheel-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        path = matrix(work)
        runs = [run_mode(mode, path, work, args.keep) for mode in MODES]
    cpu = host.read_cpu()
    result = {
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.machine(), "cpu": cpu.model, "cores": os.cpu_count()},
        "target": TARGET,
        "nothing": "every stage layer built anew (a nonce LABEL after each FROM), a new sparkbuild cache; bases and "
        "BuildKit cache mounts (pip, ccache) kept",
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<8} {'total':>8}  stages")
    for r in runs:
        stages = ", ".join(f"{s['stage']} {s['seconds']:.0f}s" for s in r["stages"])
        print(f"{r['mode']:<8} {r['total_s']:>7.0f}s  {stages}  (kernels: {r['kernels']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
