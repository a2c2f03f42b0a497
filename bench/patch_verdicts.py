"""Time patch verdicts, warm: the command line's start, one release, and every release plus the
newest release candidate of a git remote (the whole support table).

Reproduce with:  .venv/bin/python bench/patch_verdicts.py [--remote URL] [--runs 5] [--out FILE]

Without --remote the candidate comes from a local git remote made here: the cached 0.33.0 tree
tagged v0.33.0, and one more commit tagged v0.34.0rc1 (GitHub is not reachable everywhere this
runs). One untimed run first fills the cache (sdists, the candidate's mirror); each figure is the
median of --runs runs, each a new process, as a user or CI runs it. Wall-clock numbers: compare only
runs on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THROUGH = "0.33.0"


def timed(args: list[str], runs: int, env: dict[str, str]) -> float:
    """Median wall time of ``args`` over ``runs`` runs, after one untimed run that warms the cache."""
    subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 2)


def local_remote(cache: Path, folder: Path) -> str:
    """A git remote with v0.33.0 (the cached tree) and v0.34.0rc1 on top."""
    sys.path.insert(0, str(ROOT))
    from sparkbuild import patch
    from sparkbuild.patch import releases

    tree = releases.tree(THROUGH, cache, releases.reads(patch.load(ROOT / "patches")))
    repo = folder / "vllm"
    shutil.copytree(tree, repo)
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "b@example.invalid"}
    env |= {"GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "b@example.invalid"}
    for args in (
        ["init", "--quiet", "--initial-branch=main"],
        ["add", "--all"],
        ["commit", "--quiet", "-m", "v0.33.0"],
        ["tag", "v0.33.0"],
        ["commit", "--quiet", "--allow-empty", "-m", "rc"],
        ["tag", "v0.34.0rc1"],
    ):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    return str(repo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--remote", help="git remote whose newest release candidate is checked (default: a local one)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "patch_verdicts.json")
    args = parser.parse_args()
    env = dict(os.environ)
    cache = Path(env.get("SPARKBUILD_CACHE") or Path.home() / ".cache" / "sparkbuild")
    sparkbuild = [sys.executable, "-m", "sparkbuild"]
    with tempfile.TemporaryDirectory(prefix="sparkbuild-bench-") as tmp:
        remote = args.remote or local_remote(cache, Path(tmp))
        table = [*sparkbuild, "patch", "table", "--through", THROUGH, "--candidate-from", remote]
        result = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "arch": platform.machine()},
            "runs": args.runs,
            "import_cli_s": timed([sys.executable, "-c", "import sparkbuild.cli"], args.runs, env),
            "check_one_release_s": timed([*sparkbuild, "patch", "check", "--vllm-version", THROUGH], args.runs, env),
            "table_every_release_s": timed([*sparkbuild, "patch", "table", "--through", THROUGH], args.runs, env),
            "table_every_release_and_candidate_s": timed(table, args.runs, env),
            "table_every_release_one_process_s": timed(
                [*sparkbuild, "patch", "table", "--through", THROUGH, "--jobs", "1"], args.runs, env
            ),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
