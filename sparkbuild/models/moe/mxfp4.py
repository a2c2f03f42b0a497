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
output features). The reference is independent of this writer: transformers' ``Mxfp4Config(dequantize=True)``
reads the folder back on CPU. Its scale faults add or take one from every E8M0 exponent of the experts'
blocks (a kernel with the bias off by one: every weight x2 or x0.5); its gpt-oss faults drop the sinks and
lay the sliding window on the full layer too. Its variants compute in bf16 with the experts' activations
as bf16 (a BF16-activation kernel), MXFP8 (E4M3 in 32-element blocks, FlashInfer/TRT-LLM's MXFP4_MXFP8) or
MXFP4 (E2M1, CUTLASS's MXFP4_MXFP4), quantized before each of the two GEMMs as those kernels do.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkbuild.models import training
from sparkbuild.models.moe import reference, trained
from sparkbuild.models.moe.recipe import MoeRecipe

BLOCK = 32  # OCP MX block: 32 elements share one power-of-two scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 E2M1 magnitudes by code; bit 3 is the sign
SCALE_BIAS = 127  # E8M0: the stored byte is the exponent plus 127
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
PROJECTIONS = ("gate_up_proj", "down_proj")
# OCP MX v1.0: the shared exponent is floor(log2(amax)) minus the element format's largest exponent.
EMAX = {"e4m3": 8, "e2m1": 2}


def quantize(weight: Any) -> tuple[Any, Any]:
    """transformers' expert weight [experts, in, out] -> gpt-oss's (blocks, scales) over the input dimension."""
    torch, _ = training.libs()
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


def mx_fake_quant(x: Any, element: str) -> Any:
    """``x`` quantized to MX (``element`` 'e4m3' or 'e2m1', 32-element blocks along the last dimension, E8M0
    scales per OCP MX v1.0) and back, as a kernel with MX activations sees them."""
    torch, _ = training.libs()
    shape, dtype = x.shape, x.dtype
    groups = x.float().reshape(-1, BLOCK)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - EMAX[element])
    v = groups / scale
    if element == "e4m3":
        q = v.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        grid = torch.tensor(E2M1)
        q = grid[(v.abs().clamp(max=E2M1[-1])[..., None] - grid).abs().argmin(-1)] * v.sign()
    return (q * scale).reshape(shape).to(dtype)


def _state_dict(net: Any) -> dict[str, Any]:
    """The bfloat16 state dict with every expert projection replaced by its ``_blocks`` and ``_scales``."""
    torch, _ = training.libs()
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


def load(folder: Path, dtype: str = "float32") -> reference.Loaded:
    torch, tf = training.libs()
    net = tf.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=tf.Mxfp4Config(dequantize=True), dtype=getattr(torch, dtype)
    )
    loader = f"transformers Mxfp4Config(dequantize=True), {dtype}"
    return reference.Loaded(net=net.eval(), fast=tf.AutoTokenizer.from_pretrained(folder), loader=loader)


@contextmanager
def _exponents_off(folder: Path, step: int) -> Iterator[reference.Loaded]:
    """The checkpoint with every expert block's E8M0 exponent moved by ``step``, read by the reference."""
    safetensors: Any = importlib.import_module("safetensors.torch")
    with tempfile.TemporaryDirectory(prefix="sparkbuild-mxfp4-fault-") as tmp:
        copy = Path(tmp)
        for path in folder.iterdir():
            if path.is_file() and path.name != "model.safetensors":
                shutil.copy(path, copy / path.name)
        state = safetensors.load_file(folder / "model.safetensors")
        for name in [n for n in state if n.endswith("_scales")]:
            state[name] = (state[name].int() + step).clamp(0, 254).to(state[name].dtype)
        safetensors.save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
        yield load(copy)


@contextmanager
def _sinks_dropped(model: reference.Loaded) -> Iterator[reference.Loaded]:
    torch, _ = training.libs()
    layers = model.net.model.layers
    saved = [layer.self_attn.sinks.data.clone() for layer in layers]
    for layer in layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))  # exp(-inf) = 0: softmax over the tokens alone
    try:
        yield model
    finally:
        with torch.no_grad():
            for layer, value in zip(layers, saved, strict=True):
                layer.self_attn.sinks.data.copy_(value)


@contextmanager
def _layer_types(model: reference.Loaded, kind: str) -> Iterator[reference.Loaded]:
    """Every layer attends as ``kind`` (transformers picks each layer's mask from config.layer_types per forward)."""
    config = model.net.config
    saved = list(config.layer_types)
    config.layer_types = [kind] * len(saved)
    try:
        yield model
    finally:
        config.layer_types = saved


@contextmanager
def _activations(model: reference.Loaded, element: str | None) -> Iterator[reference.Loaded]:
    """The experts' two GEMMs take MX-quantized activations (the hidden state in, the gated product before
    ``down_proj``), as an MXFP4 x MXFP8 or MXFP4 x MXFP4 kernel computes; None: bf16 activations."""
    if element is None:
        yield model
        return
    modules = reference.experts(model.net)
    handles = [m.register_forward_pre_hook(lambda _m, args: (mx_fake_quant(args[0], element), *args[1:])) for m in modules]
    for m in modules:
        gate = type(m)._apply_gate.__get__(m)
        m._apply_gate = lambda gate_up, gate=gate: mx_fake_quant(gate(gate_up), element)
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for m in modules:
            del m._apply_gate


def _variant(folder: Path, element: str | None) -> Callable[[reference.Loaded], Any]:
    @contextmanager
    def variant(_ref: reference.Loaded) -> Iterator[reference.Loaded]:
        with _activations(load(folder, "bfloat16"), element) as model:
            yield model

    return variant


def prove(r: MoeRecipe, out: Path) -> dict[str, Any]:
    """The proof of the checkpoint written in ``out`` (reference.prove with gpt-oss's own faults and MXFP4's
    variants): made with the model, and run again elsewhere on the same bytes (bench/check_models_arm64.py)."""
    with training.one_thread():
        return reference.prove(
            r,
            load(out),
            faults={
                **reference.expert_faults(),
                "mxfp4_expert_scales_x2": lambda _ref: _exponents_off(out, +1),
                "mxfp4_expert_scales_x0.5": lambda _ref: _exponents_off(out, -1),
                "sinks_dropped": _sinks_dropped,
                "window_on_every_layer": lambda m: _layer_types(m, "sliding_attention"),
            },
            observed={"window_on_no_layer": lambda m: _layer_types(m, "full_attention")},
            variants={
                "activations_bf16": _variant(out, None),
                "activations_mxfp8": _variant(out, "e4m3"),
                "activations_mxfp4": _variant(out, "e2m1"),
            },
            fmt="mxfp4",
            derivation=(
                "MXFP4: the reference in bf16 with the experts' activations as bf16, MXFP8 (E4M3) and MXFP4 (E2M1) "
                "in 32-element blocks with E8M0 scales, quantized before each GEMM"
            ),
        )


def make(r: MoeRecipe, out: Path) -> None:
    start = time.monotonic()
    net, fast = trained.train(r)
    task = r.task()
    before = reference.summary(reference.read(reference.Loaded(net=net, fast=fast, loader="trained"), task))
    write(net, fast, out)
    proof = prove(r, out)
    reference.write_meta(
        r,
        out,
        proof,
        parameters=trained.parameters(net),
        trained_float32=before,
        making_s=round(time.monotonic() - start, 1),
    )
