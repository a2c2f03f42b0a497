"""vLLM's start-up predicted in a built image (sparkbuild/verify/startup.py, issue 38): vLLM's own parser,
engine config and model construction for each check, judged by the kernel-path gate.

On the local image (vLLM 0.32 on this CPU, nothing faked), in one probe run: the shipped local checks
predict what verify sees on their servers (``moe CPU``); a check whose context is longer than its
model's is refused by vLLM's own config check, with vLLM's message; a check model whose architecture
vLLM does not know is refused with vLLM's own error, not a traceback of sparkbuild's; and a check that
accepts only FlashInfer's MoE fails the gate, naming each layer vLLM gave its CPU experts. An image
without vLLM fails at once, naming the module. The same inputs again reuse the probe's kept output and
start no container; another image, argument or model file is another key.

The Spark side, vLLM 0.33.0 with a GB10 faked, is read from its probe's output as recorded in the
rehearsed image on 2026-12-06 (tests/data/startup/vllm-0.33.0-gb10-faked.json) and run for real in
tests/lanes/test_rehearsal.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
from pathlib import Path
from typing import Any

import pytest

from sparkbuild.errors import VerifyError
from sparkbuild.models import model
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.plan.matrix import Check
from sparkbuild.upstream import kernelpath
from sparkbuild.verify import startup
from tests.support import DATA, ROOT
from tests.support.images import Created

RECORDED = DATA / "startup" / "vllm-0.33.0-gb10-faked.json"


def shipped(name: str) -> Check:
    return matrix.load(ROOT / "matrix.yaml").checks[name]


def recorded() -> startup.Startup:
    found = json.loads(RECORDED.read_text())
    out = json.dumps(found)  # the probe prints it on one line
    names = [c["name"] for c in found["cases"]]
    return startup.read("sparkbuild/rehearsal:x", out, [shipped(n) for n in names], faked=startup.FAKED_GB10)


def test_vllm_0_33_on_a_faked_gb10_gives_gpt_oss_marlin_and_the_fp4_checks_their_kernels() -> None:
    """What the shipped 0.33.0 target's checks get from vLLM's own code on a GB10 (faked): gpt-oss's
    MXFP4 MoE on Marlin and its attention, sinks and all, on Triton (the rehearsal's image has no
    FlashInfer cubins: docs/startup.md); the NVFP4 and FP8 checks pass their gate."""
    found = recorded()
    by_name = {p.check: p for p in found.predictions}
    assert [p.check for p in found.predictions if not p.ok] == ["gptoss-mxfp4"]
    gptoss = by_name["gptoss-mxfp4"]
    assert gptoss.summary() == "attention TRITON_ATTN x2, moe MARLIN x2"
    problems = "\n".join(found.problems())
    assert "check gptoss-mxfp4: the kernel path vLLM will choose fails the gate:" in problems
    assert "moe: expected FLASHINFER_CUTLASS_MXFP4_MXFP8, vLLM chose MARLIN" in problems
    assert "vLLM chose MARLIN: " in problems and "Using 'MARLIN' Mxfp4 MoE backend." in problems
    layers = "model.layers.0.mlp.experts.routed_experts, model.layers.1.mlp.experts.routed_experts"
    assert f"moe MARLIN on 2 layer(s): {layers}" in problems
    assert [(c.kind, [b for b, _ in c.found]) for c in by_name["moe-nvfp4"].kernels] == [
        ("moe", ["FLASHINFER_CUTLASS"]),
        ("nvfp4_gemm", ["FLASHINFER_CUTLASS"]),
    ]
    # The image's entrypoint defaults reached vLLM: its graph sizes for 16 sequences, with 5 and 10.
    assert by_name["moe-nvfp4"].values["cudagraph_capture_sizes"] == [1, 2, 4, 5, 8, 10, 16, 24, 32]
    assert by_name["moe-nvfp4"].values["max_num_seqs"] == 16
    own = r"(?s)sparkbuild/rehearsal:x: vLLM 0.33.0's own start-up code \(GPU FAKED as a GB10.*MARLIN"
    with pytest.raises(VerifyError, match=own):
        found.require()
    shown = found.to_json()
    assert shown["ok"] is False and shown["faked"] == startup.FAKED_GB10
    assert {c["check"]: c["ok"] for c in shown["checks"]} == {
        "alphabet": True,
        "moe-nvfp4": True,
        "moe-fp8-eager": True,
        "gptoss-mxfp4": False,
    }


def test_the_shipped_spark_target_names_no_check_that_its_prediction_fails() -> None:
    """The matrix cannot promise gpt-oss on the 0.33.0 target where vLLM's own code gives it Marlin:
    the checks the recorded prediction fails are left out, with the reason (`plan` shows it)."""
    target = next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.id == "vllm-0.33.0-cu130-sm121")
    failed = {p.check for p in recorded().predictions if not p.ok}
    assert failed and not failed & {c.name for c in target.checks}
    left = dict(target.left_out)
    assert {"gptoss-mxfp4", "gptoss-mxfp4-eager"} <= set(left) and "MARLIN" in left["gptoss-mxfp4"]


def served(log: Path, check: Check, version: str) -> Any:
    """A verify result's kernels, as the gate reads them from a real server's log (the only field
    ``startup.mispredicted`` reads)."""
    return types.SimpleNamespace(kernels=tuple(kernelpath.gate(check.expected_kernels, log.read_text(), version)))


def test_a_server_that_chose_otherwise_than_predicted_is_named() -> None:
    """verify compares what a server's log shows with what was predicted: the recorded GB10 prediction of
    moe-nvfp4 against a real CPU server's log (vLLM 0.32, a Qwen-style MoE on its CPU experts)."""
    log = DATA / "kernel-logs" / "vllm-0.32.0-cpu-mixtral.log"
    check = dataclasses.replace(shipped("moe-nvfp4"), kernels=(("moe", ("CPU", "FLASHINFER_CUTLASS")),))
    wrong = startup.mispredicted(recorded(), {"moe-nvfp4": served(log, check, "0.32.0")})
    assert wrong == [
        "check moe-nvfp4: moe: predicted FLASHINFER_CUTLASS, the server chose CPU: the start-up prediction "
        f"({startup.FAKED_GB10}) was wrong here"
    ]


