"""Time a Spark target's preflight verdict here: the runtime's aarch64 closure, then the vLLM stage's
preflight (vLLM's configure for the arch list, the audit, the patched units compiled and checked).

Reproduce with:  .venv/bin/python bench/preflight.py [--only vllm-0.33.0-cu130-sm121] [--runs 3] [--cold] [--out FILE]

Offline sources (PyPI sdists, stand-ins; see `sparkbuild rehearse --offline`), on the rehearsal's
bases, which must exist (one `sparkbuild rehearse --offline` makes them). Every timed run is of a
vLLM commit no earlier run built: the sdist's tree plus one line in its README, committed anew, as a
nightly meets a new upstream commit, so BuildKit cannot answer the preflight from its cache.

- warm (default): the build environment (toolchain, torch, build requirements) is in BuildKit's
  cache, ccache's mount holds the patched units, uv's cache the closure's metadata: the nightly's case.
- --cold: before each run, all of BuildKit's cache (layers and cache mounts: pip's downloads,
  ccache) and uv's cache are cleared, so the build environment is made again, torch downloaded
  again, every patched unit compiled from scratch: a runner's first preflight (the bases stay,
  made once per CUDA version).

Each figure is the median of --runs runs. Wall-clock numbers: compare only runs on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from uv import find_uv_bin  # noqa: E402

from sparkbuild.build import build, closure  # noqa: E402
from sparkbuild.config.options import Options  # noqa: E402
from sparkbuild.lanes import offline, rehearse  # noqa: E402
from sparkbuild.oci.engine import Engine  # noqa: E402
from sparkbuild.plan import plan  # noqa: E402
from sparkbuild.plan.matrix import Matrix  # noqa: E402
from sparkbuild.upstream import gitrepo, sources  # noqa: E402
from sparkbuild.util import cmd  # noqa: E402


def clear_caches() -> None:
    cmd.run(["docker", "builder", "prune", "--all", "--force"], capture=True)
    # uv's own command, so UV_CACHE_DIR is honoured and a cache that cannot be removed is an error.
    cmd.run([find_uv_bin(), "cache", "clean"], capture=True)


def new_commit(found: offline.Sources, version: str, opts: Options) -> offline.Sources:
    """The vLLM sdist's tree with one more README line, committed to a repository of its own."""
    stamp = time.time_ns()
    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-") as tmp:
        tree = Path(tmp) / "vllm"
        shutil.copytree(sources.vllm_sdist(version, opts.cache), tree, symlinks=True)
        with (tree / "README.md").open("a", encoding="utf-8") as readme:
            readme.write(f"\nbench/preflight.py {stamp}\n")
        name = f"bench-vllm-{stamp}.git"
        commit = gitrepo.commit_tree(tree, found.root / name, f"vLLM {version} + a README line ({stamp})")
    return dataclasses.replace(found, vllm=dataclasses.replace(found.vllm, name=name, commit=commit))


def one(m: Matrix, target_id: str, opts: Options, engine: Engine, url: str) -> dict[str, float]:
    (target,) = [t for t in m.targets if t.id == target_id]
    rehearsed = rehearse.rehearsal_target(target, m)
    found = new_commit(offline.prepare(rehearsed, opts.cache), target.vllm.version, opts)
    rehearsed = found.apply(rehearsed)
    start = time.perf_counter()
    verdict = closure.check(
        dataclasses.replace(target, relax=m.rehearsal.relax), sources.vllm_sdist(target.vllm.version, opts.cache), opts
    )
    closure_s = time.perf_counter() - start
    p = plan.plan_target(rehearsed, m.patch_folders, opts)
    p = dataclasses.replace(p, git_insteadof=f"{url}/={offline.URL}/")
    start = time.perf_counter()
    try:
        report = build.run_preflight(engine, p, opts)
    finally:
        shutil.rmtree(found.root / found.vllm.name)
    preflight_s = time.perf_counter() - start
    assert verdict.ok and report.ok, (verdict.text(), report.text())
    return {"closure_s": closure_s, "preflight_s": preflight_s, "total_s": closure_s + preflight_s}


def emit(result: dict[str, object], out: Path | None) -> None:
    """A bench's result: printed, and written to ``out`` where one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="vllm-0.33.0-cu130-sm121")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="clear BuildKit's cache and uv's before each run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    opts = Options.from_env(only=(args.only,))
    engine = Engine()
    m = plan.load_matrix(opts)
    runs = []
    with gitrepo.daemon(opts.cache / "offline") as url:
        if not args.cold:
            one(m, args.only, opts, engine, url)  # untimed: fills the caches a warm run has
        for _ in range(args.runs):
            if args.cold:
                clear_caches()
            runs.append(one(m, args.only, opts, engine, url))
    result = {
        "target": args.only,
        "cold": args.cold,
        "runs": args.runs,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        **{key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]},
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
