"""vLLM's own start-up decisions for each check, in the built image, with a GB10 FAKED: run by
``sparkbuild/verify/startup.py`` as
``python3 startup_probe.py CASES_JSON SERVE_DEFAULTS_PY DEFAULTS_JSON [--gb10 STUB]``.

For each case (``{"name": CHECK, "user": [MODEL, ...]}``: the arguments a user gives ``docker run
IMAGE``), the arguments the image's entrypoint gives ``vllm serve`` (SERVE_DEFAULTS_PY's ``command``:
the image's own entrypoint code and serving defaults, where the image has them), in one process:
1. vLLM's own ``serve`` parser reads the arguments (``parse``);
2. ``AsyncEngineArgs.create_engine_config`` validates them and sizes graphs, context and batch for the
   platform (``config``);
3. vLLM's own model class is built from that config on PyTorch's meta device (no memory, no kernel):
   every attention layer runs vLLM's attention selector and every MoE layer its quantization's MoE
   oracle, as a server does at start-up (``model``). Weights are never loaded, no CUDA graph is
   captured, no KV cache is sized: the first real CUDA call is never made.
It prints one JSON object: per case, the stage it reached, vLLM's refusal if it refused (its message,
as a server would print it), the config's values, per layer the backend chosen, and every line vLLM
logged meanwhile (the lines verify's kernel-path gate reads on a real server's log).

WHAT IS FAKED (``--gb10``): the CUDA driver is the toolkit's stub library (every entry point returns
CUDA_ERROR_STUB_LIBRARY), loaded under the driver's name so vLLM's compiled modules import;
``torch.cuda`` reports one device of capability 12.1 with a GB10's name and memory; vLLM's current
platform is its own CUDA platform class with that capability and name; a tensor vLLM creates on the GPU
by name while it builds the model is made on the meta device too. Without ``--gb10``, the
platform the image's vLLM detects (the local CPU image). Imports torch and vLLM (the image's); the
distributed groups are vLLM's own, one process on Gloo over loopback.
"""

import contextlib
import ctypes
import enum
import importlib.util
import io
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

CAPABILITY = (12, 1)
GB10_NAME = "NVIDIA GB10 (faked)"
# The GB10's memory as the CUDA runtime reports it: 128 GB unified, less what the OS holds.
GB10_MEMORY = 119 * 1024**3
# The engine config's values a check's serving depends on: (name, path in VllmConfig).
FIELDS = (
    ("max_model_len", "model_config.max_model_len"),
    ("dtype", "model_config.dtype"),
    ("quantization", "model_config.quantization"),
    ("enforce_eager", "model_config.enforce_eager"),
    ("max_num_seqs", "scheduler_config.max_num_seqs"),
    ("max_num_batched_tokens", "scheduler_config.max_num_batched_tokens"),
    ("gpu_memory_utilization", "cache_config.gpu_memory_utilization"),
    ("block_size", "cache_config.block_size"),
    ("kv_cache_dtype", "cache_config.cache_dtype"),
    ("compilation_mode", "compilation_config.mode"),
    ("cudagraph_mode", "compilation_config.cudagraph_mode"),
    ("cudagraph_capture_sizes", "compilation_config.cudagraph_capture_sizes"),
)


def load_driver(stub: str) -> str:
    """The CUDA driver library vLLM's kernels link against: the system's, else the stub."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return "libcuda.so.1"
    except OSError:
        ctypes.CDLL(stub, mode=ctypes.RTLD_GLOBAL)  # its soname is libcuda.so.1: vLLM's kernels bind to it
        return f"{stub} (a stub)"


def fake_torch_device() -> None:
    """torch.cuda reports one GB10 (a fake: no GPU is touched)."""
    import torch

    def properties(device: object = None) -> Any:
        del device
        return type(
            "Props", (), {"name": GB10_NAME, "major": 12, "minor": 1, "total_memory": GB10_MEMORY, "multi_processor_count": 48}
        )()

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: CAPABILITY
    torch.cuda.get_device_name = lambda device=None: GB10_NAME
    torch.cuda.get_device_properties = properties
    torch.cuda.mem_get_info = lambda device=None: (GB10_MEMORY, GB10_MEMORY)


def fake_platform() -> None:
    """vLLM's own CUDA platform class, with a GB10's capability and name instead of a device query."""
    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    def capability(cls: type, device_id: int = 0) -> Any:
        del cls, device_id
        return DeviceCapability(major=CAPABILITY[0], minor=CAPABILITY[1])

    def name(cls: type, device_id: int = 0) -> str:
        del cls, device_id
        return GB10_NAME

    def memory(cls: type, device_id: int = 0) -> int:
        del cls, device_id
        return GB10_MEMORY

    methods: dict[str, Any] = {
        "get_device_capability": classmethod(capability),
        "get_device_name": classmethod(name),
        "get_device_total_memory": classmethod(memory),
    }
    vllm.platforms._current_platform = type("FakeGB10", (CudaPlatformBase,), methods)()


def fake_gb10(stub: str) -> str:
    driver = load_driver(stub)
    fake_torch_device()
    fake_platform()
    return driver


def plain(value: Any) -> Any:
    """``value`` as JSON holds it (vLLM's enums by their names, dtypes as text)."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def read(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part, None)
        if config is None:
            return None
    return plain(config)


class Tee(io.TextIOBase):
    """Standard output while the cases run: vLLM's own log handler writes there (its configuration is
    applied again as a config is made, so a handler of ours would not stay); every line is kept and
    echoed to standard error, and the result goes to the real standard output at the end."""

    def __init__(self, echo: Any) -> None:
        super().__init__()
        self.echo = echo
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        self.echo.write(text)
        return len(text)

    def flush(self) -> None:
        self.echo.flush()

    def lines(self) -> list[str]:
        taken, self.parts = "".join(self.parts), []
        return taken.splitlines()


def forget_once() -> None:
    """vLLM logs some choices once per process (``info_once``) and caches the attention selector:
    forgotten between cases, so each case logs its own choices as its own server would."""
    import vllm.logger
    import vllm.v1.attention.selector as selector

    for owner in (vllm.logger, selector):
        for value in vars(owner).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def serve_parser() -> tuple[Any, Any]:
    """vLLM's own command-line parser, and its ``serve`` subcommand's parser within it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    return parser, ServeSubcommand().subparser_init(parser.add_subparsers())


def parse(args: list[str]) -> Any:
    """vLLM's own serve parser's namespace for ``vllm serve ARGS``; ValueError with argparse's message
    where it refuses them."""
    parser, _ = serve_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = parser.parse_args(["serve", *args])
    except SystemExit:
        raise ValueError(said.getvalue().strip().splitlines()[-1]) from None
    if getattr(parsed, "model_tag", None):
        parsed.model = parsed.model_tag
    return parsed


def distributed() -> None:
    """vLLM's own process groups, one process on Gloo over loopback (its layers ask their sizes)."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
    )


