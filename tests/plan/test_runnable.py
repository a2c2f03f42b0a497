"""Which checks an image can run on a host, decided before any server starts (sparkbuild/plan/runnable.py),
for every kind of CPU a user has: recorded /proc/cpuinfo texts, so the same on every machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild.models import model
from sparkbuild.plan import matrix, runnable
from sparkbuild.util import host
from tests.support import ROOT
from tests.util.test_host import EPYC, GRACE, XEON_AMX

CPUS = {"epyc": EPYC, "xeon-amx": XEON_AMX, "grace": GRACE}


def cpu(tmp_path: Path, name: str) -> host.Cpu:
    (tmp_path / name).write_text(CPUS[name])
    return host.read_cpu(tmp_path / name)


def shipped() -> dict[str, matrix.Check]:
    return matrix.load(ROOT / "matrix.yaml").checks


def local(c: host.Cpu, version: str = "0.32.0") -> runnable.Serving:
    return runnable.Serving.of({"io.sparkbuild.cuda": "none", "io.sparkbuild.vllm.version": version}, c)


@pytest.mark.parametrize("name", sorted(CPUS))
def test_the_shipped_local_checks_run_on_every_cpu(tmp_path: Path, name: str) -> None:
    checks = shipped()
    target = next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.profile == "local")
    for check in target.checks:
        assert runnable.skip_reason(check, local(cpu(tmp_path, name))) is None, check.name
    assert runnable.model_format(checks["moe-alphabet"]) == "moe-float32"


@pytest.mark.parametrize(
    ("check", "name", "words"),
    [
        ("moe-nvfp4", "epyc", "no NVFP4 linear kernel"),
        ("moe-nvfp4", "xeon-amx", "no NVFP4 linear kernel"),
        ("moe-fp8", "epyc", "need Intel AMX"),
        ("moe-fp8", "xeon-amx", "dies on the first request"),
        ("gptoss-mxfp4", "epyc", "need Intel AMX"),
        ("gptoss-mxfp4", "xeon-amx", "dies on the first request"),
        ("gptoss-mxfp4", "grace", "need Intel AMX"),
    ],
)
def test_a_quantized_check_is_skipped_on_the_cpu_image_with_its_reason(tmp_path: Path, check: str, name: str, words: str) -> None:
    reason = runnable.skip_reason(shipped()[check], local(cpu(tmp_path, name)))
    assert reason is not None and words in reason
    assert ("with AMX" if name == "xeon-amx" else "without AMX") in reason


def test_a_bfloat16_moe_is_skipped_only_on_amx(tmp_path: Path) -> None:
    bf16 = matrix.Check(**{**shipped()["moe-alphabet"].__dict__, "serve_args": ("--dtype=bf16",)})
    assert runnable.model_format(bf16) == "moe-bfloat16"
    assert runnable.skip_reason(bf16, local(cpu(tmp_path, "epyc"))) is None
    reason = runnable.skip_reason(bf16, local(cpu(tmp_path, "xeon-amx")))
    assert reason is not None and "X86CPUUnquantizedExperts" in reason and "--dtype float32" in reason


def test_nothing_is_skipped_on_a_gpu_image_or_a_vllm_the_table_does_not_know(tmp_path: Path) -> None:
    nvfp4 = shipped()["moe-nvfp4"]
    amx = cpu(tmp_path, "xeon-amx")
    gpu = runnable.Serving.of({"io.sparkbuild.cuda": "13.0", "io.sparkbuild.vllm.version": "0.33.0"}, amx)
    assert runnable.skip_reason(nvfp4, gpu) is None
    assert runnable.skip_reason(nvfp4, local(amx, "0.33.0")) is None  # not seen: served, and its result says
    assert runnable.skip_reason(nvfp4, runnable.Serving.of({}, amx)) is None  # not a sparkbuild image


def test_a_folder_model_is_judged_by_its_config(tmp_path: Path) -> None:
    cases = {
        "nvfp4": {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}},
        "mxfp4": {"quantization_config": {"quant_method": "mxfp4"}},
        "fp8-block": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
        "moe": {"num_experts": 4},
        "dense": {"hidden_size": 8},
    }
    for expected, config in cases.items():
        (tmp_path / expected).mkdir()
        (tmp_path / expected / "config.json").write_text(json.dumps(config))
        assert runnable.folder_format(tmp_path / expected) == expected
    assert runnable.folder_format(tmp_path / "absent") is None


def test_every_recipe_has_a_format() -> None:
    assert set(model.names()) <= set(runnable.RECIPE_FORMATS)


def test_a_check_served_across_nodes_on_a_gpu_needs_the_other_sparks_named() -> None:
    """On a GPU every node is a Spark of its own: the shipped Spark target's two-node check is skipped, saying
    how to name the second, until one is given; on the CPU (the rehearsal) every node is a container here."""
    spark = next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.id == "vllm-0.33.0-cu130-sm121")
    check = next(c for c in spark.checks if c.name == "moe-nvfp4-2node")
    why = runnable.cluster_reason(check, gpus=True, other_machines=0)
    assert why is not None and "served across 2 nodes" in why and "--node HOST (SPARKBUILD_NODES)" in why
    assert runnable.cluster_reason(check, gpus=True, other_machines=1) is None
    assert runnable.cluster_reason(check, gpus=False, other_machines=0) is None
    one_node = next(c for c in spark.checks if c.name == "moe-nvfp4")
    assert runnable.cluster_reason(one_node, gpus=True, other_machines=0) is None
