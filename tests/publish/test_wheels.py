"""The wheels published beside an image: their index, the build marker and its check, the pip
command that installs them. The engine and registry parts are tested in
tests/publish/test_attest.py (publish) and tests/lanes/test_rehearsal.py (the real wheels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkbuild.errors import PublishError
from sparkbuild.oci.registry import file_digest
from sparkbuild.plan import matrix
from sparkbuild.publish import wheels
from tests.support import ROOT

VLLM = "vllm-0.33.0+cu130-cp38-abi3-linux_aarch64.whl"
FLASHINFER = "flashinfer_python-0.7.2.post1-py3-none-any.whl"


def spark_target() -> matrix.Target:
    return next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.profile == "spark")


def files(folder: Path, names: dict[str, str]) -> tuple[wheels.File, ...]:
    """Files with the given names (their bytes do not matter to the index: only their hashes)."""
    found = []
    for name, stage in names.items():
        path = folder / name
        path.write_text(f"the content of {name}\n")
        digest, size = file_digest(path)
        found.append(wheels.File(path=path, stage=stage, sha256=digest, size=size))
    return tuple(found)


def collected(tmp_path: Path, build_env: dict[str, str]) -> wheels.Collected:
    made = files(tmp_path, {VLLM: "vllm", "vllm-build-env.txt": "vllm", FLASHINFER: "flashinfer"})
    return wheels.Collected(files=made, built_for=wheels.BuiltFor.of(spark_target()), build_env=build_env)


def test_the_index_names_each_wheel_with_its_hash_and_what_it_was_built_for(tmp_path: Path) -> None:
    found = collected(tmp_path, {"TORCH_CUDA_ARCH_LIST": "12.1a"})
    wheels.check(found)
    index = found.index()
    target = spark_target()
    assert index["built_for"] == {
        "gpu": target.gpu,
        "arch_list": "12.1a",
        "cuda": target.cuda,
        "torch": target.torch,
        "platform": "linux/arm64",
    }
    by_file = {f["file"]: f for f in index["files"]}
    assert by_file[VLLM]["name"] == "vllm" and by_file[VLLM]["version"] == "0.33.0+cu130"
    assert by_file[VLLM]["tags"] == ["cp38-abi3-linux_aarch64"] and by_file[VLLM]["stage"] == "vllm"
    assert by_file[VLLM]["sha256"] == file_digest(tmp_path / VLLM)[0]
    assert by_file[FLASHINFER]["name"] == "flashinfer-python"
    # A side file is published too, without a wheel's name and version.
    assert "name" not in by_file["vllm-build-env.txt"]
    assert [f.name for f in found.wheels] == [VLLM, FLASHINFER]


@pytest.mark.parametrize("compiled", ["12.0a", "12.0;12.1", "8.0 9.0 10.0 12.0"])
def test_a_vllm_compiled_for_another_arch_list_is_not_published_as_the_targets(tmp_path: Path, compiled: str) -> None:
    with pytest.raises(
        PublishError, match=rf"compiled with TORCH_CUDA_ARCH_LIST={compiled}, but the target's arch list is 12.1a"
    ):
        wheels.check(collected(tmp_path, {"TORCH_CUDA_ARCH_LIST": compiled}))


def test_the_same_arch_list_in_another_spelling_passes(tmp_path: Path) -> None:
    target = spark_target()
    two = wheels.BuiltFor(gpu=target.gpu, arch_list="12.0a;12.1a", cuda="13.0", torch="2.14.0", platform="linux/arm64")
    made = wheels.Collected(files=(), built_for=two, build_env={"TORCH_CUDA_ARCH_LIST": "12.1a 12.0a"})
    wheels.check(made)


def test_a_file_pip_would_not_take_for_a_wheel_is_refused(tmp_path: Path) -> None:
    made = files(tmp_path, {"vllm.whl": "vllm"})
    bad = wheels.Collected(files=made, built_for=wheels.BuiltFor.of(spark_target()), build_env={})
    with pytest.raises(PublishError, match=r"/wheels/vllm.whl of stage vllm is not a wheel name pip accepts"):
        wheels.check(bad)


def test_the_install_command_asks_for_the_images_torch_and_the_vllm_requirements(tmp_path: Path) -> None:
    made = files(tmp_path, {VLLM: "vllm", "vllm-requirements.txt": "vllm", FLASHINFER: "flashinfer"})
    index = wheels.Collected(files=made, built_for=wheels.BuiltFor.of(spark_target()), build_env={}).index()
    out = tmp_path / "fetched"
    assert wheels.install_command(out, index) == [
        "python",
        "-m",
        "pip",
        "install",
        "--find-links",
        str(out),
        "--requirement",
        str(out / "vllm-requirements.txt"),
        f"torch=={spark_target().torch}",
        "flashinfer-python",
        "vllm",
    ]


def test_only_plain_file_names_are_written_into_the_out_folder() -> None:
    assert wheels.SAFE_NAME.fullmatch(VLLM) and wheels.SAFE_NAME.fullmatch("vllm-build-env.txt")
    for name in ("../etc/passwd", "/etc/passwd", ".hidden", "a/b.whl", "", "x" * 300):
        assert not wheels.SAFE_NAME.fullmatch(name), name
