"""The MoE check models' format code on small tensors (seconds): gpt-oss's MXFP4 layout as transformers
reads it, the recipes' dimensions against the vLLM kernels' alignments, the task and its prompts, and the
serve-time tolerance's rule."""

from __future__ import annotations

from typing import Any

import pytest

from sparkbuild.models import model, moe
from sparkbuild.models.moe import mxfp4, reference
from sparkbuild.plan import matrix
from tests.support import ROOT

torch: Any = pytest.importorskip("torch")
tf_mxfp4: Any = pytest.importorskip("transformers.integrations.mxfp4")


def test_mxfp4_blocks_read_back_by_transformers_give_the_weight_within_its_block_precision() -> None:
    torch.manual_seed(0)
    weight = torch.randn(3, 64, 96) * torch.logspace(-3, 1, 96)  # [experts, in, out], blocks of very different scale
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2) and blocks.dtype == scales.dtype == torch.uint8
    back = tf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert back.shape == weight.shape
    # Each element is within half a step of E2M1 at its block's scale: under a third of the block's largest value
    # (the block scale s puts the largest above 3s; the widest E2M1 gap is 2s, between 4s and 6s).
    block_max = weight.transpose(1, 2).reshape(3, 96, 2, 32).abs().amax(-1, keepdim=True)
    error = (back - weight).transpose(1, 2).reshape(3, 96, 2, 32).abs()
    assert bool((error <= block_max / 3 + 1e-12).all())


def test_values_on_the_e2m1_grid_survive_exactly_and_the_even_element_is_the_low_nibble() -> None:
    grid = torch.tensor([0.5, -6.0] * 16).reshape(1, 32, 1)  # one block, one output feature
    blocks, scales = mxfp4.quantize(grid)
    assert int(scales[0, 0, 0]) == 127  # largest magnitude 6: exponent 0
    assert int(blocks[0, 0, 0, 0]) == 0x1 | (0xF << 4)  # +0.5 is code 1, -6 is code 15
    assert torch.equal(tf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), grid)


def test_every_moe_recipe_meets_the_kernels_alignment_without_padding() -> None:
    for r in moe.RECIPES.values():
        assert r.hidden_size % 256 == 0  # TRT-LLM FP4 MoE and Marlin MXFP4 round hidden up to 256
        assert r.expert_size % 128 == 0  # CUTLASS/FlashInfer/TRT-LLM/Marlin round the expert width up to 128
        for k_or_n in (r.hidden_size, r.expert_size, r.heads * r.head_dim, r.kv_heads * r.head_dim):
            assert k_or_n % 32 == 0  # CUTLASS FP4 GEMM (SM120): K and N multiples of 32; MXFP4 block 32, NVFP4 group 16


def test_model_names_and_cache_folders_cover_the_moe_recipes_and_a_quantized_key_follows_its_base() -> None:
    assert {"alphabet", "moe-alphabet", "moe-nvfp4", "moe-fp8", "gptoss-mxfp4"} <= set(model.names())
    assert moe.key("moe-nvfp4") != moe.key("moe-fp8")
    assert moe.key("moe-nvfp4").endswith(moe.key("moe-alphabet")[:8])


def test_the_task_needs_two_letters_and_its_prompts_never_repeat_a_lookup() -> None:
    for r in moe.RECIPES.values():
        task = r.task()
        table = task.table
        assert table.shape == (r.letters, r.letters)
        assert all(sorted(row.tolist()) == list(range(r.letters)) for row in table)  # each row a permutation
        # Not a function of one letter: the same near letter continues differently for different far ones.
        assert all(len(set(table[:, n].tolist())) > 1 for n in range(r.letters))
        prompts = task.check_prompts()
        assert len(prompts) >= 8 and len({p for p, _ in prompts}) == len(prompts)
        for prompt, answer in prompts:
            letters = [task.alphabet.index(c) for c in (prompt + answer).split()]
            assert letters == task.chains(torch.tensor([letters[: task.far]]))[0].tolist()
            lookups = [(letters[i - task.far], letters[i - task.near]) for i in range(task.far, len(letters))]
            assert len(set(lookups)) == len(lookups)


def test_the_matrix_asks_the_moe_checks_the_prompts_their_models_record() -> None:
    shipped = matrix.load(ROOT / "matrix.yaml")
    for name, r in moe.RECIPES.items():
        asked = [(p.prompt, p.expect, p.max_tokens, p.match) for p in shipped.checks[name].prompts]
        assert asked == [(p, a, r.answer, "exact") for p, a in r.task().check_prompts()]


def reading(expected: list[list[float]], margin: list[list[float]]) -> reference.Reading:
    return reference.Reading(expected=expected, margin=margin, top=[], routed=[])


def test_the_tolerance_is_twice_what_the_simulated_kernels_moved_and_rejects_a_flipped_or_thinned_answer() -> None:
    ref = reading([[-0.001, -0.01]], [[7.0, 4.0]])
    kernel = reading([[-0.004, -0.02]], [[6.0, 3.6]])  # logprob moved 0.01 at most; margins kept 0.857 at worst
    tolerance, moved = reference.derive("nvfp4", ref, {"activations_quantized": kernel})
    assert moved == {"activations_quantized": {"max_logprob_delta": 0.01, "min_margin_ratio": 0.8571}}
    assert tolerance == reference.Tolerance(format="nvfp4", logprob_abs=0.02, margin_fraction=0.714)
    assert tolerance.violations(ref, kernel) == []
    flipped = reading([[-9.0, -0.01]], [[-8.0, 4.0]])
    assert tolerance.violations(ref, flipped) == ["prompt 1 token 1: logprob -9.0000, reference -0.0010"]
    thinned = reading([[-0.002, -0.02]], [[7.0, 2.0]])  # right text, half the margin
    assert tolerance.violations(ref, thinned) == ["prompt 1 token 2: margin 2.000, reference 4.000"]
    # Numerics that barely move give the floor and the bounds, never a rule that passes a halved margin.
    same, _ = reference.derive("bf16", ref, {"bf16": ref})
    assert same.logprob_abs == reference.LOGPROB_FLOOR and same.margin_fraction == reference.MARGIN_FRACTION[1]
