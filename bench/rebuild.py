"""Time the rehearsal's rebuild of a Spark target after a one-file change in vLLM: what a runner pays
when a nightly meets one new upstream commit, or a one-patch fix is pushed.

Reproduce with:  .venv/bin/python bench/rebuild.py [--only vllm-0.33.0-cu130-sm121] [--out FILE]

Offline sources (PyPI sdists, stand-ins; see `sparkbuild rehearse --offline`). First the target is
rehearsed as it is (untimed unless nothing was built before: it fills BuildKit's cache and ccache).
Then one kernel file is changed (a line in ``csrc/quantization/fp4/nvfp4_quant_entry.cu``, a unit
preflight compiles because it includes a patched header), committed anew, and the whole rehearsal
runs again, timed: the source stage, preflight (configure, the changed unit compiled, the others
ccache hits), the vLLM stage, and the runtime stage, where only the vLLM wheel's layer is new.
Prints each stage's time and action, and the runtime image's layers with their sizes.

Wall-clock numbers: compare only runs on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.build import build  # noqa: E402
from sparkbuild.config.options import Options  # noqa: E402
from sparkbuild.lanes import offline, rehearse  # noqa: E402
from sparkbuild.oci.engine import Engine  # noqa: E402
from sparkbuild.plan import plan  # noqa: E402
from sparkbuild.plan.matrix import Matrix  # noqa: E402
from sparkbuild.upstream import gitrepo, sources  # noqa: E402

CHANGED = "csrc/quantization/fp4/nvfp4_quant_entry.cu"


def changed_commit(found: offline.Sources, version: str, opts: Options) -> offline.Sources:
    """The vLLM sdist's tree with one more line in one kernel file, committed to a repository of its own."""
    stamp = time.time_ns()
    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-") as tmp:
        tree = Path(tmp) / "vllm"
        shutil.copytree(sources.vllm_sdist(version, opts.cache), tree, symlinks=True)
        with (tree / CHANGED).open("a", encoding="utf-8") as unit:
            unit.write(f"\n// bench/rebuild.py {stamp}\n")
        name = f"bench-vllm-{stamp}.git"
        commit = gitrepo.commit_tree(tree, found.root / name, f"vLLM {version} + a line in {CHANGED} ({stamp})")
    return dataclasses.replace(found, vllm=dataclasses.replace(found.vllm, name=name, commit=commit))


def rehearsal(m: Matrix, target_id: str, opts: Options, engine: Engine, url: str, *, change: bool) -> dict[str, object]:
    (target,) = [t for t in m.targets if t.id == target_id]
    rehearsed = rehearse.rehearsal_target(target, m)
    found = offline.prepare(rehearsed, opts.cache)
    if change:
        found = changed_commit(found, target.vllm.version, opts)
    p = plan.plan_target(found.apply(rehearsed), m.patch_folders, opts)
    p = dataclasses.replace(p, git_insteadof=f"{url}/={offline.URL}/")
    start = time.perf_counter()
    try:
        report = build.run_preflight(engine, p, opts)
        preflight_s = time.perf_counter() - start
        report.require()
        outcome = build.build(engine, p, opts, check_first=False)
    finally:
        if change:
            shutil.rmtree(found.root / found.vllm.name)
    return {
        "total_s": round(time.perf_counter() - start, 1),
        "preflight_s": round(preflight_s, 1),
        "preflight_compiled": {Path(c.file).name: c.seconds for c in report.compiled},
        "stages": [s.to_json() for s in outcome.stages],
        "image": outcome.image,
    }


def layers(image: str) -> list[dict[str, str]]:
    """The image's layers, newest first: size and the instruction that made it."""
    out = subprocess.run(
        ["docker", "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split("\t", 1) for line in out.splitlines()]
    return [{"size": size, "step": step.split("/bin/sh -c ")[-1][:120]} for size, step in rows if size != "0B"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="vllm-0.33.0-cu130-sm121")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    opts = Options.from_env(only=(args.only,))
    engine = Engine()
    m = plan.load_matrix(opts)
    with gitrepo.daemon(opts.cache / "offline") as url:
        before = rehearsal(m, args.only, opts, engine, url, change=False)
        after = rehearsal(m, args.only, opts, engine, url, change=True)
    result = {
        "target": args.only,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "changed": CHANGED,
        "unchanged_rehearsal": before,
        "after_one_file_change": after,
        "runtime_layers": layers(str(after["image"])),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
