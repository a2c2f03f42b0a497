"""The MoE check models, made for real on CPU (minutes): each checkpoint is in the format vLLM loads, is
proven by the reference before it is cached (its answers exact, every expert of every layer used, each fault
flipping answer tokens, a tolerance that passes the kernel's simulated numerics and rejects every fault),
and a wrong reference answer or a fault that flips nothing keeps it out of the cache.

Set SPARKBUILD_TEST_CACHE to keep the models between runs (the dense tests' cache does the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparkbuild.errors import BuildError
from sparkbuild.models import model, moe
from sparkbuild.models.moe import compressed, reference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # transformers' "saving offloaded modules" chatter
]
torch: Any = pytest.importorskip("torch")
safetensors: Any = pytest.importorskip("safetensors")
pytest.importorskip("llmcompressor")

# The faults each format's proof must have seen flip answers (sparkbuild/models/moe/reference.py, compressed.py, mxfp4.py).
FAULTS = {
    "moe-alphabet": {"experts_zeroed", "experts_x0.5", "experts_x2"},
    "moe-nvfp4": {"nvfp4_expert_global_scales_x2", "nvfp4_expert_global_scales_x0.5", "nvfp4_expert_block_scales_x0.5"},
    "moe-nvfp4a16": {"nvfp4_expert_global_scales_x2", "nvfp4_expert_global_scales_x0.5", "nvfp4_expert_block_scales_x0.5"},
    "moe-fp8": {"fp8_expert_block_scales_x2", "fp8_expert_block_scales_x0.5"},
    "gptoss-mxfp4": {"mxfp4_expert_scales_x2", "mxfp4_expert_scales_x0.5", "sinks_dropped", "window_on_every_layer"},
}


def header(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint: its dtype and shape, as the safetensors header says."""
    with safetensors.safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118


def proven(cache: Path, name: str) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    folder = model.ensure(cache, name)
    meta = json.loads((folder / "sparkbuild-model.json").read_text())
    r = moe.RECIPES[name]
    assert [(p["prompt"], p["expect"]) for p in meta["prompts"]] == r.task().check_prompts()
    assert len(meta["prompts"]) >= 8 and meta["greedy"] == {p["prompt"]: p["expect"] for p in meta["prompts"]}
    for p in meta["prompts"]:
        assert "".join(t["token"] for t in p["tokens"]) == p["expect"]
        assert all(t["margin"] > 2 for t in p["tokens"])  # every answer survives its format with room to spare
        assert all(len(t["top"]) == reference.TOP and t["top"][0][0] == t["token"] for t in p["tokens"])
    # Every expert of every layer has a prompt routing tokens to it.
    assert set(meta["coverage"]) == {str(layer) for layer in range(r.layers)}
    assert all(users for layer in meta["coverage"].values() for users in layer.values())
    assert FAULTS["moe-alphabet"] | FAULTS[name] <= set(meta["faults"])
    for fault in meta["faults"].values():
        assert fault["flipped_tokens"] > 0 and fault["min_margin"] < 0 and fault["rejected_by_numbers"]
    tolerance = meta["tolerance"]
    assert tolerance["logprob_abs"] > 0 and 0 < tolerance["margin_fraction"] < 1 and tolerance["variants"]
    assert meta["reference"]["answer"] == meta["prompts"][0]["expect"]  # the fields older readers use
    return folder, meta, json.loads((folder / "config.json").read_text())


def test_the_bf16_moe_answers_only_with_its_experts_at_their_own_magnitude(cache: Path) -> None:
    _, meta, config = proven(cache, "moe-alphabet")
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4
    assert meta["tolerance"]["format"] == "bf16" and set(meta["tolerance"]["variants"]) == {"bf16"}


def test_nvfp4_moe_is_compressed_tensors_nvfp4_with_fp4_activations_and_every_expert_quantized(cache: Path) -> None:
    folder, meta, config = proven(cache, "moe-nvfp4")
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "nvfp4-pack-quantized"
    (group,) = q["config_groups"].values()
    assert group["weights"]["num_bits"] == group["input_activations"]["num_bits"] == 4
    assert group["weights"]["group_size"] == 16
    tensors = header(folder)
    for e in range(moe.RECIPES["moe-nvfp4"].experts):
        prefix = f"model.layers.1.mlp.experts.{e}.down_proj"
        assert tensors[f"{prefix}.weight_packed"] == ("U8", [256, 64])  # hidden x (expert width / 2): two FP4 a byte
        assert tensors[f"{prefix}.weight_scale"] == ("F8_E4M3", [256, 8])  # one scale per 16 elements
        assert f"{prefix}.weight_global_scale" in tensors and f"{prefix}.input_global_scale" in tensors
    assert tensors["model.layers.0.mlp.gate.weight"][0] == "BF16"  # the router stays unquantized
    assert "error" in meta["transformers_from_pretrained"] or meta["transformers_from_pretrained"]["margins"]
    assert set(meta["tolerance"]["variants"]) == {"activations_quantized", "activations_quantized_bf16"}


