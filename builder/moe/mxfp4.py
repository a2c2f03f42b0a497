"""A tiny gpt-oss (GptOssForCausalLM: MoE, attention sinks, sliding window) with MXFP4 experts in gpt-oss's format.

No maintained tool writes this format on CPU: transformers' own MXFP4 quantizer needs the Triton kernels
(a GPU) and keeps the result in Triton's swizzled layout; llm-compressor writes compressed-tensors, not
``quant_method: mxfp4``. So the experts are written here, as the published gpt-oss checkpoints hold them:

- ``<layer>.mlp.experts.gate_up_proj_blocks``: uint8 [experts, 2*expert_size, hidden/32, 16], two E2M1 codes
  per byte, the element with the even index in the low nibble;
- ``<layer>.mlp.experts.gate_up_proj_scales``: uint8 [experts, 2*expert_size, hidden/32], the E8M0 shared
  exponent of each 32-element block (biased by 127);
- the same pair for ``down_proj`` ([experts, hidden, expert_size/32, ...]); biases, attention, router and
  embeddings stay in bfloat16 (``modules_to_not_convert``, as in openai/gpt-oss-20b's config).

The layout is the transpose of transformers' ``gate_up_proj`` [experts, hidden, 2*expert_size] (rows are
output features). The proof is independent of this writer: transformers' ``Mxfp4Config(dequantize=True)``
reads the folder back on CPU and must give the answer.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

from builder import log
from builder.moe import trained
from builder.moe.recipe import MoeRecipe

BLOCK = 32  # OCP MX block: 32 elements share one power-of-two scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 E2M1 magnitudes by code; bit 3 is the sign
SCALE_BIAS = 127  # E8M0: the stored byte is the exponent plus 127
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
PROJECTIONS = ("gate_up_proj", "down_proj")


def quantize(weight: Any) -> tuple[Any, Any]:
    """transformers' expert weight [experts, in, out] -> gpt-oss's (blocks, scales) over the input dimension."""
    torch, _ = trained.libs()
    rows = weight.detach().float().transpose(1, 2)  # [experts, out, in]: one row per output feature
    experts, out, width = rows.shape
    if width % BLOCK:
        raise ValueError(f"MXFP4 needs the input width ({width}) to be a multiple of {BLOCK}: change MoeRecipe's sizes")
    groups = rows.reshape(experts, out, width // BLOCK, BLOCK)
    amax = groups.abs().amax(-1)
    # The smallest power of two that brings the block's largest magnitude within E2M1's 6: nothing saturates.
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / E2M1[-1])).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), (exponent + SCALE_BIAS).to(torch.uint8)


def _state_dict(net: Any) -> dict[str, Any]:
    """The bfloat16 state dict with every expert projection replaced by its ``_blocks`` and ``_scales``."""
    torch, _ = trained.libs()
    out: dict[str, Any] = {}
    for name, tensor in net.state_dict().items():
        if name.endswith(tuple(f".mlp.experts.{p}" for p in PROJECTIONS)):
            blocks, scales = quantize(tensor)
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            out[name] = tensor.to(torch.bfloat16).contiguous()
    return out


def write(net: Any, fast: Any, out: Path) -> None:
    safetensors: Any = importlib.import_module("safetensors.torch")
    out.mkdir(parents=True, exist_ok=True)
    safetensors.save_file(_state_dict(net), out / "model.safetensors", metadata={"format": "pt"})
    config = net.config
    config.architectures = [type(net).__name__]  # save_pretrained of the model sets it; vLLM picks its class by it
    config.dtype = "bfloat16"
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    config.save_pretrained(out)
    net.generation_config.save_pretrained(out)
    fast.save_pretrained(out)


def make(r: MoeRecipe, out: Path) -> None:
    from builder import moe

    torch, tf = trained.libs()
    start = time.monotonic()
    net, fast = trained.train(r)
    before = trained.margins(net, fast)
    alone = trained.margins_without_experts(net, fast)
    bf16 = trained.margins(net.to(torch.bfloat16), fast)
    log.info(f"model {r.name}: margins {before} in float32, {bf16} in bfloat16, before MXFP4")
    write(net, fast, out)
    proof = trained.reference(r, out, quantization_config=tf.Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    trained.write_meta(
        r,
        out,
        moe.key(r.name),
        parameters=trained.parameters(net),
        margins={"float32": before, "bf16": bf16, "checkpoint": proof["margins"], "float32_experts_zeroed": alone},
        reference={**proof, "loader": "transformers Mxfp4Config(dequantize=True)"},
        making_s=round(time.monotonic() - start, 1),
    )
