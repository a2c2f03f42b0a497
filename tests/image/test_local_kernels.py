"""The local image's build-time check loads vLLM's compiled kernels the way vLLM's engine does
(``current_platform.import_kernels()``), and fails where they do not load: vLLM itself only logs a
warning there, so ``import vllm`` and `/health` stay green and the engine dies on its first kernel.

The broken input is built for real: the shipped local image with Debian's libnuma1 removed (a base
without it, as vLLM's CPU docs warn: ``_C`` links libnuma.so.1). The same fault on aarch64, found
rehearsing the arm64 local image under emulation: PyPI's torch for aarch64 (a CUDA build, with NVPL's
BLAS) does not export the ``sbgemm_`` that vLLM's CPU ``_C`` for aarch64 needs from torch's ``+cpu``
build (OpenBLAS); that image's ``import vllm`` passed too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from tests.support import ROOT
from tests.support.images import derived_image

pytestmark = pytest.mark.docker


def build_check(image: str) -> subprocess.CompletedProcess[str]:
    """The image's build-time check (vllm_metadata.py) run again in a container of ``image``."""
    (target,) = [t for t in matrix.load(ROOT / "matrix.yaml").targets if t.profile == "local"]
    args = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image,
            "/opt/sparkbuild/vllm_metadata.py", target.version, target.torch]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, check=False)


def test_an_image_whose_vllm_kernels_do_not_load_fails_the_build_check_naming_why(
    engine: Engine, local_image: str, tmp_path: Path
) -> None:
    assert build_check(local_image).returncode == 0  # the image as built: its kernels load
    broken = derived_image(
        engine, local_image, "sparkbuild-test/no-libnuma:1",
        "RUN apt-get remove --yes --purge libnuma1\n", tmp_path,
    )  # fmt: skip
    try:
        quiet = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", broken, "-c", "import vllm"]
        assert subprocess.run(quiet, capture_output=True, check=False).returncode == 0  # what vLLM alone says
        done = build_check(broken)
        assert done.returncode != 0
        assert "vLLM's compiled kernels did not load (CpuPlatform.import_kernels registered no _C operator)" in done.stderr
        assert "libnuma.so.1: cannot open shared object file" in done.stderr
    finally:
        engine.remove_image(broken)
