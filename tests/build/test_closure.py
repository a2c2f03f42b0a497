"""The runtime's dependency closure, resolved for the image's platform (linux/aarch64) and Python
without emulation, against the real package index: uv's resolver with the target platform's markers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparkbuild.build import base_image, closure
from sparkbuild.config.options import Options
from sparkbuild.errors import BuildError
from sparkbuild.plan import matrix
from sparkbuild.upstream import sources
from tests.support import ROOT, cli


@pytest.fixture(scope="module")
def shipped() -> matrix.Matrix:
    return matrix.load(ROOT / "matrix.yaml")


def target(m: matrix.Matrix, id_: str) -> matrix.Target:
    (found,) = [t for t in m.targets if t.id == id_]
    return dataclasses.replace(found, relax=m.rehearsal.relax)  # this sandbox's index gaps, as --offline does


def tree(version: str) -> Path:
    return sources.vllm_sdist(version, Options.from_env().cache)


def test_the_shipped_0_33_runtime_installs_on_aarch64_with_torch_the_cuda_13_build(shipped: matrix.Matrix) -> None:
    found = closure.check(target(shipped, "vllm-0.33.0-cu130-sm121"), tree("0.33.0"), Options.from_env())
    assert found.ok, found.text()
    assert found.platform == "linux/arm64" and found.python == "3.12"
    assert found.torch_cuda == "13.0"
    names = {p.name: p for p in found.packages}
    assert names["torch"].version == "2.14.0" and names["torchvision"].version == "0.29.0"
    assert names["flashinfer-python"].version == "0.7.2.post1" and "ray" in names
    # Every package says which requirement brought it in.
    assert all(p.via for p in found.packages)
    assert "nvidia-cuda-runtime" in closure.requires(found.packages, "torch")  # torch's own CUDA runtime


def test_a_pin_with_no_aarch64_wheel_is_named(shipped: matrix.Matrix) -> None:
    """nvidia-cuda-opencl has wheels for x86_64 and Windows only (a real package, the real index)."""
    broken = dataclasses.replace(
        target(shipped, "vllm-0.33.0-cu130-sm121"), runtime_extras=("ray[cgraph]>=2.48.0", "nvidia-cuda-opencl==13.0.85")
    )
    found = closure.check(broken, tree("0.33.0"), Options.from_env())
    assert found.verdict == "failed"
    problem = " ".join(found.problems)
    assert "nvidia-cuda-opencl==13.0.85 has no wheels with a matching platform tag" in problem
    assert "aarch64" in problem
    with pytest.raises(BuildError, match="cannot be installed for linux/arm64"):
        closure.require(found)


def test_a_torch_that_is_a_cpu_build_on_aarch64_fails(shipped: matrix.Matrix) -> None:
    """PyPI's aarch64 torch 2.10.0 (vLLM 0.19's) is the CPU build: it installs, and serves nothing on the GPU."""
    cpu = dataclasses.replace(target(shipped, "vllm-0.19.0-cu129-sm121"), torch="2.10.0", torch_index="pypi")
    found = closure.check(cpu, tree("0.19.0"), Options.from_env())
    assert found.verdict == "failed" and found.torch_cuda is None
    assert "torch==2.10.0 resolves to a CPU build for linux/arm64; the target asks for CUDA 12.9" in found.problems[0]


def test_a_torch_index_this_machine_cannot_reach_is_said_not_passed() -> None:
    """vLLM 0.19's CUDA torch for aarch64 is only on PyTorch's cu129 index, which this sandbox cannot reach:
    the command says so and fails; it never reports a closure it did not resolve."""
    done = cli.run("closure", "--offline", "--only", "vllm-0.19.0-*", env={})
    assert done.returncode == 5
    assert "unreachable" in done.stdout and "download.pytorch.org/whl/cu129" in done.stdout


def test_a_cuda_version_with_no_wheels_is_a_build_error_saying_where_to_look(shipped: matrix.Matrix, tmp_path: Path) -> None:
    cuda = shipped.bases["trixie-cuda-13.0-devel"].cuda_wheels
    assert cuda is not None
    bogus = dataclasses.replace(cuda, toolkit="13.0.99")
    with pytest.raises(BuildError, match=r"cuda-toolkit\[.*\]==13\.0\.99 .*https://pypi.org/simple/cuda-toolkit/"):
        base_image.download_wheels(bogus, "linux/amd64", tmp_path)
