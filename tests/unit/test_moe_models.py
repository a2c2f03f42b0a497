"""The quantized MoE check models, made for real on CPU (minutes): each checkpoint is in the format vLLM loads,
is proven by the reference before it is cached, and a wrong reference answer keeps it out of the cache.

Set SPARKBUILD_TEST_CACHE to keep the models between runs (the dense tests' cache does the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from builder import model, moe
from builder.errors import BuildError
from builder.moe import compressed
from builder.moe.recipe import EXPECT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # transformers' "saving offloaded modules" chatter
]
torch: Any = pytest.importorskip("torch")
safetensors: Any = pytest.importorskip("safetensors")
pytest.importorskip("llmcompressor")


def header(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint: its dtype and shape, as the safetensors header says."""
    with safetensors.safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118


def proven(cache: Path, name: str) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    folder = model.ensure(cache, name)
    meta = json.loads((folder / "sparkbuild-model.json").read_text())
    assert meta["reference"]["answer"] == EXPECT
    assert min(meta["margins"]["checkpoint"]) > 2  # the answer survives the quantization with room to spare
    return folder, meta, json.loads((folder / "config.json").read_text())


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


def test_fp8_moe_is_compressed_tensors_fp8_in_128x128_blocks(cache: Path) -> None:
    folder, _, config = proven(cache, "moe-fp8")
    q = config["quantization_config"]
    (group,) = q["config_groups"].values()
    assert q["format"] == "float-quantized" and group["weights"]["block_structure"] == [128, 128]
    tensors = header(folder)
    assert tensors["model.layers.0.mlp.experts.3.gate_proj.weight"] == ("F8_E4M3", [128, 256])
    assert tensors["model.layers.0.mlp.experts.3.gate_proj.weight_scale"][1] == [1, 2]
    assert tensors["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"


def test_gptoss_mxfp4_has_gpt_oss_blocks_scales_sinks_and_a_sliding_window(cache: Path) -> None:
    folder, _, config = proven(cache, "gptoss-mxfp4")
    assert config["architectures"] == ["GptOssForCausalLM"] and config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["sliding_window"] == 4 and "sliding_attention" in config["layer_types"]
    tensors = header(folder)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ("U8", [4, 256, 8, 16])
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_scales"] == ("U8", [4, 256, 8])
    assert tensors["model.layers.0.mlp.experts.down_proj_blocks"] == ("U8", [4, 256, 4, 16])
    assert tensors["model.layers.0.self_attn.sinks"] == ("BF16", [4])


def test_a_checkpoint_the_reference_reads_wrong_never_reaches_the_cache(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The written checkpoint read back with its output head shifted by one token: a wrong answer."""
    model.ensure(cache, "moe-alphabet")  # shared with the tests above; the quantizing is what runs here
    own = tmp_path / "cache"
    (own / "models").mkdir(parents=True)
    for base in (cache / "models").glob("moe-alphabet-*"):
        (own / "models" / base.name).symlink_to(base)
    real = compressed.load_reference

    def shifted(folder: Path) -> tuple[Any, Any]:
        net, fast = real(folder)
        with torch.no_grad():
            net.lm_head.weight.copy_(torch.roll(net.lm_head.weight, 1, dims=0))
        return net, fast

    monkeypatch.setattr(compressed, "load_reference", shifted)
    with pytest.raises(BuildError, match="quantization lost the answer"):
        model.ensure(own, "moe-fp8")
    assert [p.name for p in (own / "models").iterdir()] == [p.name for p in (cache / "models").glob("moe-alphabet-*")]
