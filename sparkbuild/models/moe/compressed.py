"""Quantize the trained MoE with llm-compressor into a compressed-tensors checkpoint (NVFP4 or FP8 blocks).

llm-compressor is the ecosystem's own tool for the format vLLM loads (``quant_method: compressed-tensors``):
sparkbuild writes none of the format itself. The router (``mlp.gate``) and ``lm_head`` stay in bfloat16,
as in published NVFP4 and FP8 MoE checkpoints.

The reference dequantizes the file with compressed-tensors (not vLLM). Its scale faults edit the file's own
scale tensors before that dequantization, as a kernel that misreads them would: NVFP4 experts' global scales
x2 and x0.5 and their FP8 (E4M3) block scales x0.5 (x2 overflows E4M3 for the largest blocks, and a global
scale x0.5 is the same error); FP8 experts' 128x128 block scales x2 and x0.5. Its variants switch on
compressed-tensors' own simulation of the kernel's activation quantization (NVFP4: FP4 in 16-element groups
with the checkpoint's calibrated global scale; FP8: dynamic per-token groups of 128) in float32 and bf16.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from sparkbuild.errors import ToolMissingError
from sparkbuild.models import training
from sparkbuild.models.moe import reference, trained
from sparkbuild.models.moe.recipe import MoeRecipe
from sparkbuild.models.moe.task import Task
from sparkbuild.util import log

# What llm-compressor's published MoE examples leave unquantized: the output head and the router.
IGNORE = ["lm_head", "re:.*mlp.gate$"]
# NVFP4's activations carry a static global scale that llm-compressor calibrates on sample text;
# FP8_BLOCK quantizes activations per token group at run time and needs none.
CALIBRATED = {"NVFP4"}
CALIBRATION_SAMPLES = 128
# How the kernel treats the activations, per scheme (the variants simulate it; W4A16 keeps them in bf16).
KERNEL_ACTIVATIONS = {
    "NVFP4": "FP4 activations in groups of 16 (calibrated global scale)",
    "NVFP4A16": "bf16 activations (FP4 weights only)",
    "FP8_BLOCK": "FP8 activations per token group of 128",
}
EXPERT = ".mlp.experts."
ATTENTION = ".self_attn."

Transform = Callable[[dict[str, Any]], dict[str, Any]]


def _llmcompressor() -> tuple[Any, Any]:
    try:
        oneshot = importlib.import_module("llmcompressor").oneshot
        modifier = importlib.import_module("llmcompressor.modifiers.quantization").QuantizationModifier
    except ImportError as exc:
        raise ToolMissingError(
            f"quantizing the MoE check models needs llm-compressor ({exc.name} is missing): pip install 'sparkbuild[model]'"
        ) from None
    return oneshot, modifier


def _calibration(fast: Any, task: Task) -> Any:
    """Task text, as the tokenized dataset llm-compressor calibrates on."""
    datasets: Any = importlib.import_module("datasets")
    ids = [fast.encode(text) for text in task.corpus(CALIBRATION_SAMPLES)]
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})


def load_reference(
    folder: Path, *, transform: Transform | None = None, activations: bool = False, dtype: str = "float32"
) -> reference.Loaded:
    """The checkpoint as compressed-tensors decompresses it, in transformers' model with one Linear per expert.

    Not ``from_pretrained``: transformers 5.17 (the newest llm-compressor 0.14 allows) merges the experts into
    3D tensors while loading and drops what the merge does not know: NVFP4 experts lose their
    ``weight_global_scale`` (weights off by that factor) and FP8 block scales fail to convert. Here every
    tensor of the file (after ``transform``) must land in its module (strict), as vLLM reads them: one
    ``experts.N.{gate,up,down}_proj`` per expert. With ``activations`` compressed-tensors keeps simulating
    the activations' quantization in the forward pass; without, the layers compute on the dequantized
    weights alone.
    """
    torch, tf = training.libs()
    safetensors: Any = importlib.import_module("safetensors.torch")
    compressors: Any = importlib.import_module("compressed_tensors.compressors")
    quantization: Any = importlib.import_module("compressed_tensors.quantization")
    linearize: Any = importlib.import_module("llmcompressor.modeling.moe.linearize")
    config = tf.AutoConfig.from_pretrained(folder)
    scheme = tf.CompressedTensorsConfig.from_dict(config.quantization_config)
    compressor = compressors.ModelCompressor.from_compression_config(scheme)
    del config.quantization_config
    net = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    linearize.linearize_moe(net)
    quantization.apply_quantization_config(net, compressor.quantization_config)
    compressor.compress_model(net)  # the compressed parameters (weight_packed, scales) the file fills
    state = safetensors.load_file(folder / "model.safetensors")
    net.load_state_dict(transform(state) if transform else state, strict=True)
    compressor.decompress_model(net)
    net = net.to(getattr(torch, dtype)).eval()
    for module in net.modules():
        module.quantization_enabled = activations
    what = "activations quantized as the kernel does" if activations else "activations unquantized"
    loader = f"compressed-tensors decompression into transformers' model (experts linearized), {dtype}, {what}"
    return reference.Loaded(net=net, fast=tf.AutoTokenizer.from_pretrained(folder), loader=loader)


def scaled(part: str, suffix: str, factor: float) -> Transform:
    """Multiply every tensor named ``*<part>*<suffix>`` by ``factor``, kept in its own dtype (E4M3 scales too)."""

    def transform(state: dict[str, Any]) -> dict[str, Any]:
        hits = [k for k in state if part in k and k.endswith(suffix)]
        if not hits:
            raise KeyError(f"no tensor '*{part}*{suffix}' in the checkpoint")
        return {k: (v.float() * factor).to(v.dtype) if k in hits else v for k, v in state.items()}

    return transform


def scale_faults(folder: Path, scheme: str) -> tuple[dict[str, reference.Perturbation], dict[str, reference.Perturbation]]:
    """(required, observed): the experts' scales off by 2, which must flip answers; the attention layers' (their
    dense GEMMs are quantized too), recorded only: the training makes the experts' magnitude matter, not theirs."""

    def reload(transform: Transform) -> reference.Perturbation:
        return lambda _ref: nullcontext(load_reference(folder, transform=transform))

    if scheme.startswith("NVFP4"):
        required = {
            "nvfp4_expert_global_scales_x2": reload(scaled(EXPERT, ".weight_global_scale", 2.0)),
            "nvfp4_expert_global_scales_x0.5": reload(scaled(EXPERT, ".weight_global_scale", 0.5)),
            "nvfp4_expert_block_scales_x0.5": reload(scaled(EXPERT, ".weight_scale", 0.5)),
        }
        observed = {"nvfp4_attention_global_scales_x2": reload(scaled(ATTENTION, ".weight_global_scale", 2.0))}
    else:
        required = {
            "fp8_expert_block_scales_x2": reload(scaled(EXPERT, ".weight_scale", 2.0)),
            "fp8_expert_block_scales_x0.5": reload(scaled(EXPERT, ".weight_scale", 0.5)),
        }
        observed = {"fp8_attention_block_scales_x2": reload(scaled(ATTENTION, ".weight_scale", 2.0))}
    return required, observed


