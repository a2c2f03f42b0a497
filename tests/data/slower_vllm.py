"""Make an installed vLLM slower on purpose, in one known place; run inside an image at build time.

    python3 slower_vllm.py moe SECONDS     a sleep after the CPU MoE kernel call (cpu_fused_moe(...)
                                           in fused_moe/experts/cpu_moe.py): every MoE layer, every step
    python3 slower_vllm.py decode SECONDS  a sleep at the start of every step in which each request
                                           decodes one token (GPUModelRunner.execute_model, which the
                                           CPU model runner inherits): decode steps only, not prefill

Each edit finds its place in the source with ``ast`` and fails, naming the file, where that place is
not there exactly once: a vLLM that moved it must not give an image that is silently not slower.
Only the standard library: it runs on the image's own python3, without importing vLLM.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

FILES = {
    "moe": "model_executor/layers/fused_moe/experts/cpu_moe.py",
    "decode": "v1/worker/gpu_model_runner.py",
}
MARK = "# sparkbuild test: slower on purpose"


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")  # the package's folder, found without running it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("slower_vllm.py: no vllm package in this image")
    return Path(next(iter(spec.submodule_search_locations)))


def moe_place(tree: ast.Module) -> tuple[int, int]:
    """After the one ``cpu_fused_moe(...)`` statement: (line to insert before, its indent)."""
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "cpu_fused_moe"
    ]
    if len(calls) != 1:
        raise LookupError(f"{len(calls)} cpu_fused_moe(...) call statements, not 1")
    (call,) = calls
    assert call.end_lineno is not None
    return call.end_lineno + 1, call.col_offset


def decode_place(tree: ast.Module) -> tuple[int, int]:
    """The first statement of ``GPUModelRunner.execute_model``: (its line, its indent)."""
    found = [
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "GPUModelRunner"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "execute_model"
    ]
    if len(found) != 1 or [a.arg for a in found[0].args.args[:2]] != ["self", "scheduler_output"]:
        raise LookupError("no GPUModelRunner.execute_model(self, scheduler_output, ...)")
    first = found[0].body[0]
    return first.lineno, first.col_offset


def sleep_line(kind: str, seconds: float) -> str:
    if kind == "moe":
        return f'__import__("time").sleep({seconds})  {MARK}'
    # Every scheduled request takes one token: a decode step (a prefill step schedules its prompt).
    decoding = "scheduler_output.num_scheduled_tokens and max(scheduler_output.num_scheduled_tokens.values()) == 1"
    return f'if {decoding}: __import__("time").sleep({seconds})  {MARK}'


def main() -> None:
    kind, seconds = sys.argv[1], float(sys.argv[2])
    path = vllm_root() / FILES[kind]
    text = path.read_text()
    try:
        line, indent = (moe_place if kind == "moe" else decode_place)(ast.parse(text))
    except LookupError as exc:
        sys.exit(f"slower_vllm.py: {path}: {exc}; this vLLM's source moved, update tests/data/slower_vllm.py")
    lines = text.splitlines(keepends=True)
    lines.insert(line - 1, " " * indent + sleep_line(kind, seconds) + "\n")
    path.write_text("".join(lines))
    ast.parse(path.read_text())  # still Python
    print(f"slower_vllm.py: {path}:{line}: {lines[line - 1].strip()}")


if __name__ == "__main__":
    main()
