"""A check model's cache key names everything its bytes depend on (sparkbuild/models/arithmetic.py): the recipe,
the machine's arithmetic as pinned, the CPU where it cannot be pinned (aarch64), the tools' versions. Two
different models never share a key. A model made without the pins never takes one; the bounded search for
a proven model records each seed it tried. Nothing is made here (tests/models/test_arithmetic.py makes them)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from sparkbuild.errors import BuildError, ToolMissingError
from sparkbuild.models import arithmetic, making, model, moe
from sparkbuild.models.moe.recipe import MoeRecipe
from sparkbuild.util import runlock

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma avx512f amx_tile\n"
EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n"
OLD_X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx\n"
# A GB10's two kinds of core (Cortex-X925, Cortex-A725), and a Grace (Neoverse V2).
GB10 = "".join(f"processor\t: {i}\nCPU implementer\t: 0x41\nCPU part\t: {p}\n\n" for i, p in enumerate(["0xd85", "0xd87"] * 2))
GRACE = "processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"


def current(tmp_path: Path, text: str, machine: str) -> arithmetic.Arithmetic:
    info = tmp_path / f"cpuinfo-{abs(hash(text))}"
    info.write_text(text)
    return arithmetic.current(info, machine)


def test_every_x86_64_with_avx2_makes_under_one_key_intel_with_amx_or_amd(tmp_path: Path) -> None:
    intel, amd = current(tmp_path, X86, "x86_64"), current(tmp_path, EPYC, "x86_64")
    assert intel.key() == amd.key()
    assert intel.pins["MKL_CBWR"] == "COMPATIBLE,STRICT" and intel.pins["ATEN_CPU_CAPABILITY"] == "avx2"


def test_aarch64_keys_name_the_cores_its_blas_picks_kernels_by(tmp_path: Path) -> None:
    spark, grace = current(tmp_path, GB10, "aarch64"), current(tmp_path, GRACE, "aarch64")
    assert spark.cpu == "cores 0x41:0xd85,0x41:0xd87" and grace.cpu == "cores 0x41:0xd4f"
    assert len({spark.key(), grace.key(), current(tmp_path, X86, "x86_64").key()}) == 3


def test_another_version_of_a_tool_is_another_model(tmp_path: Path) -> None:
    here = current(tmp_path, X86, "x86_64")
    newer = dataclasses.replace(here, tools={**here.tools, "torch": "9.9.9"})
    assert newer.key() != here.key()
    cache = tmp_path / "cache"
    assert model.model_dir(cache, "gptoss-mxfp4", here) != model.model_dir(cache, "gptoss-mxfp4", newer)
    assert model.model_dir(cache, "moe-nvfp4", here) != model.model_dir(cache, "moe-fp8", here)


def test_a_cpu_the_pinned_arithmetic_cannot_run_on_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ToolMissingError, match=r"lacks avx2, fma.*make them on another x86_64 or aarch64"):
        current(tmp_path, OLD_X86, "x86_64")
    with pytest.raises(ToolMissingError, match="not riscv64"):
        current(tmp_path, X86, "riscv64")


def test_a_model_made_without_the_pins_is_refused_its_pinned_key() -> None:
    """This test process did not start with the making's pins: a model made here must not be cached as if it had."""
    pytest.importorskip("torch")
    with pytest.raises(BuildError, match=r"made without its pinned arithmetic .*make it with `sparkbuild model gptoss-mxfp4`"):
        making.require_pinned(arithmetic.current(), "gptoss-mxfp4")


def test_the_search_takes_the_next_seed_where_one_is_unproven_and_records_each(tmp_path: Path) -> None:
    """A maker standing in for the training (the proof's verdict is what the search acts on)."""
    seen: list[int] = []

    def maker(r: MoeRecipe, out: Path) -> None:
        seen.append(r.seed)
        (out / "model.safetensors").write_text("weights")
        if r.seed == 1234:
            raise BuildError("model gptoss-mxfp4: the fault sinks_dropped flips no answer token of the reference")
        (out / "sparkbuild-model.json").write_text(json.dumps({"recipe": {"seed": r.seed}}))

    r = moe.RECIPES["gptoss-mxfp4"]
    moe.search(r, tmp_path, maker)
    meta = json.loads((tmp_path / "sparkbuild-model.json").read_text())
    assert seen == [1234, 1235] and meta["search"]["seed"] == 1235
    assert meta["search"]["unproven"] == [
        {"seed": 1234, "unproven": "model gptoss-mxfp4: the fault sinks_dropped flips no answer token of the reference"}
    ]


def test_a_search_that_finds_no_proven_model_says_each_seed_and_what_to_raise(tmp_path: Path) -> None:
    def maker(r: MoeRecipe, out: Path) -> None:
        raise BuildError(f"seed {r.seed} unproven")

    with pytest.raises(
        BuildError, match=r"none of its 3 seeds .*seed 1236: seed 1236 unproven\); raise MoeRecipe.steps or tries"
    ):
        moe.search(moe.RECIPES["gptoss-mxfp4"], tmp_path, maker)
    assert not list(tmp_path.iterdir())


def _cached(cache: Path, name: str, arith: arithmetic.Arithmetic) -> Path:
    """A model folder as a making leaves it: only its record matters to the lookup."""
    folder = model.model_dir(cache, name, arith)
    folder.mkdir(parents=True)
    (folder / making.META).write_text(json.dumps({"arithmetic": arith.record()}))
    return folder


def test_a_host_without_the_model_tools_uses_the_model_made_for_its_machine_and_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install without sparkbuild[model] (it serves checks only) cannot read the tools' versions its key
    names; it takes the model of the recipe made with this machine's pins, copied into its cache."""
    here = current(tmp_path, X86, "x86_64")
    bare = dataclasses.replace(here, tools={t: None for t in here.tools})
    monkeypatch.setattr(arithmetic, "current", lambda *a, **k: bare)
    cache = tmp_path / "cache"
    # Another machine's model of the same recipe is never taken.
    _cached(cache, "alphabet", dataclasses.replace(here, machine="aarch64", cpu="cores 0x41:0xd4f"))
    made = _cached(cache, "alphabet", here)
    assert model.ensure(cache, "alphabet") == made
    # Two of them, made with other tools: which is which, this host cannot tell.
    _cached(cache, "alphabet", dataclasses.replace(here, tools={**here.tools, "torch": "0.0.1"}))
    with pytest.raises(BuildError, match=r"install 'sparkbuild\[model\]' so that the key chooses"):
        model.ensure(cache, "alphabet")


def test_a_second_run_that_needs_a_model_being_made_waits_for_it_and_makes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nightlies on one runner (or the suite's early making and a test) never make one model twice: the
    second waits on the making's lock and takes the first's model."""
    here = current(tmp_path, X86, "x86_64")
    monkeypatch.setattr(arithmetic, "current", lambda *a, **k: here)
    monkeypatch.setattr(making, "run", lambda *a, **k: pytest.fail("made a model another run was making"))
    cache = tmp_path / "cache"
    target = model.model_dir(cache, "alphabet", here)
    lock = target.parent / f".{target.name}.lock"
    got: list[Path] = []
    with runlock.hold(lock, "the first making"):
        waiter = threading.Thread(target=lambda: got.append(model.ensure(cache, "alphabet")))
        waiter.start()
        waiter.join(timeout=2 * runlock.POLL_S)
        assert waiter.is_alive() and not got  # waiting, not making
        _cached(cache, "alphabet", here)
    waiter.join(timeout=30)
    assert got == [target]