@dataclasses.dataclass(frozen=True)
class Inputs:
    checks: list[Check]
    models: dict[str, Path]
    kept: Path  # the cache the probe's output is kept in


@pytest.fixture(scope="module")
def inputs(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    folder = tmp_path_factory.mktemp("startup")
    alphabet = model.ensure(cache, "alphabet")
    unknown = folder / "unknown-architecture"
    shutil.copytree(alphabet, unknown)
    config: dict[str, Any] = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    moe = shipped("moe-alphabet")
    checks = [
        shipped("alphabet"),
        moe,
        dataclasses.replace(shipped("alphabet"), name="too-long", serve_args=("--dtype", "float32", "--max-model-len", "4096")),
        dataclasses.replace(shipped("alphabet"), name="unknown-architecture"),
        dataclasses.replace(moe, name="flashinfer-only", kernels=(("moe", ("FLASHINFER_CUTLASS",)),)),
    ]
    models = {c.name: model.ensure(cache, c.model) for c in checks} | {"unknown-architecture": unknown}
    return Inputs(checks, models, folder / "kept")


@pytest.fixture(scope="module")
def predicted(engine: Engine, local_image: str, inputs: Inputs) -> startup.Startup:
    # A cache of this module's own: the probe runs here, whatever an earlier session kept.
    with Created(engine, local_image, named=startup.PROBE_NAME) as run:
        found = startup.predict(engine, local_image, inputs.checks, inputs.models, gb10_stub=None, cache=inputs.kept)
    assert run.events  # it ran in a container of the image (what the reuse below must not do)
    return found


@pytest.mark.docker
def test_the_local_checks_predict_what_their_servers_choose(predicted: startup.Startup) -> None:
    by_name = {p.check: p for p in predicted.predictions}
    assert predicted.vllm == "0.32.0" and predicted.faked is None
    assert by_name["alphabet"].ok and by_name["alphabet"].stage == "done"
    moe = by_name["moe-alphabet"]
    assert moe.ok and [(c.kind, [b for b, _ in c.found]) for c in moe.kernels] == [("moe", ["CPU"])]
    assert {layer["kind"] for layer in moe.layers} == {"attention", "moe"}
    # The local image names no serving defaults: vLLM got the check's own arguments.
    assert by_name["alphabet"].args[1:] == ("--dtype", "float32", "--max-model-len", "128")
    assert by_name["alphabet"].values["max_model_len"] == 128


@pytest.mark.docker
def test_the_local_prediction_matches_a_real_cpu_servers_log(predicted: startup.Startup) -> None:
    log = DATA / "kernel-logs" / "vllm-0.32.0-cpu-mixtral.log"
    assert startup.mispredicted(predicted, {"moe-alphabet": served(log, shipped("moe-alphabet"), "0.32.0")}) == []


@pytest.mark.docker
def test_vllm_refuses_a_context_longer_than_the_models_in_its_own_words(predicted: startup.Startup) -> None:
    too_long = next(p for p in predicted.predictions if p.check == "too-long")
    assert not too_long.ok and too_long.stage == "config"
    assert too_long.error is not None and "max_model_len" in too_long.error and "4096" in too_long.error
    assert f"check too-long: vLLM refuses to start (config): {too_long.error}" in predicted.problems()


@pytest.mark.docker
def test_a_model_vllm_cannot_load_is_named_with_vllms_own_error(predicted: startup.Startup) -> None:
    unknown = next(p for p in predicted.predictions if p.check == "unknown-architecture")
    assert not unknown.ok and unknown.stage == "config"
    assert unknown.error is not None and "NoSuchModelForCausalLM" in unknown.error and "Traceback" not in unknown.error


@pytest.mark.docker
def test_a_check_whose_backends_vllm_will_not_choose_fails_naming_each_layer(predicted: startup.Startup) -> None:
    wrong = next(p for p in predicted.predictions if p.check == "flashinfer-only")
    problems = "\n".join(wrong.problems(predicted.vllm))
    assert "moe: expected FLASHINFER_CUTLASS, vLLM chose CPU: " in problems
    assert "moe CPU on 2 layer(s): model.layers.0.mlp.experts" in problems
    with pytest.raises(VerifyError, match="flashinfer-only"):
        predicted.require()


@pytest.mark.docker
def test_an_image_without_vllm_fails_naming_the_module(engine: Engine, base: str, cache: Path) -> None:
    check = shipped("alphabet")
    with pytest.raises(VerifyError, match=r"no vLLM to import in this image \(ModuleNotFoundError: No module named 'vllm'\)"):
        startup.predict(engine, base, [check], {check.name: model.ensure(cache, "alphabet")}, gb10_stub=None)


def key_of(engine: Engine, image: str, checks: list[Check], models: dict[str, Path]) -> str:
    return startup.inputs_key(engine, image, *startup.layout(checks, models), None)


@pytest.mark.docker
def test_the_same_inputs_again_reuse_the_kept_output_and_start_no_container(
    engine: Engine, local_image: str, inputs: Inputs, predicted: startup.Startup
) -> None:
    with Created(engine, local_image, named=startup.PROBE_NAME) as run:
        again = startup.predict(engine, local_image, inputs.checks, inputs.models, gb10_stub=None, cache=inputs.kept)
    assert run.events == []
    assert again == predicted  # judged again by the same rules: the same predictions
    assert len(list((inputs.kept / "startup").iterdir())) == 1


@pytest.mark.docker
def test_another_image_argument_or_model_file_is_another_key(
    engine: Engine, local_image: str, base: str, inputs: Inputs, tmp_path: Path
) -> None:
    key = key_of(engine, local_image, inputs.checks, inputs.models)
    assert key == key_of(engine, local_image, inputs.checks, inputs.models)
    assert key_of(engine, base, inputs.checks, inputs.models) != key
    seeded = [dataclasses.replace(inputs.checks[0], serve_args=(*inputs.checks[0].serve_args, "--seed", "1")), *inputs.checks[1:]]
    assert key_of(engine, local_image, seeded, inputs.models) != key
    edited = tmp_path / "alphabet"
    shutil.copytree(inputs.models["alphabet"], edited)
    (edited / "config.json").write_text((edited / "config.json").read_text() + " ")
    assert key_of(engine, local_image, inputs.checks, {**inputs.models, "alphabet": edited}) != key


def test_a_hub_snapshots_linked_files_are_keyed_and_a_large_one_by_its_size_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hugging Face cache's layout (a snapshot's files are relative links to blobs outside it, as a
    hub check's model is on the runner): every file is read through its link; a weight shard past
    WHOLE_BYTES is keyed by its size and modification time, not read."""
    repo = tmp_path / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, blob, text in (("config.json", "b1", '{"a": 1}'), ("model.safetensors", "b2", "x" * 64)):
        (repo / "blobs" / blob).write_text(text)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    key = startup.model_digest(snapshot)
    (repo / "blobs" / "b1").write_text('{"a": 2}')
    assert startup.model_digest(snapshot) != key  # a config's bytes
    monkeypatch.setattr(startup, "WHOLE_BYTES", 32)  # the shard is now "large"
    shard = repo / "blobs" / "b2"
    os.utime(shard, ns=(1, 1))
    before = startup.model_digest(snapshot)
    shard.write_text("y" * 64)
    os.utime(shard, ns=(1, 1))
    assert startup.model_digest(snapshot) == before  # same size and time: not read
    os.utime(shard, ns=(2, 2))
    assert startup.model_digest(snapshot) != before
