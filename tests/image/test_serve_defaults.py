"""The image's entrypoint adds each serving default the user did not give, in any spelling vLLM takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild.image import serve_defaults

DEFAULTS = [
    "--gpu-memory-utilization",
    "0.75",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "32768",
    "--compilation-config",
    json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 5, 8, 10, 16]}),
]


def test_a_model_alone_gets_every_default() -> None:
    assert serve_defaults.merge(DEFAULTS, ["openai/gpt-oss-120b"]) == ["openai/gpt-oss-120b", *DEFAULTS]


@pytest.mark.parametrize(
    "given",
    [
        ["--max-model-len", "4096"],
        ["--max-model-len=4096"],
        ["--max_model_len", "4096"],
    ],
)
def test_an_option_the_user_gave_wins_in_any_spelling(given: list[str]) -> None:
    merged = serve_defaults.merge(DEFAULTS, ["m", *given])
    assert merged[: 1 + len(given)] == ["m", *given]
    assert "32768" not in merged and "--max-num-seqs" in merged and "--gpu-memory-utilization" in merged


@pytest.mark.parametrize(
    "given", [["-cc", "{}"], ["-cc.cudagraph_mode=NONE"], ["--compilation-config.cudagraph_capture_sizes=[1]"]]
)
def test_the_compilation_config_is_the_users_in_its_short_and_dotted_forms(given: list[str]) -> None:
    merged = serve_defaults.merge(DEFAULTS, ["m", *given])
    assert "--compilation-config" not in merged
    assert merged.count("--max-num-seqs") == 1


@pytest.mark.parametrize("given", [["-O3"], ["-O", "0"], ["-O=2"]])
def test_dash_o_is_the_optimization_level_and_leaves_the_compilation_config(given: list[str]) -> None:
    """vLLM 0.19 and 0.33 read -O as --optimization-level (vllm/utils/argparse_utils.py)."""
    merged = serve_defaults.merge(DEFAULTS, ["m", *given])
    assert "--compilation-config" in merged


def test_the_graph_sizes_are_vllms_for_max_num_seqs_plus_the_extra_ones() -> None:
    assert serve_defaults.capture_sizes(16, [5, 10]) == [1, 2, 4, 5, 8, 10, 16, 24, 32]
    sizes = serve_defaults.capture_sizes(256, [5, 10])
    # vLLM's 1, 2, 4, multiples of 8 below 256, of 16 from 256, up to 2 x 256 (capped at 512), and 5 and 10.
    assert sizes[:8] == [1, 2, 4, 5, 8, 10, 16, 24] and sizes[-3:] == [480, 496, 512] and len(sizes) == 53
    assert serve_defaults.capture_sizes(2, [5, 10]) == [1, 2, 4]  # none above vLLM's largest


def test_values_that_look_like_options_stay_with_their_option() -> None:
    # A negative number is a value, not an option the user set.
    merged = serve_defaults.merge(["--seed", "-1", "--max-num-seqs", "16"], ["m", "--max-num-seqs", "4"])
    assert merged == ["m", "--max-num-seqs", "4", "--seed", "-1"]


@pytest.mark.parametrize(
    "given",
    [
        ["--cudagraph-capture-sizes", "1", "2", "4"],
        ["--cudagraph_capture_sizes=8"],
        ["--max-cudagraph-capture-size", "64"],
        ["-sc", '{"method": "ngram", "num_speculative_tokens": 3}'],
        ["--speculative-config.method=ngram"],
        ["--spec-method", "ngram", "--spec-tokens", "3"],
        ["--performance-mode", "interactivity"],
        ["-cc.cudagraph_mode=NONE"],
    ],
)
def test_the_images_graph_sizes_step_aside_for_any_option_that_sizes_graphs(given: list[str], tmp_path: Path) -> None:
    """vLLM refuses --cudagraph-capture-sizes beside a compilation config that sets them; speculative
    decoding and --performance-mode size graphs their own way (tests/support/population.py judges it
    through vLLM's own config)."""
    defaults = tmp_path / "serve-defaults.json"
    defaults.write_text(json.dumps({"args": DEFAULTS, "cudagraph_extra_sizes": [5, 10]}))
    full = serve_defaults.command(defaults, ["vllm", "serve"], ["m", *given])
    assert "--compilation-config" not in full
    assert full[:2] == ["vllm", "serve"] and full[2 : 3 + len(given)] == ["m", *given]
    assert full.count("--max-num-seqs") == 1


def test_without_such_an_option_the_graphs_follow_the_users_max_num_seqs(tmp_path: Path) -> None:
    defaults = tmp_path / "serve-defaults.json"
    defaults.write_text(json.dumps({"args": DEFAULTS, "cudagraph_extra_sizes": [5, 10]}))
    full = serve_defaults.command(defaults, ["vllm", "serve"], ["m", "--max-num-seqs", "4", "-O3"])
    sizes = json.loads(full[full.index("--compilation-config") + 1])["cudagraph_capture_sizes"]
    assert sizes == [1, 2, 4, 5, 8]
