"""CUDA bases made here from NVIDIA's PyPI wheels (no Docker Hub), built for real and used: the
toolkit where CMake and nvcc look for it. CUDA 13.0's wheels carry nvcc; CUDA 12.9's do not (their
nvcc wheel holds ptxas and NVVM only), and a 12.9 devel base is refused saying so."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from sparkbuild.build import base_image
from sparkbuild.errors import BuildError
from sparkbuild.oci.engine import Bound, Engine
from sparkbuild.plan import matrix
from sparkbuild.util import host
from tests.support import ROOT
from tests.support.matrix import LOCAL_PLATFORM

pytestmark = pytest.mark.docker

PROBE = r"""
set -e
nvcc --version | tail -2
test -e /usr/local/cuda/lib64/libcudart.so && test -e /usr/local/cuda/lib64/stubs/libcuda.so
cat > /tmp/k.cu <<'CU'
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cub/cub.cuh>
__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }
int main() { return cudaGetLastError() == cudaSuccess ? 0 : 1; }
CU
nvcc -arch=sm_120 /tmp/k.cu -o /tmp/k -lcublas -lcuda -L/usr/local/cuda/lib64/stubs
echo built
"""


def test_a_devel_base_made_from_wheels_compiles_and_links_cuda(engine: Engine, cache: Path) -> None:
    name, release = "trixie-cuda-13.0-devel", "13.0"
    m = matrix.load(ROOT / "matrix.yaml")
    ref = base_image.ensure(engine, m.bases[name], LOCAL_PLATFORM, cache / "rootfs")
    done = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", ref, "-c", PROBE], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"release {release}" in done.stdout and "built" in done.stdout
    labels = engine.inspect(ref)["Config"]["Labels"]
    assert (
        labels["io.sparkbuild.cuda-wheels"].startswith("cuda-toolkit[")
        and release.split(".")[0] in labels["io.sparkbuild.cuda-wheels"]
    )


def test_a_cuda_12_devel_base_from_wheels_is_refused_saying_why(engine: Engine, cache: Path, tmp_path: Path) -> None:
    text = (
        (ROOT / "matrix.yaml")
        .read_text()
        .replace(
            "  trixie-cuda-13.0-runtime:",
            "  cu12-devel:\n"
            '    cuda_wheels: {base: debian-trixie, toolkit: "12.9.1", flavor: devel, components: [nvcc, cudart]}\n'
            "  trixie-cuda-13.0-runtime:",
        )
    )
    (tmp_path / "matrix.yaml").write_text(text)
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    base = matrix.load(tmp_path / "matrix.yaml").bases["cu12-devel"]
    with pytest.raises(BuildError, match=r"cuda-toolkit 12\.9\.1 on PyPI has no nvcc \(its bin/ holds ptxas\).*CUDA 13\.0 on"):
        base_image.ensure(engine, base, LOCAL_PLATFORM, cache / "rootfs")


def test_an_arm64_base_made_here_is_arm64_and_a_build_from_it_asks_no_registry(
    engine: Engine, cache: Path, arm64: str, tmp_path: Path
) -> None:
    """The Debian base made by debootstrap for linux/arm64 is recorded as arm64 (its files are aarch64),
    so BuildKit, building FROM it for linux/arm64, takes it from the engine. Made with ``docker import``,
    an engine of 20.10 recorded it as amd64 whatever the platform asked, and that build looked the base
    up on Docker Hub ("load metadata for docker.io/sparkbuild/base:...") and failed (issue 43)."""
    base = matrix.load(ROOT / "matrix.yaml").bases["debian-bookworm"]
    ref = base_image.ensure(engine, base, arm64, cache / "rootfs")
    found = engine.inspect(ref)
    assert (found["Os"], found["Architecture"]) == ("linux", "arm64")
    # This host reaches no Docker Hub: a build that looked the base up there would fail, not pass.
    (tmp_path / "Dockerfile").write_text(f"FROM {ref}\nRUN uname -m > /machine\n")
    image = engine.build(
        context=tmp_path, tag="sparkbuild-test/from-arm64-base:1", platform=arm64,
        labels={}, build_args={}, secrets={}, log_file=tmp_path / "build.log",
    )  # fmt: skip
    try:
        args = ["docker", "run", "--rm", "--network", "host", "--platform", arm64, image, "cat", "/machine"]
        machine = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        assert machine.strip() == "aarch64"
    finally:
        engine.remove_image("sparkbuild-test/from-arm64-base:1")


@pytest.mark.alone  # a 20 s bound on an emulated step: no other test's load in it
def test_an_emulated_step_that_hangs_is_stopped_at_its_bound_naming_the_step(
    engine: Engine, cache: Path, arm64: str, tmp_path: Path
) -> None:
    """A RUN step of an arm64 build that never ends (here a real sleep, run by QEMU on x86_64) is stopped
    at the build's bound: the error names the platform, that it ran emulated, the bound's origin and
    the step still running; and BuildKit cancels the step, so nothing of it runs on (issue 43)."""
    base = matrix.load(ROOT / "matrix.yaml").bases["debian-bookworm"]
    ref = base_image.ensure(engine, base, arm64, cache / "rootfs")
    marker = f"sparkbuild-test-hang-{time.time_ns()}"
    (tmp_path / "Dockerfile").write_text(f"FROM {ref}\nRUN echo {marker} && sleep 86400\n")
    with pytest.raises(BuildError) as raised:
        engine.build(
            context=tmp_path, tag="sparkbuild-test/hangs:1", platform=arm64, labels={}, build_args={}, secrets={},
            log_file=tmp_path / "build.log", bound=Bound(20, "the test's bound"),
        )  # fmt: skip
    text = str(raised.value)
    how = "linux/arm64, emulated" if host.emulated(arm64) else "linux/arm64"
    assert f"build of sparkbuild-test/hangs:1 ({how}) stopped after 20 s, its bound (the test's bound)" in text
    assert re.search(rf"\[2/2\] RUN echo {marker} && sleep 86400 \(for \d+ s\)", text), text
    assert str(tmp_path / "build.log") in text
    # The step's processes end with the build (BuildKit cancels it when its client goes).
    deadline = time.monotonic() + 60
    while subprocess.run(["pgrep", "-f", marker], capture_output=True, check=False).returncode == 0:
        assert time.monotonic() < deadline, f"the hung step ({marker}) still runs a minute after its build stopped"
        time.sleep(1)
