"""The head node of a Ray cluster serving one model: vLLM's documented Ray launch, in one process.

vLLM's multi-node serving with Ray (its ``examples/online_serving/run_cluster.sh``): every node runs
``ray start``, the head with ``--head``, every other node with ``--address HEAD:PORT``; once the cluster
has every node, ``vllm serve ... --tensor-parallel-size N --distributed-executor-backend ray`` runs on
the head. This program is the head's container: it starts Ray's head (its daemons go on after it), waits
until every node has joined, bounded, then becomes the serve command (``execvp``), so the container's
main process is the server, its log the container's, as with one node.

Runs in the image's own Python, mounted there read-only by sparkbuild (images built before it work), as
``python3 ray_head.py NODES WAIT_S -- RAY_START_ARGS... -- SERVE_COMMAND...``. Standard library and Ray
only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

# The README's exit codes: invalid input, and a step that failed (this runs in the image, without
# sparkbuild.errors).
USAGE = 2
FAILED = 4
# How often the head counts the nodes that joined.
POLL_S = 2.0


def parse(argv: list[str]) -> tuple[int, float, list[str], list[str]]:
    """``NODES WAIT_S -- RAY_START_ARGS -- SERVE_COMMAND``."""
    try:
        first = argv.index("--")
        second = argv.index("--", first + 1)
        nodes, wait_s = int(argv[0]), float(argv[1])
    except (ValueError, IndexError):
        raise SystemExit(f"usage: ray_head.py NODES WAIT_S -- RAY_START_ARGS... -- SERVE_COMMAND... (got {argv})") from None
    start, serve = argv[first + 1 : second], argv[second + 1 :]
    if nodes < 1 or not serve:
        raise SystemExit(f"usage: ray_head.py NODES WAIT_S -- RAY_START_ARGS... -- SERVE_COMMAND... (got {argv})")
    return nodes, wait_s, start, serve


def joined() -> dict[str, float]:
    """The cluster's live nodes, asked of Ray's own state (as the driver vLLM will be): each node's address
    and the GPUs Ray sees there, where vLLM places its ranks."""
    import ray  # the image's Ray: imported here, so the usage error above needs none

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    try:
        alive = [node for node in ray.nodes() if node["Alive"]]
        return {str(node["NodeManagerAddress"]): float(node["Resources"].get("GPU", 0)) for node in alive}
    finally:
        ray.shutdown()


def wait_for(nodes: int, wait_s: float) -> dict[str, float]:
    """Every node joined with a GPU, or exit FAILED naming what is missing and where to look."""
    end = time.monotonic() + wait_s
    seen: dict[str, float] = {}
    while True:
        found = joined()
        if found != seen:
            listed = ", ".join(f"{where} ({gpus:g} GPU)" for where, gpus in sorted(found.items()))
            print(f"ray_head: {len(found)} of {nodes} nodes joined: {listed}", flush=True)
            seen = found
        without = sorted(where for where, gpus in found.items() if gpus < 1)
        if len(found) >= nodes and not without:
            return found
        if time.monotonic() >= end:
            print(f"ray_head: after {wait_s:g}s, {missing(nodes, found, without)}", file=sys.stderr, flush=True)
            raise SystemExit(FAILED)
        time.sleep(POLL_S)


def missing(nodes: int, found: dict[str, float], without: list[str]) -> str:
    """What kept the cluster from serving, and what to do."""
    if len(found) < nodes:
        return (
            f"only {len(found)} of {nodes} nodes joined the Ray cluster: every other node runs `ray start --address "
            "HEAD:PORT`; read its log for why it did not join"
        )
    return (
        f"no GPU in Ray's resources on {', '.join(without)}: vLLM places one rank on each node's GPU; start that "
        "node's container with its GPUs (docker run --gpus all)"
    )


def main(argv: list[str]) -> int:
    try:
        nodes, wait_s, start, serve = parse(argv)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return USAGE
    command = ["ray", "start", "--head", *start]
    print("+ " + " ".join(command), flush=True)
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        print(f"ray_head: `ray start --head` exited {done.returncode} (its output is above)", file=sys.stderr, flush=True)
        return FAILED
    wait_for(nodes, wait_s)
    print("+ " + " ".join(serve), flush=True)
    os.execvp(serve[0], serve)  # noqa: S606 - an argument list, never a shell string
    return FAILED  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
