"""Runs several ``vllm bench serve`` argument lists in one Python process, inside the image under
test: ``python3 vllm_bench.py RUNS.json``, RUNS.json a list of argument lists (each starting with
``bench serve``).

Each list goes through exactly what the ``vllm bench serve`` command does (vLLM's own
``add_cli_args`` parser, then ``main``); one process for all of them saves the 10-20 s that each
new process spends importing vLLM and torch, which on a small model is most of a run's cost.
Mounted into the image by ``sparkbuild.verify.speed``; it runs on the image's Python, not sparkbuild's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run_all(path: str) -> None:
    runs = json.loads(Path(path).read_text())
    for argv in runs:
        if argv[:2] != ["bench", "serve"]:
            raise SystemExit(f"{path}: {argv[:2]} is not a `vllm bench serve` argument list")
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        print(f"+ vllm {' '.join(argv)}", flush=True)
        main(parser.parse_args(argv[2:]))


if __name__ == "__main__":
    run_all(sys.argv[1])
