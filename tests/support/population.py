"""The image's entrypoint judged over a population of users' ``docker run`` options (issue 38): each
through vLLM's own parser and engine config (tests/data/vllm_serve_population.py) as the user wrote it,
as the entrypoint runs it, and with the image's defaults but its graph sizes, and judged against vLLM
itself. tests/lanes/test_run.py runs it on vLLM 0.32 (the local image, its CPU platform: the refusals),
tests/lanes/test_rehearsal.py on vLLM 0.33 with a GB10 faked (the rehearsed wheel image: the graphs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.image import serve_defaults
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from tests.support import DATA, ROOT

SPARK = "vllm-0.33.0-cu130-sm121"

PROBE = DATA / "vllm_serve_population.py"
FAKES = ROOT / "sparkbuild" / "image" / "startup_probe.py"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
# What each option the user gives sets in vLLM's engine config (tests/data/vllm_serve_population.py).
SETS = {
    "--max-num-seqs": ("max_num_seqs",),
    "--max-model-len": ("max_model_len",),
    "--max-num-batched-tokens": ("max_num_batched_tokens",),
    "--gpu-memory-utilization": ("gpu_memory_utilization",),
    "--enforce-eager": ("enforce_eager",),
    "--optimization-level": ("optimization_level",),
    "--performance-mode": ("performance_mode",),
    "--speculative-config": ("speculative_method", "num_speculative_tokens"),
}
GRAPH_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "compilation_mode", "cudagraph_mode")


def spellings(option: str, *values: str) -> list[list[str]]:
    """``option`` as users write it: ``--opt V``, ``--opt_with_underscores V`` and, for one value, ``--opt=V``."""
    out = [[option, *values], ["--" + option[2:].replace("-", "_"), *values]]
    if len(values) == 1:
        out.append([f"{option}={values[0]}"])
    return out


def population() -> dict[str, list[str]]:
    """The options users pass that touch compilation, CUDA graphs, speculative decoding, memory,
    context length and performance modes, in each spelling, alone and as recipes combine them."""
    alone = [
        *spellings("--max-num-seqs", "64"),
        *spellings("--max-model-len", "64"),
        *spellings("--max-num-batched-tokens", "256"),
        *spellings("--gpu-memory-utilization", "0.5"),
        ["--enforce-eager"],
        ["--enforce_eager"],
        *spellings("--cudagraph-capture-sizes", "1", "2", "4", "8"),
        ["--cudagraph-capture-sizes=8"],
        *spellings("--max-cudagraph-capture-size", "64"),
        *spellings("--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8]})),
        ["-cc", json.dumps({"max_cudagraph_capture_size": 64})],
        ["-cc.cudagraph_mode=NONE"],
        ["--compilation-config.mode=0"],
        ["-O0"],
        ["-O", "3"],
        ["-O=2"],
        *spellings("--optimization-level", "1"),
        *spellings("--performance-mode", "interactivity"),
        ["--performance-mode", "throughput"],
        *spellings("--speculative-config", SPEC),
        ["-sc", SPEC],
        [
            "--speculative-config.method=ngram",
            "--speculative-config.num_speculative_tokens=2",
            "--speculative-config.prompt_lookup_max=4",
        ],
    ]
    recipes = [
        ["--max-num-seqs", "128", "--cudagraph-capture-sizes", "1", "2", "4", "8", "16"],
        ["--max-num-seqs", "8", "--max-cudagraph-capture-size", "16"],
        ["--max-num-seqs", "32", "--speculative-config", SPEC],
        ["--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "4"],
        ["-O3", "--max-num-seqs", "64", "--performance-mode", "throughput"],
        ["--max-num-batched-tokens", "512", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.6"],
        ["--performance-mode", "interactivity", "--max-num-seqs", "8"],
    ]
    return {" ".join(args): args for args in [*alone, *recipes]}


def options_of(args: list[str]) -> set[str]:
    return {name for arg in args if (name := serve_defaults.option_name(arg))}


def judged(case: dict[str, Any], known: set[str]) -> list[str]:
    """What is wrong with the entrypoint's run of one case: vLLM refused what it takes from the user
    alone, a value the user gave did not end in vLLM's config, or the image sized graphs the user sized."""
    user, entry, reference = case["user"], case["entrypoint"], case["reference"]
    if "error" in user:
        return []  # vLLM refuses it without the image too: no promise of the image's to judge
    if "error" in entry:
        return [f"vLLM refused the entrypoint's arguments {entry['args']}: {entry['error']}"]
    wrong = []
    given = options_of(user["args"]) & known
    for option in given:
        for field in SETS.get(option, ()):
            if entry["values"][field] != user["values"][field]:
                wrong.append(f"{field}: the user gave {user['values'][field]!r}, vLLM ended with {entry['values'][field]!r}")
    if given & serve_defaults.SIZES_GRAPHS:
        for field in GRAPH_FIELDS:
            if entry["values"][field] != reference["values"][field]:
                sized, made = reference["values"][field], entry["values"][field]
                wrong.append(f"{field}: vLLM sizes {sized!r} for these options, the image made it {made!r}")
    return wrong


def spark_runtime(out: Path) -> Path:
    """The Spark target's runtime stage context as sparkbuild renders it (its serve-defaults.json and
    the entrypoint's code), under ``out``."""
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", only=(SPARK,), cache=out / "cache"))
    return build.write_contexts(p, out)[-1]


def run(engine: Engine, image: str, runtime: Path, model: Path, folder: Path, *, gb10_stub: Path | None = None) -> dict[str, Any]:
    """The population through the vLLM of ``image`` (one container), with ``runtime``'s entrypoint code
    and serving defaults; with ``gb10_stub`` (a CUDA driver stub), vLLM configures for a GB10, faked."""
    files = [runtime / "serve_defaults.py", runtime / "serve-defaults.json", PROBE, FAKES]
    (folder / "cases.json").write_text(json.dumps([{"name": n, "args": a} for n, a in population().items()]))
    files.append(folder / "cases.json")
    if gb10_stub is not None:
        files.append(gb10_stub)
    mounts = {f: (f"/opt/probe/{f.name}", "ro") for f in files}
    mounts[model] = ("/model", "ro")
    command = ["python3", f"/opt/probe/{PROBE.name}", "/opt/probe/serve_defaults.py", "/opt/probe/serve-defaults.json"]
    command += ["/opt/probe/cases.json", "/model"]
    if gb10_stub is not None:
        command += ["--gb10", f"/opt/probe/{gb10_stub.name}"]
    found: dict[str, Any] = json.loads(engine.output(image, command, mounts=mounts, timeout_s=900).strip().splitlines()[-1])
    return found


def wrong(found: dict[str, Any]) -> dict[str, list[str]]:
    """Each case the entrypoint got wrong, with what."""
    known = {serve_defaults.option_name(o) or o for o in found["options"]}
    return {c["name"]: w for c in found["cases"] if (w := judged(c, known))}


def refused_alone(found: dict[str, Any]) -> list[str]:
    """The cases vLLM refuses without the image too (nothing of the image's to judge there)."""
    return sorted(c["name"] for c in found["cases"] if "error" in c["user"])