def test_nvfp4a16_moe_has_fp4_weights_and_no_activation_quantization(cache: Path) -> None:
    """The W4A16 layers the shipped nvfp4-moe-b12x-auto patch moves to b12x (vLLM's NVFP4 MoE oracle with no
    activation key): FP4 weights in groups of 16 with their scales, activations left in bf16."""
    folder, meta, config = proven(cache, "moe-nvfp4a16")
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "nvfp4-pack-quantized"
    (group,) = q["config_groups"].values()
    assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 16 and group["input_activations"] is None
    tensors = header(folder)
    prefix = "model.layers.1.mlp.experts.0.down_proj"
    assert tensors[f"{prefix}.weight_packed"] == ("U8", [256, 64]) and f"{prefix}.weight_global_scale" in tensors
    assert f"{prefix}.input_global_scale" not in tensors
    assert meta["tolerance"]["format"] == "nvfp4a16"


def test_fp8_moe_is_compressed_tensors_fp8_in_128x128_blocks(cache: Path) -> None:
    folder, _, config = proven(cache, "moe-fp8")
    q = config["quantization_config"]
    (group,) = q["config_groups"].values()
    assert q["format"] == "float-quantized" and group["weights"]["block_structure"] == [128, 128]
    tensors = header(folder)
    assert tensors["model.layers.0.mlp.experts.3.gate_proj.weight"] == ("F8_E4M3", [128, 256])
    assert tensors["model.layers.0.mlp.experts.3.gate_proj.weight_scale"][1] == [1, 2]
    assert tensors["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"


def test_gptoss_mxfp4_has_gpt_oss_blocks_scales_sinks_and_a_sliding_window_its_answers_need(cache: Path) -> None:
    folder, meta, config = proven(cache, "gptoss-mxfp4")
    assert config["architectures"] == ["GptOssForCausalLM"] and config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["sliding_window"] == 4 and config["layer_types"] == ["sliding_attention", "full_attention"]
    # The far letter of each lookup is out of the sliding layer's window: only the full layer reaches it.
    assert moe.RECIPES["gptoss-mxfp4"].far > config["sliding_window"]
    tensors = header(folder)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ("U8", [4, 256, 8, 16])
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_scales"] == ("U8", [4, 256, 8])
    assert tensors["model.layers.0.mlp.experts.down_proj_blocks"] == ("U8", [4, 256, 4, 16])
    assert tensors["model.layers.0.self_attn.sinks"] == ("BF16", [4])
    assert set(meta["tolerance"]["variants"]) == {"activations_bf16", "activations_mxfp8", "activations_mxfp4"}


def own_cache(cache: Path, tmp_path: Path) -> Path:
    """A cache holding only the shared moe-alphabet (linked): the quantizing is what runs in it."""
    model.ensure(cache, "moe-alphabet")
    own = tmp_path / "cache"
    (own / "models").mkdir(parents=True)
    for base in (cache / "models").glob("moe-alphabet-*"):
        (own / "models" / base.name).symlink_to(base)
    return own


def test_a_checkpoint_the_reference_reads_wrong_never_reaches_the_cache(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The written checkpoint read back with its output head shifted by one token: a wrong answer."""
    own = own_cache(cache, tmp_path)
    real = compressed.load_reference

    def shifted(folder: Path, **kwargs: Any) -> reference.Loaded:
        loaded = real(folder, **kwargs)
        with torch.no_grad():
            loaded.net.lm_head.weight.copy_(torch.roll(loaded.net.lm_head.weight, 1, dims=0))
        return loaded

    monkeypatch.setattr(compressed, "load_reference", shifted)
    with pytest.raises(BuildError, match="quantization lost the answer"):
        model.ensure_here(own, "moe-fp8")  # in this process, where the fault is patched in
    assert [p.name for p in (own / "models").iterdir()] == [p.name for p in (cache / "models").glob("moe-alphabet-*")]


def test_a_model_a_fault_leaves_right_never_reaches_the_cache(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 'fault' that changes the experts' output by 1 % (within what the training makes the model shrug off,
    as a too-robust model would shrug off a real one): the proof refuses the model."""
    own = own_cache(cache, tmp_path)
    monkeypatch.setattr(reference, "expert_faults", lambda: {"experts_x1.01": lambda m: reference._scaled(m, 1.01)})
    with pytest.raises(BuildError, match=r"the fault experts_x1\.01 flips no answer token"):
        model.ensure_here(own, "moe-fp8")
    assert not list((own / "models").glob("moe-fp8-*"))