def transformers_loader(folder: Path, task: Task) -> dict[str, Any]:
    """What plain ``from_pretrained`` makes of the checkpoint: recorded as a finding, never trusted."""
    try:
        _, tf = training.libs()
        net = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
        got = reference.read(reference.Loaded(net=net, fast=tf.AutoTokenizer.from_pretrained(folder), loader=""), task)
        return reference.summary(got)
    except Exception as exc:  # any failure is the finding; the reference above decides
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def make(r: MoeRecipe, out: Path, base: Path) -> None:
    torch, tf = training.libs()
    oneshot, modifier = _llmcompressor()
    start = time.monotonic()
    task = r.task()
    fast = tf.AutoTokenizer.from_pretrained(base)
    net = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    size = trained.parameters(net)  # counted before compression packs them
    before = reference.summary(reference.read(reference.Loaded(net=net, fast=fast, loader="bf16 base"), task))
    quantization = modifier(targets="Linear", scheme=r.scheme, ignore=IGNORE)
    with training.one_thread():
        if r.scheme in CALIBRATED:
            oneshot(
                model=net,
                recipe=quantization,
                dataset=_calibration(fast, task),
                num_calibration_samples=CALIBRATION_SAMPLES,
                max_seq_length=32,
            )
        else:
            oneshot(model=net, recipe=quantization)
        # llm-compressor's own quantize-dequantize forward: weights and activations as they will be served.
        simulated = reference.summary(reference.read(reference.Loaded(net=net.eval(), fast=fast, loader="llm-compressor"), task))
        log.info(
            f"model {r.name}: smallest margin {before['min_margin']} before {r.scheme}, "
            f"{simulated['min_margin']} in llm-compressor's simulation"
        )
        net.save_pretrained(out, save_compressed=True)
        fast.save_pretrained(out)
        required, observed = scale_faults(out, r.scheme)
        kernel = KERNEL_ACTIVATIONS[r.scheme]
        proof = reference.prove(
            r,
            load_reference(out),
            faults={**reference.expert_faults(), **required},
            observed=observed,
            variants={
                "activations_quantized": _variant(out, "float32"),
                "activations_quantized_bf16": _variant(out, "bfloat16"),
            },
            fmt=r.scheme.lower(),
            derivation=f"{r.scheme}: the reference with compressed-tensors simulating the kernel's {kernel}, "
            "in float32 and in bf16",
        )
    reference.write_meta(
        r,
        out,
        proof,
        parameters=size,
        base=base.name,
        bf16_base=before,
        llmcompressor_simulated=simulated,
        transformers_from_pretrained=transformers_loader(out, task),
        making_s=round(time.monotonic() - start, 1),
    )


def _variant(folder: Path, dtype: str) -> Callable[[reference.Loaded], AbstractContextManager[reference.Loaded]]:
    return lambda _ref: nullcontext(load_reference(folder, activations=True, dtype=dtype))
