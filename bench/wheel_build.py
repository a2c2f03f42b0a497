"""Time a Spark target's rehearsal to a checked image, built from upstream's wheel and built from
source, one beside the other, each from nothing of what depends on vLLM.

Reproduce with:  .venv/bin/python bench/wheel_build.py [--out bench/results/wheel-build.json] [--keep]

The shipped vllm-0.33.0-cu130-sm121 target (no patch), rehearsed with ``sparkbuild rehearse
--offline`` from one matrix that holds it twice: ``vllm_from: wheel`` (upstream's x86_64 wheel here,
the real kernels, no compile) and ``vllm_from: source`` (preflight, and the rehearsal's Python-only
wheel in place of the kernel compile). Each run ends with a checked image: the runtime stage's image
check (for the wheel: its 13 compiled modules imported), and for the wheel check-binary on the image's
extensions.

What each run builds anew, and what it keeps (the same in both modes):

- anew: everything that depends on vLLM or on the mode. A copy of the Spark templates
  (``SPARKBUILD_DOCKERFILES``) sets ``ENV BENCH_NONCE`` to a fresh value where that work starts, so
  no step of BuildKit's cache matches from there on (an ``ENV`` reaches every later ``RUN``; a
  ``LABEL`` changes only the image's config, and the steps after it would still be cache hits): the
  vllm stage after its source stage's system packages and, for the source build, after the build
  environment (vLLM's sources fetched, its build requirements, preflight, the wheel; or the wheel
  downloaded, checked and its records written), and the runtime stage after its dependency layer
  (ptxas, FlashInfer, the vLLM wheel, the image check), then check-binary. Pinning upstream's wheel
  (the index, the 320 MB download checked by sha256, check-binary for 12.1) is timed on its own,
  into an empty cache;
- kept: the bases, the build environment (toolchain and torch, which FlashInfer's stage shares),
  FlashInfer's stage, and the runtime's dependency layer (torch and vLLM's ~80 requirements, 8.7 GB:
  the same work in both modes when vLLM's requirements change, about 5 minutes here;
  measurements.md), and BuildKit's cache mounts (pip's downloads, ccache).

Why not all of it: a run from an empty build cache writes about 18 GB of layers per mode, and this
machine's disk holds the suite's images with ~15 GB to spare; what is kept is the same in both modes.

On the runner the source build compiles vLLM's kernels (about an hour on a Spark, three when cold),
which a rehearsal swaps for preflight: these figures compare what each mode does besides that compile.
Wall-clock numbers on a shared machine: compare only runs on the same machine.
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


# Where the work that depends on vLLM or the mode starts in each template: the nonce's ENV goes after it.
ANCHORS = {
    "40-vllm.Dockerfile.j2": ('{% include "_source.j2" %}', '{% include "_build.j2" %}'),
    "_vllm_wheel.j2": ('{% include "_source.j2" %}',),
    "90-runtime.Dockerfile.j2": ("    cp /tmp/vllm-requirements.txt /opt/sparkbuild/vllm-requirements.txt",),
}


def templates(folder: Path, nonce: str) -> Path:
    """A copy of the packaged templates with ``ENV BENCH_NONCE=<nonce>`` after each anchor."""
    copy = folder / f"dockerfiles-{nonce}"
    shutil.copytree(ROOT / "dockerfiles", copy)
    for name, anchors in ANCHORS.items():
        path = copy / "spark" / name
        text = path.read_text()
        for anchor in anchors:
            if text.count(anchor + "\n") != 1:
                raise SystemExit(f"{path}: the anchor {anchor!r} is not there once; update bench/wheel_build.py")
            text = text.replace(anchor + "\n", f'{anchor}\nENV BENCH_NONCE="{nonce}"\n')
        path.write_text(text)
    return copy


def pin_time() -> dict[str, Any]:
    """Pinning upstream's x86_64 0.33.0 wheel into an empty cache: the index, the download, check-binary."""
    from sparkbuild.lanes import upstream_wheel

    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-pin-") as tmp:
        start = time.perf_counter()
        found = upstream_wheel.pin("0.33.0", "linux/amd64", ("12.1",), python="3.13", glibc="2.41", cache=Path(tmp))
        seconds = time.perf_counter() - start
    verdict = found.check_binary["12.1"]
    return {"seconds": round(seconds, 1), "wheel": found.filename, "sha256": found.sha256, "check_binary": verdict.text()}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def run_mode(mode: str, path: Path, work: Path, keep: bool) -> dict[str, Any]:
    nonce = uuid.uuid4().hex[:12]
    env = {
        **os.environ,
        "SPARKBUILD_DOCKERFILES": str(templates(work, nonce)),
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
        **figures(result, done.stderr),
        "image_bytes": int(size.stdout.strip() or 0),
    }
    if not keep:
        # Only what this run built: a reused stage (FlashInfer's) is another build's.
        refs = [s["ref"] for s in result["stages"] if s["action"] == "built"]
        subprocess.run(["docker", "image", "rm", *refs], capture_output=True, check=False)
    return found


def figures(result: dict[str, Any], log: str) -> dict[str, Any]:
    """What one target's ``rehearse --json`` result and its log say of the run."""
    return {
        "kernels": result["kernels"],
        "why": result["vllm_from"]["why"],
        "stages": result["stages"],
        "preflight_units": None if result["preflight"] is None else len(result["preflight"]["units"]),
        "check_binary_libraries": None if result["check_binary"] is None else len(result["check_binary"]["libraries"]),
        # BuildKit's RUN steps of every build the run made (preflight, stages): run, or from its cache.
        "run_steps": run_steps(log),
    }


def run_steps(log: str) -> dict[str, int]:
    """How many RUN steps BuildKit ran and how many it took from its cache, from the builds' plain logs."""
    pending: set[str] = set()
    counts = {"ran": 0, "cached": 0}
    for line in log.splitlines():
        step = re.match(r"^#(\d+) (?:\[[^\]]*\] RUN |CACHED$|DONE )", line)
        if step is None:
            continue
        number = step.group(1)
        if " RUN " in line:
            pending.add(number)
        elif number in pending:
            pending.discard(number)
            counts["cached" if line.endswith("CACHED") else "ran"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "wheel-build.json")
    parser.add_argument("--keep", action="store_true", help="keep each run's images")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-wheel-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        path = matrix(work)
        pinned = pin_time()
        runs = [run_mode(mode, path, work, args.keep) for mode in MODES]
    cpu = host.read_cpu()
    result = {
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.machine(), "cpu": cpu.model, "cores": os.cpu_count()},
        "target": TARGET,
        "anew": "the vllm stage (after its source stage's packages; for source, after the build environment), the "
        "runtime after its dependency layer, check-binary; the wheel's pin into an empty cache",
        "kept": "bases, build environment (toolchain, torch), FlashInfer's stage, the runtime's dependency layer (8.7 GB), "
        "BuildKit's cache mounts",
        "pin": pinned,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<8} {'total':>8}  stages")
    for r in runs:
        stages = ", ".join(f"{s['stage']} {s['seconds']:.0f}s" for s in r["stages"])
        print(f"{r['mode']:<8} {r['total_s']:>7.0f}s  {stages}  (kernels: {r['kernels']})")
    print(f"pinning upstream's wheel (empty cache): {pinned['seconds']:.0f}s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
