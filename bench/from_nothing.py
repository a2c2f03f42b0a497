"""Time a Spark target's rehearsal from nothing to a checked image, once from upstream's wheel and
once from source, each in an engine and a cache that hold nothing.

Reproduce with (as root, since it starts its own Docker engine):

    .venv/bin/python bench/from_nothing.py [--mode wheel|source|both] [--root /var/lib/sparkbuild-bench]
                                           [--out bench/results/from-nothing.json] [--keep]

"From nothing" is a fresh machine's first `sparkbuild rehearse --offline`: for each mode the bench
starts a private Docker engine (``dockerd`` with its own data root, exec root and socket under
``--root``; the user's engine is neither read nor written) and gives sparkbuild an empty cache
(``XDG_CACHE_HOME``: no sdist, wheel, debootstrap root, uv resolve or model). The run makes the
bases (debootstrap and NVIDIA's CUDA wheels), the build environment (toolchain, torch), FlashInfer's
stage, vLLM's stage (source: its sources, preflight's configure and the rehearsal's Python-only wheel;
wheel: upstream's wheel pinned by sha256 and check-binary, then repacked with the patch set), the
runtime (its ~9 GB of wheels downloaded into an empty pip cache), the image check and check-binary of
the image. The engine is stopped and its files removed after each mode (``--keep`` keeps them), so
the second mode starts from nothing too.

The shipped ``vllm-0.33.0-cu130-sm121`` target, once per mode, from ``bench/wheel_build.py``'s matrix.
What a rehearsal swaps (docs/spark.md): the platform (x86_64 for aarch64) and, for the source build,
the kernel compile (about an hour on a Spark, three when cold) for a Python-only wheel: so here the
source build is not the slower one; on the runner it is, by that compile.

Why a private engine rather than emptying the user's: the user's images and BuildKit records stay
as they were. It needs the disk for one mode at a time (the bench records the peak: about 20 GB).
Wall-clock figures on a shared machine: compare only runs on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import wheel_build  # noqa: E402

from sparkbuild.util import host  # noqa: E402

DOCKER = "/usr/bin/docker"


@contextlib.contextmanager
def private_engine(root: Path) -> Iterator[str]:
    """A Docker engine of its own under ``root``; yields its ``DOCKER_HOST``. Always stopped."""
    exec_root = root / "x"  # the containerd socket under it must fit a unix socket's 108 bytes
    sock = root / "docker.sock"
    args = [
        "dockerd", "--data-root", str(root / "data"), "--exec-root", str(exec_root),
        "--pidfile", str(root / "docker.pid"), "-H", f"unix://{sock}",
        "--bridge=none", "--iptables=false", "--ip-masq=false",
    ]  # fmt: skip
    print("+ " + " ".join(args), file=sys.stderr, flush=True)
    with (root / "dockerd.log").open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    address = f"unix://{sock}"
    try:
        wait_ready(address, proc, root / "dockerd.log")
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(address: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    for _ in range(120):
        if proc.poll() is not None:
            raise SystemExit(f"the private engine exited ({proc.returncode}); see {log}")
        probe = subprocess.run([DOCKER, "-H", address, "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return
        time.sleep(0.5)
    raise SystemExit(f"the private engine did not answer within 60 s; see {log}")


class DiskPeak:
    """The most the file system under ``path`` had in use while the run went, sampled every 5 s."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = self.used()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def used(self) -> int:
        usage = shutil.disk_usage(self.path)
        return usage.total - usage.free

    def _watch(self) -> None:
        while not self._stop.wait(5):
            self.peak = max(self.peak, self.used())

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())


def du(path: Path) -> int:
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def run_mode(mode: str, matrix: Path, root: Path, keep: bool) -> dict[str, Any]:
    work = root / mode
    if work.exists():
        raise SystemExit(f"{work} exists: remove it (it holds an earlier run's engine) or pass another --root")
    work.mkdir(parents=True)
    try:
        with private_engine(work) as address, DiskPeak(work) as disk:
            return rehearse(mode, matrix, work, address, disk)
    finally:
        if not keep:
            shutil.rmtree(work)


def rehearse(mode: str, matrix: Path, work: Path, address: str, disk: DiskPeak) -> dict[str, Any]:
    env = {
        **os.environ,
        "DOCKER_HOST": address,
        "XDG_CACHE_HOME": str(work / "cache"),
        "SPARKBUILD_OUT": str(work / "out"),
    }
    env.pop("SPARKBUILD_DOCKERFILES", None)
    args = [sys.executable, "-m", "sparkbuild", "rehearse", "--offline", "--json", "--matrix", str(matrix)]
    args += ["--only", f"{wheel_build.TARGET}-{mode}"]
    print("+ " + " ".join(args), file=sys.stderr, flush=True)
    log = work.parent / f"rehearse-{mode}.log"
    print(f"  its log, as it goes: {log}", file=sys.stderr, flush=True)
    load = wheel_build.uptime()
    start = time.perf_counter()
    with log.open("w") as stream:
        done = subprocess.run(args, stdout=subprocess.PIPE, stderr=stream, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode}: rehearse failed (exit {done.returncode}); see {log}")
    (result,) = json.loads(done.stdout)
    inspect = [DOCKER, "-H", address, "image", "inspect", "--format", "{{.Size}}", result["image"]]
    size = subprocess.run(inspect, capture_output=True, text=True, check=True)
    return {
        "mode": mode,
        "total_s": round(seconds, 1),
        "uptime_before": load,
        "uptime_after": wheel_build.uptime(),
        **wheel_build.figures(result, log.read_text()),
        "image_bytes": int(size.stdout.strip()),
        "engine_bytes": du(work / "data"),
        "cache_bytes": du(work / "cache"),
        "disk_peak_bytes": disk.peak - disk.start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("wheel", "source", "both"), default="both")
    parser.add_argument("--root", type=Path, default=Path("/var/lib/sparkbuild-bench"), help="where the private engines live")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "from-nothing.json")
    parser.add_argument("--keep", action="store_true", help="keep each mode's engine and cache")
    args = parser.parse_args()
    # A stopped bench stops its engine too: SIGTERM unwinds like Ctrl-C, through each `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if shutil.which("dockerd") is None:
        raise SystemExit("the bench starts its own engine and needs dockerd: apt-get install docker.io")
    modes = wheel_build.MODES if args.mode == "both" else (args.mode,)
    args.root.mkdir(parents=True, exist_ok=True)
    path = wheel_build.matrix(args.root)
    cpu = host.read_cpu()
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.machine(), "cpu": cpu.model, "cores": os.cpu_count()},
        "target": wheel_build.TARGET,
        "from": "a private Docker engine with no image and no BuildKit record, and an empty XDG_CACHE_HOME",
        "runs": [],
    }
    runs: list[dict[str, Any]] = result["runs"]
    for mode in modes:
        runs.append(run_mode(mode, path, args.root, args.keep))
        # Written after each mode: a later mode that fails leaves the earlier one's figures.
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<8} {'total':>8} {'disk':>7}  stages")
    for r in runs:
        stages = ", ".join(f"{s['stage']} {s['seconds']:.0f}s" for s in r["stages"])
        peak = r["disk_peak_bytes"] / 1e9
        print(f"{r['mode']:<8} {r['total_s']:>7.0f}s {peak:>5.1f}GB  {stages}  (kernels: {r['kernels']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
