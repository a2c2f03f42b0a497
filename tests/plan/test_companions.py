"""A Spark target's FlashInfer and CUTLASS against the ones its vLLM names (sparkbuild/plan/companions.py),
read from vLLM's real source (PyPI's sdists); resolve and the rc lane refuse a drift for real in
tests/lanes/test_resolve.py."""

from __future__ import annotations

import dataclasses

import pytest

from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.plan import companions, matrix
from sparkbuild.plan.matrix import GitSource
from sparkbuild.upstream import externals, sources
from tests.support import ROOT


def named(version: str) -> companions.Named:
    tree = sources.vllm_sdist(version, Options.from_env().cache)
    return companions.Named(
        vllm=version, flashinfer=externals.flashinfer_requirement(tree), cutlass=externals.cutlass_revision(tree)
    )


def test_the_shipped_0_33_target_builds_the_flashinfer_and_cutlass_vllm_0_33_names() -> None:
    found = named("0.33.0")
    assert (found.flashinfer, found.cutlass) == ("0.7.2.post1", "v4.7.1")
    targets = [t for t in matrix.load(ROOT / "matrix.yaml").targets if t.id in ("vllm-0.33.0-cu130-sm121", "vllm-rc-cu130-sm121")]
    assert len(targets) == 2 and all(companions.mismatches(t, found) == [] for t in targets)


def test_a_drift_names_both_sides_and_a_branch_is_not_compared() -> None:
    target = next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.id == "vllm-0.33.0-cu130-sm121")
    assert target.flashinfer is not None and target.cutlass is not None
    older = named("0.32.0")  # flashinfer-python==0.7.0.post1
    (line,) = companions.mismatches(target, older)
    assert line == (
        "flashinfer: the target builds v0.7.2.post1, vLLM 0.32.0 requires flashinfer-python==0.7.0.post1 "
        "(requirements/cuda.txt): set flashinfer: {ref: v0.7.0.post1}"
    )
    with pytest.raises(ConfigError, match=r"matrix.yaml:\d+: vllm-0.33.0-cu130-sm121: not what its vLLM names:"):
        companions.require(target, older)
    on_branch = dataclasses.replace(target, flashinfer=GitSource(repo=target.flashinfer.repo, ref="main", commit=None))
    assert companions.mismatches(on_branch, older) == []
