"""Pinning upstream's vLLM wheel for real, from a package index on loopback: ``sparkbuild resolve
--wheels-only`` finds the wheel of the release for the target's platform, downloads it (sha256 from the
index), runs check-binary on it for the target's GPU and writes what it found into the lock; the plan
then chooses the wheel or the source build from that.

The wheel that must fail is made here for real: vLLM's mixed-arch build in miniature, a library whose
one kernel is built only for sm_120a beside kernels for sm_121a (nvcc 13, cached by content), in a
spec-conformant wheel named as upstream names its aarch64 0.33.0 wheel. It must never be chosen: auto
compiles and says why, ``vllm_from: wheel`` is refused at its line. The same wheel with only the
sm_121a kernels passes and is chosen.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sparkbuild.config.options import Options
from sparkbuild.plan import lock
from tests.support import ROOT, nvcc
from tests.support.index import loopback_index
from tests.support.matrix import line_of

pytestmark = pytest.mark.nvcc
TARGET = "vllm-0.33.0-cu130-sm121"
FILENAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl"


def make_wheel(path: Path, library: Path) -> Path:
    """A wheel as PEP 427 has it: ``vllm/_C.abi3.so`` (``library``), vLLM's torch requirement in its
    METADATA, its tags in WHEEL and every file's sha256 in RECORD."""
    files = {
        "vllm/__init__.py": b"",
        "vllm/_C.abi3.so": library.read_bytes(),
        "vllm-0.33.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\nRequires-Dist: torch==2.14.0\n",
        "vllm-0.33.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: sparkbuild-test\nRoot-Is-Purelib: false\n"
        b"Tag: cp38-abi3-manylinux_2_28_aarch64\n",
    }
    record = [f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}" for name, data in files.items()]
    files["vllm-0.33.0.dist-info/RECORD"] = ("\n".join([*record, "vllm-0.33.0.dist-info/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return nvcc.libraries(Options.from_env().cache, tmp_path_factory.mktemp("cu"))


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A PEP 503 index on 127.0.0.1 serving ``root/vllm/`` (the test puts the wheel there)."""
    root = tmp_path / "index"
    (root / "vllm").mkdir(parents=True)

    with loopback_index(root) as url:
        yield url, root


def serve(root: Path, wheel: Path) -> str:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (root / "vllm" / wheel.name).write_bytes(wheel.read_bytes())
    (root / "vllm" / "index.html").write_text(f'<a href="{wheel.name}#sha256={digest}">{wheel.name}</a>\n')
    return digest


def sparkbuild(*args: str, folder: Path, index: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARKBUILD_PYPI_SIMPLE": index, "SPARKBUILD_CACHE": str(folder / "cache")}
    return subprocess.run([sys.executable, "-m", "sparkbuild", *args], capture_output=True, text=True, env=env, check=False)


@pytest.fixture
def shipped(tmp_path: Path) -> Path:
    (tmp_path / "matrix.yaml").write_text(f"patches_dir: {ROOT / 'patches'}\n" + (ROOT / "matrix.yaml").read_text())
    return tmp_path / "matrix.yaml"


def test_a_wheel_that_fails_check_binary_is_never_chosen(
    shipped: Path, index: tuple[str, Path], libraries: dict[str, Path], tmp_path: Path
) -> None:
    url, root = index
    digest = serve(root, make_wheel(tmp_path / FILENAME, libraries["libmixed.so"]))
    done = sparkbuild("resolve", "--wheels-only", "--matrix", str(shipped), folder=tmp_path, index=url)
    assert done.returncode == 0, done.stderr
    assert f"{FILENAME}: check-binary for GPU 12.1 FAILS (3 kernels in 1 libraries: 2 sass, 0 ptx, 0 other, 1 fail" in done.stdout
    pinned = lock.read(lock.default_path(shipped)).wheel("0.33.0", "linux/arm64")
    assert pinned is not None and (pinned.filename, pinned.sha256, pinned.torch, pinned.cuda) == (
        FILENAME,
        digest,
        "torch==2.14.0",
        None,
    )
    assert pinned.url == f"{url}vllm/{FILENAME}" and not pinned.check_binary["12.1"].ok
    # The index has no 0.19.0 wheel: the lock says so, and that target's plan will say why it compiles.
    older = lock.read(lock.default_path(shipped)).wheel("0.19.0", "linux/arm64")
    assert older is not None and older.missing is not None and "has no vLLM 0.19.0 wheel for linux/arm64" in older.missing

    shown = sparkbuild("plan", "--json", "--matrix", str(shipped), "--only", TARGET, folder=tmp_path, index=url)
    (planned,) = json.loads(shown.stdout)
    assert planned["vllm_from"]["mode"] == "source"
    why = planned["vllm_from"]["why"]
    assert why.startswith(f"{FILENAME} fails check-binary for GPU 12.1: 3 kernels in 1 libraries: 2 sass, 0 ptx, 0 other, 1 fail")
    assert "vllm/_C.abi3.so: _Z11only_sm120aPf (sm_120a)" in why

    data = yaml.safe_load(shipped.read_text())
    next(t for t in data["targets"] if t.get("id") == TARGET)["vllm_from"] = "wheel"
    shipped.write_text(yaml.safe_dump(data, sort_keys=False))
    refused = sparkbuild("plan", "--matrix", str(shipped), "--only", TARGET, folder=tmp_path, index=url)
    assert refused.returncode == 2, refused.stderr
    error = refused.stderr.strip().splitlines()[-1]
    assert f"matrix.yaml:{line_of(shipped, 'vllm_from: wheel')}: targets[1].vllm_from: upstream's wheel cannot be used: " in error
    assert f"{FILENAME} fails check-binary for GPU 12.1" in error and refused.stdout == ""


def test_a_wheel_whose_kernels_run_on_the_gpu_is_chosen(
    shipped: Path, index: tuple[str, Path], libraries: dict[str, Path], tmp_path: Path
) -> None:
    url, root = index
    digest = serve(root, make_wheel(tmp_path / FILENAME, libraries["libgood.so"]))
    done = sparkbuild("resolve", "--wheels-only", "--matrix", str(shipped), "--json", folder=tmp_path, index=url)
    assert done.returncode == 0, done.stderr
    pins = {p["name"]: p for p in json.loads(done.stdout)["pins"]}
    assert pins["vllm 0.33.0 wheel linux/arm64"]["value"] == digest and pins["vllm 0.33.0 wheel linux/arm64"]["change"] == "new"
    shown = sparkbuild("plan", "--json", "--matrix", str(shipped), "--only", TARGET, folder=tmp_path, index=url)
    (planned,) = json.loads(shown.stdout)
    assert planned["vllm_from"]["mode"] == "wheel" and planned["vllm_from"]["wheel"]["sha256"] == digest
    assert (
        "passes check-binary for GPU 12.1 (2 kernels in 1 libraries: 2 sass, 0 ptx, 0 other, 0 fail), "
        "requires torch==2.14.0 and links no libcudart"
    ) in planned["vllm_from"]["why"]
    # A second resolve reads the judged wheel from the cache: the same pin, unchanged.
    again = sparkbuild("resolve", "--wheels-only", "--matrix", str(shipped), "--json", folder=tmp_path, index=url)
    assert {p["name"]: p["change"] for p in json.loads(again.stdout)["pins"]}["vllm 0.33.0 wheel linux/arm64"] == "same"
