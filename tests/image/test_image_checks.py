"""The checks a Spark build runs on its image, run here on real images:

- check-binary on vLLM's extensions copied out of an image (``build.check_binaries``), with
  extension libraries compiled here by nvcc and installed where ``installed.json`` says vLLM is; its
  reports kept by the image's id are read again with no container created, a failure failing again;
- ``check_image.py`` (the build-time check of the Spark runtime stage) inside the real local vLLM
  image, whose torch is a CPU build: it must refuse it, and a wrong version and a missing commit.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import BinaryCheckError
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from tests.support import ROOT
from tests.support.images import Created
from tests.support.matrix import LOCAL_PLATFORM

pytestmark = [pytest.mark.docker, pytest.mark.nvcc]
VLLM = "/opt/venv/lib/python3.11/site-packages/vllm"
KERNEL = "__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }\n"


def extension(folder: Path, name: str, *gencodes: str) -> None:
    (folder / "k.cu").write_text(KERNEL)
    flags = [f for g in gencodes for f in ("-gencode", g)]
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", *flags, str(folder / "k.cu"), "-o", str(folder / name)], check=True)


def image_with(engine: Engine, base: str, tmp_path: Path, libraries: dict[str, tuple[str, ...]], tag: str) -> str:
    context = tmp_path / tag.replace(":", "-").replace("/", "-")
    (context / "vllm").mkdir(parents=True)
    for name, gencodes in libraries.items():
        extension(context / "vllm", name, *gencodes)
    (context / "vllm" / "__init__.py").write_text("")
    (context / "installed.json").write_text(json.dumps({"vllm_path": VLLM}))
    (context / "Dockerfile").write_text(f"FROM {base}\nCOPY vllm {VLLM}\nCOPY installed.json /opt/sparkbuild/installed.json\n")
    engine.build(
        context=context,
        tag=tag,
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=tmp_path / "build.log",
    )
    return tag


def test_check_binary_runs_on_the_extensions_in_the_image(engine: Engine, base: str, tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    good = image_with(
        engine,
        base,
        tmp_path,
        {"_C.abi3.so": ("arch=compute_121a,code=sm_121a",), "_moe_C.abi3.so": ("arch=compute_120f,code=sm_120f",)},
        "sparkbuild-test/binaries:good",
    )
    with Created(engine, good) as first:
        reports = build.check_binaries(engine, good, "12.1a", tmp_path / "out-good", kept_in=kept)
    assert first.events  # the libraries were copied out of a created container
    assert {Path(r.path).name: r.ok for r in reports} == {"_C.abi3.so": True, "_moe_C.abi3.so": True}
    shown = (tmp_path / "out-good" / "check-binary.txt").read_text()
    assert f"in {VLLM}\n" in shown and "_C.abi3.so: runs with sm_121a (1)" in shown  # paths as they are in the image

    bad = image_with(
        engine,
        base,
        tmp_path,
        {"_C.abi3.so": ("arch=compute_121a,code=sm_121a",), "_flash_attn.abi3.so": ("arch=compute_120a,code=sm_120a",)},
        "sparkbuild-test/binaries:bad",
    )
    with pytest.raises(BinaryCheckError, match=r"_flash_attn\.abi3\.so") as info:
        build.check_binaries(engine, bad, "12.1", tmp_path / "out-bad", kept_in=kept)  # the GB10: sm_120a cubins do not run
    assert "_C.abi3.so" not in str(info.value)
    failed = (tmp_path / "out-bad" / "check-binary.txt").read_text()
    assert "_flash_attn.abi3.so: scale(float*) [sm_120a]" in failed

    # Checked again: the kept reports, the same table, the failure again, and no container created.
    with Created(engine, good, bad) as again:
        assert build.check_binaries(engine, good, "12.1a", tmp_path / "again-good", kept_in=kept) == reports
        with pytest.raises(BinaryCheckError, match=r"_flash_attn\.abi3\.so"):
            build.check_binaries(engine, bad, "12.1", tmp_path / "again-bad", kept_in=kept)
    assert again.events == []
    assert (tmp_path / "again-good" / "check-binary.txt").read_text() == shown
    assert (tmp_path / "again-bad" / "check-binary.txt").read_text() == failed
    assert len(list(kept.iterdir())) == 2


def test_check_image_refuses_a_cpu_torch_a_wrong_version_and_a_missing_commit(
    engine: Engine, base: str, cache: Path, tmp_path: Path
) -> None:
    opts = Options.from_env(matrix=ROOT / "matrix.yaml", profile="local", cache=cache, out=tmp_path / "out")
    (p,) = plan.make(opts)
    image = build.build(engine, p, opts).image  # the real vLLM CPU image (reused when the nightly built it)
    script = ROOT / "dockerfiles" / "spark" / "check_image.py"
    args = ["--vllm-version", "0.33.0", "--vllm-commit", "a" * 40, "--torch", "2.13.0+cpu", "--cuda", "13.0", "--kernels", "none"]
    result = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            "-v",
            f"{script}:/check_image.py:ro",
            "--entrypoint",
            "python",
            image,
            "/check_image.py",
            *args,
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "image check failed" in result.stderr
    assert "torch 2.13.0+cpu is a CPU build (torch.version.cuda is None)" in result.stderr
    assert "vLLM 0.32.0+cpu is installed, the plan asked for 0.33.0" in result.stderr
    assert "/opt/sparkbuild/sources.txt is missing" in result.stderr

    # One check looked at again (--only): that one runs, the others do not.
    again = subprocess.run(["docker", "run", "--rm", "--network", "host", "-v", f"{script}:/check_image.py:ro",
                            "--entrypoint", "python", image, "/check_image.py", *args, "--only", "torch"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert again.returncode == 1 and "torch: RuntimeError: torch 2.13.0+cpu is a CPU build" in again.stderr
    assert "vLLM 0.32.0" not in again.stderr and "sources.txt" not in again.stderr
    wrong = subprocess.run(["docker", "run", "--rm", "--network", "host", "-v", f"{script}:/check_image.py:ro",
                            "--entrypoint", "python", image, "/check_image.py", *args, "--only", "torchh"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert wrong.returncode == 1 and "no such check: torchh; the checks are torch, vllm, vllm_extensions" in wrong.stderr
