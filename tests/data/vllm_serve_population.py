"""Runs in an image with vLLM: each of a population of ``docker run IMAGE MODEL ARGS...`` argument sets
through vLLM's own ``serve`` parser and engine config, three ways: as the user wrote it (``user``:
``vllm serve MODEL ARGS``), as the image's entrypoint runs it (``entrypoint``: ``serve_defaults.command``,
the user's arguments and the serving defaults they leave), and with the image's defaults but its CUDA
graph sizes (``reference``: what vLLM itself makes of the user's options beside the image's other
defaults). No server starts.

``python3 vllm_serve_population.py SERVE_DEFAULTS_PY DEFAULTS_JSON CASES_JSON MODEL [--gb10 STUB]``:
CASES_JSON is a list of ``{"name": ..., "args": [...]}``; with ``--gb10``, vLLM configures for a GB10,
FAKED (``fake_gb10``; STUB: the CUDA driver stub to load where no driver is), else for the platform
the image's vLLM detects (the local image: its CPU, which captures no CUDA graphs). Prints one JSON
object: ``options`` (every option string this vLLM's serve parser knows) and ``cases`` (per case, for
each way: the arguments, vLLM's refusal if it refused them, else the values vLLM ended with in its
engine config). One process for the whole population: importing vLLM takes seconds, configuring it a
fraction of one.
"""

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any


def load(path: Path) -> types.ModuleType:
    """The module of ``path`` (a file mounted beside this one, not an installed package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# sparkbuild's own start-up probe (sparkbuild/image/startup_probe.py, mounted beside this file): its
# GB10 fakes and its reading of vLLM's config.
STARTUP = load(Path(__file__).with_name("startup_probe.py"))
# The engine config's values a serving option can set: (name, path in VllmConfig).
FIELDS = (
    ("max_num_seqs", "scheduler_config.max_num_seqs"),
    ("max_num_batched_tokens", "scheduler_config.max_num_batched_tokens"),
    ("max_model_len", "model_config.max_model_len"),
    ("enforce_eager", "model_config.enforce_eager"),
    ("gpu_memory_utilization", "cache_config.gpu_memory_utilization"),
    ("cudagraph_capture_sizes", "compilation_config.cudagraph_capture_sizes"),
    ("max_cudagraph_capture_size", "compilation_config.max_cudagraph_capture_size"),
    ("compilation_mode", "compilation_config.mode"),
    ("cudagraph_mode", "compilation_config.cudagraph_mode"),
    ("optimization_level", "optimization_level"),
    ("performance_mode", "performance_mode"),
    ("speculative_method", "speculative_config.method"),
    ("num_speculative_tokens", "speculative_config.num_speculative_tokens"),
)


def options() -> list[str]:
    """Every option string vLLM's serve parser knows."""
    _, serve = STARTUP.serve_parser()
    return sorted({o for action in serve._actions for o in action.option_strings})


def configured(args: list[str]) -> dict[str, Any]:
    """What vLLM makes of ``vllm serve ARGS``: its refusal, or its engine config's values."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        parsed = STARTUP.parse(args)
    except ValueError as exc:  # argparse refuses: its message
        return {"args": args, "error": str(exc)}
    try:
        config = AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    except Exception as exc:  # vLLM's own refusal is the finding, whatever its class
        return {"args": args, "error": f"{type(exc).__name__}: {exc}"}
    return {"args": args, "values": {name: STARTUP.read(config, path) for name, path in FIELDS}}


def fake_gb10(stub: str) -> str:
    """vLLM's CUDA platform with a GB10's capability, FAKED as sparkbuild's start-up prediction fakes
    it (sparkbuild/image/startup_probe.py, mounted beside this file: the stub driver loaded under the
    driver's name, torch.cuda reporting one GB10, vLLM's current platform its CUDA class with 12.1)."""
    return str(STARTUP.fake_gb10(stub))


def main() -> None:
    module_file, defaults_file, cases_file, model = sys.argv[1:5]
    platform = fake_gb10(sys.argv[6]) if sys.argv[5:6] == ["--gb10"] else "this image's own"
    serve_defaults = load(Path(module_file))
    out = []
    defaults, _ = serve_defaults.read_defaults(Path(defaults_file))
    for case in json.loads(Path(cases_file).read_text()):
        user = [model, *case["args"]]
        entry = serve_defaults.command(Path(defaults_file), ["vllm", "serve"], user)[2:]
        reference = serve_defaults.merge(serve_defaults.drop_option(defaults, "--compilation-config"), user)
        ways = {"user": user, "entrypoint": entry, "reference": reference}
        out.append({"name": case["name"], **{way: configured(args) for way, args in ways.items()}})
    print(json.dumps({"platform": platform, "options": options(), "cases": out}))


if __name__ == "__main__":
    main()
