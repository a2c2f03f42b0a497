"""Quantize the trained MoE with llm-compressor into a compressed-tensors checkpoint (NVFP4 or FP8 blocks).

llm-compressor is the ecosystem's own tool for the format vLLM loads (``quant_method: compressed-tensors``):
sparkbuild writes none of the format itself. The router (``mlp.gate``) and ``lm_head`` stay in bfloat16,
as in published NVFP4 and FP8 MoE checkpoints.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

from builder import log
from builder.errors import ToolMissingError
from builder.moe import trained
from builder.moe.recipe import MoeRecipe

# What llm-compressor's published MoE examples leave unquantized: the output head and the router.
IGNORE = ["lm_head", "re:.*mlp.gate$"]
# NVFP4's activations carry a static global scale that llm-compressor calibrates on sample text;
# FP8_BLOCK quantizes activations per token group at run time and needs none.
CALIBRATED = {"NVFP4"}


def _llmcompressor() -> tuple[Any, Any]:
    try:
        oneshot = importlib.import_module("llmcompressor").oneshot
        modifier = importlib.import_module("llmcompressor.modifiers.quantization").QuantizationModifier
    except ImportError as exc:
        raise ToolMissingError(
            f"quantizing the MoE check models needs llm-compressor ({exc.name} is missing): pip install 'sparkbuild[model]'"
        ) from None
    return oneshot, modifier


def _calibration(fast: Any, window: int) -> Any:
    """The training text itself, as the tokenized dataset llm-compressor calibrates on."""
    from builder import model as dense

    datasets: Any = importlib.import_module("datasets")
    ids = [fast.encode(text) for text in dense._windows(dense.ALPHABET, window)]
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})


def load_reference(folder: Path) -> tuple[Any, Any]:
    """The checkpoint as compressed-tensors decompresses it, in transformers' model with one Linear per expert.

    Not ``from_pretrained``: transformers 5.17 (the newest llm-compressor 0.14 allows) merges the experts into
    3D tensors while loading and drops what the merge does not know: NVFP4 experts lose their
    ``weight_global_scale`` (weights off by that factor, the answer kept by attention alone) and FP8 block
    scales fail to convert. Here every tensor of the file must land in its module (strict), as vLLM reads
    them: one ``experts.N.{gate,up,down}_proj`` per expert; compressed-tensors then decompresses them and
    keeps simulating the activations' quantization in the forward pass.
    """
    torch, tf = trained.libs()
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
    net.load_state_dict(safetensors.load_file(folder / "model.safetensors"), strict=True)
    compressor.decompress_model(net)
    return net.eval(), tf.AutoTokenizer.from_pretrained(folder)


def transformers_loader(folder: Path) -> dict[str, Any]:
    """What plain ``from_pretrained`` makes of the checkpoint: recorded as a finding, never trusted."""
    try:
        _, tf = trained.libs()
        net = tf.AutoModelForCausalLM.from_pretrained(folder)
        return {"margins": trained.margins(net, tf.AutoTokenizer.from_pretrained(folder))}
    except Exception as exc:  # any failure is the finding; the reference above decides
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def make(r: MoeRecipe, out: Path, base: Path) -> None:
    from builder import moe

    torch, tf = trained.libs()
    oneshot, modifier = _llmcompressor()
    start = time.monotonic()
    fast = tf.AutoTokenizer.from_pretrained(base)
    net = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    size = trained.parameters(net)  # counted before compression packs them
    before = trained.margins(net, fast)
    alone = trained.margins_without_experts(net, fast)
    recipe = modifier(targets="Linear", scheme=r.scheme, ignore=IGNORE)
    if r.scheme in CALIBRATED:
        calibration = _calibration(fast, r.window)
        oneshot(model=net, recipe=recipe, dataset=calibration, num_calibration_samples=len(calibration), max_seq_length=32)
    else:
        oneshot(model=net, recipe=recipe)
    # llm-compressor's own quantize-dequantize forward: weights and (for NVFP4) activations as they will be served.
    simulated = trained.margins(net, fast)
    log.info(f"model {r.name}: margins {before} before {r.scheme}, {simulated} in llm-compressor's simulation")
    net.save_pretrained(out, save_compressed=True)
    fast.save_pretrained(out)
    proof = trained.prove(r, *load_reference(out))
    trained.write_meta(
        r,
        out,
        moe.key(r.name),
        parameters=size,
        base=base.name,
        margins={
            "bf16": before,
            "llmcompressor_simulated": simulated,
            "checkpoint": proof["margins"],
            "bf16_experts_zeroed": alone,
        },
        reference={**proof, "loader": "compressed-tensors decompression into transformers' model, experts linearized"},
        transformers_from_pretrained=transformers_loader(out),
        making_s=round(time.monotonic() - start, 1),
    )
