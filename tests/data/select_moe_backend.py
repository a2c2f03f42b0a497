"""Which MoE backend vLLM's automatic selection picks on a DGX Spark (SM121), run where there is none.

Run inside an image (or a venv) with vLLM installed: ``python3 select_moe_backend.py LIBCUDA``.
vLLM's compiled kernels link against the CUDA driver (``libcuda.so.1``) and are loaded when its MoE
modules are imported; where no driver is installed, pass a stub as LIBCUDA (NVIDIA's devel images
and sparkbuild's devel bases have ``/usr/local/cuda/lib64/stubs/libcuda.so``: every driver entry
point returning CUDA_ERROR_STUB_LIBRARY), which is loaded under the driver's name first. It prints one
JSON object: the driver library it loaded, the vLLM it imported, the oracle file it read (and whether that file carries
sparkbuild's nvfp4-moe-b12x-auto line), and the backend ``select_nvfp4_moe_backend`` chooses with
``moe_backend="auto"`` for an NVFP4 W4A4 MoE layer (FP4 weights and activations) and an NVFP4 W4A16
one (FP4 weights, bf16 activations), each with the experts class; then, for gpt-oss's MXFP4 MoE
layer (expert biases, interleaved swigluoai), what ``select_mxfp4_moe_backend`` picks with ``auto``
what ``--moe-backend b12x`` gets (the error it raises, if it refuses) and what ``--moe-backend
flashinfer_cutlass_afp8`` gets; and whether the MXFP4 oracle carries sparkbuild's mxfp4-moe-flashinfer-sm12x.

THE GPU IS FAKED: there is no GB10 here. Before vLLM's modules are imported, ``torch.cuda`` is made to
report one available device of capability (12, 1) (b12x's own ``is_supported()`` asks torch), and vLLM's
``current_platform`` is set to vLLM's own CUDA platform class with ``get_device_capability`` returning
(12, 1): ``sparkbuild/image/startup_probe.py``'s ``fake_gb10``, copied beside this file (the product's
start-up prediction fakes the GPU the same way). Nothing is allocated or launched on a GPU: the selectors
only evaluate each backend's support predicate (the package installed, the capability, the quantization
scheme, the activation, biases, the shape, the parallel config). ``_user_moe_activation_override`` (which
reads a running engine's config) is made to return None, as vLLM's own tests do. Standard library, torch,
vLLM and those fakes only; exits 1 with the message if vLLM's selector raises for an NVFP4 layer.
"""

import json
import sys
from pathlib import Path
from typing import Any

import torch
from startup_probe import fake_gb10  # type: ignore[import-not-found]  # sparkbuild/image/startup_probe.py, copied beside it

MARKER = "sparkbuild nvfp4-moe-b12x-auto"
MXFP4_MARKER = "sparkbuild mxfp4-moe-flashinfer-sm12x"


def moe_config(**overrides: Any) -> Any:
    """A Qwen3-30B-A3B-shaped MoE layer, one GPU, no expert parallelism, moe_backend auto."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType

    fields: dict[str, Any] = {
        "num_experts": 128,
        "experts_per_token": 8,
        "hidden_dim": 2048,
        "intermediate_size": 768,
        "num_local_experts": 128,
        "num_logical_experts": 128,
        "activation": MoEActivation.SILU,
        "device": "cuda",
        "routing_method": RoutingMethodType.Renormalize,
        "moe_parallel_config": FusedMoEParallelConfig.make_no_parallel(),
        "in_dtype": torch.bfloat16,
        "moe_backend": "auto",
    }
    return FusedMoEConfig(**{**fields, **overrides})


def nvfp4(activation_key: Any) -> dict[str, str]:
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import select_nvfp4_moe_backend
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static

    backend, experts = select_nvfp4_moe_backend(moe_config(), weight_key=kNvfp4Static, activation_key=activation_key)
    return {"backend": backend.value, "experts": experts.__name__}


def gpt_oss_mxfp4() -> dict[str, Any]:
    """gpt-oss's MoE layer: 2880 hidden, 2880 intermediate, 32 experts, top 4, biases, swigluoai."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4

    mxfp4._user_moe_activation_override = lambda: None  # reads a running engine's config otherwise
    shape = {"hidden_dim": 2880, "intermediate_size": 2880, "num_experts": 32, "num_local_experts": 32}
    layer = {**shape, "num_logical_experts": 32, "experts_per_token": 4, "has_bias": True, "activation": MoEActivation.SWIGLUOAI}
    found: dict[str, Any] = {}
    for requested in ("auto", "b12x", "flashinfer_cutlass_afp8"):
        try:
            backend, _ = mxfp4.select_mxfp4_moe_backend(moe_config(**layer, moe_backend=requested))
            found[requested] = {"backend": backend.value}
        except (ValueError, NotImplementedError) as exc:
            found[requested] = {"error": str(exc)}
    return found


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("pass the CUDA driver library to load where none is installed, such as /usr/local/cuda/lib64/stubs/libcuda.so")
    driver = fake_gb10(sys.argv[1])
    import vllm
    from vllm.model_executor.layers.fused_moe.b12x import B12xExperts
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as oracle
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Dynamic
    from vllm.utils.b12x import has_b12x

    source = Path(oracle.__file__)
    result: dict[str, Any] = {
        "vllm": vllm.__version__,
        "libcuda": driver,
        "capability": "12.1 (faked)",
        "oracle": str(source),
        "patched": MARKER in source.read_text(encoding="utf-8"),
        "b12x_installed": has_b12x(),
        "b12x_supports_device": B12xExperts._supports_current_device(),
    }
    try:
        result["nvfp4_w4a4"] = nvfp4(kNvfp4Dynamic)
        result["nvfp4_w4a16"] = nvfp4(None)
    except (ValueError, NotImplementedError) as exc:
        print(json.dumps({**result, "error": str(exc)}))
        sys.exit(1)
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4

    result["mxfp4_patched"] = MXFP4_MARKER in Path(mxfp4.__file__).read_text(encoding="utf-8")
    result["gpt_oss_mxfp4"] = gpt_oss_mxfp4()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