def layers(model: Any) -> list[dict[str, str]]:
    """Per attention and MoE layer: the backend vLLM's selector gave it."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    found = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            found.append({"layer": name, "kind": "attention", "backend": backend.get_name()})
            continue
        method = getattr(module, "quant_method", None)
        # A MoE layer is known by its quantization method (the layer classes change between releases).
        if isinstance(method, FusedMoEMethodBase) and id(method) not in seen:
            seen.add(id(method))
            chosen = [v for k, v in vars(method).items() if k.endswith("_backend") and isinstance(v, enum.Enum)]
            label = "/".join(str(v.value) if isinstance(v.value, str) else v.name for v in chosen)
            found.append({"layer": name, "kind": "moe", "backend": label or type(method).__name__})
    return found


def on_meta() -> Any:
    """A torch function mode that turns a CUDA device named in a call into the meta device (a fake,
    like the device itself: a tensor made there holds no memory, and no kernel runs on it)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def meta(value: Any) -> Any:
        is_cuda = isinstance(value, (str, torch.device)) and torch.device(value).type == "cuda"
        return torch.device("meta") if is_cuda else value

    class OnMeta(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = {k: meta(v) if k == "device" else v for k, v in (kwargs or {}).items()}
            if func in (torch.Tensor.cuda, torch.Tensor.to):
                args = (args[0], *(meta(a) for a in args[1:]))
                if func is torch.Tensor.cuda:
                    return args[0].to("meta")
            return func(*args, **kwargs)

    return OnMeta()


def case(args: list[str]) -> dict[str, Any]:
    """How far vLLM's start-up gets with ``args``, and what it chose on the way."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    out: dict[str, Any] = {"args": args, "stage": "parse"}
    try:
        engine_args = AsyncEngineArgs.from_cli_args(parse(args))
        out["stage"] = "config"
        config = engine_args.create_engine_config()
        out["values"] = {name: read(config, path) for name, path in FIELDS}
        out["stage"] = "model"
        with set_current_vllm_config(config):
            distributed()
            # Groups as this config makes them (a MoE model gets an expert-parallel group, a dense one none).
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(1, 1)
            # As vLLM's model loader builds it (its dtype), on the meta device in place of the GPU, and
            # so is every tensor a layer creates on the GPU by name meanwhile (FlashInfer's attention
            # allocates its decode counters with device="cuda"): nothing reaches the driver.
            with set_default_torch_dtype(config.model_config.dtype), torch.device("meta"), on_meta():
                model = initialize_model(config)
        out["layers"] = layers(model)
        out["stage"] = "done"
    except Exception as exc:  # vLLM's own refusal is the finding, whatever its class
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def entrypoint(module_file: Path, defaults_file: Path) -> Any:
    """What the image's entrypoint passes ``vllm serve`` for a user's arguments (theirs unchanged
    where the image has no entrypoint code)."""
    if not module_file.is_file() or not defaults_file.is_file():
        return lambda user: user
    spec = importlib.util.spec_from_file_location("serve_defaults", module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda user: module.command(defaults_file, ["vllm", "serve"], user)[2:]


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    passed = entrypoint(Path(sys.argv[2]), Path(sys.argv[3]))
    # vLLM's log as a server prints it, with its debug lines (why each attention backend was not valid).
    os.environ.update({"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_LOGGING_STREAM": "ext://sys.stdout", "NO_COLOR": "1"})
    tee = Tee(sys.stderr)
    sys.stdout = tee
    driver = fake_gb10(sys.argv[5]) if sys.argv[4:5] == ["--gb10"] else None
    try:
        import vllm
    except ImportError as exc:
        sys.exit(f"no vLLM to import in this image ({type(exc).__name__}: {exc}): the image's runtime stage must install it")
    from vllm.platforms import current_platform

    platform = f"{GB10_NAME}, driver {driver}" if driver else f"{current_platform.device_name} (detected)"

    results = []
    for one in cases:
        forget_once()
        tee.lines()
        done = case(passed(one["user"]))
        results.append({"name": one["name"], **done, "log": tee.lines()})
    print(json.dumps({"vllm": vllm.__version__, "platform": platform, "cases": results}), file=sys.__stdout__)


if __name__ == "__main__":
    main()
