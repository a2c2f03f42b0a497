"""What sparkbuild reads from vLLM's own build files, held on every release with an sdist (not on the
versions a test happens to name): the external projects its CMake clones, the requirements its
setup.py declares, and how its setup.py turns MAX_JOBS and NVCC_THREADS into parallel compiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparkbuild.image import vllm_setup
from sparkbuild.plan import toolchain
from sparkbuild.upstream import externals
from tests.support.trees import RELEASES

GIB = toolchain.GIB
_SHA = re.compile(r"^[0-9a-f]{40}$")


@pytest.mark.parametrize("version", RELEASES)
def test_every_source_vllms_cmake_would_clone_can_be_handed_a_local_tree(version: str, every_tree: dict[str, Path]) -> None:
    tree = every_tree[version]
    found = externals.scan(tree)
    declaring = sorted(p.name for p in (tree / externals.FOLDER).glob("*.cmake") if "GIT_REPOSITORY" in p.read_text())
    assert sorted(e.file.rsplit("/", 1)[1] for e in found) == declaring  # every clone is read
    for e in found:
        assert e.env is not None and e.env.endswith("_SRC_DIR"), e  # the compile needs no GitHub
        assert e.repo.startswith("https://github.com/") and "${" not in e.repo + e.ref, e
        assert _SHA.match(e.ref) or re.fullmatch(r"v\d+\.\d+\.\d+", e.ref), e  # a commit, or a tag resolve pins
    # CMakeLists.txt clones nothing but CUTLASS, which the matrix pins (VLLM_CUTLASS_SRC_DIR).
    cmake = (tree / "CMakeLists.txt").read_text()
    assert re.findall(r"GIT_REPOSITORY\s+(\S+)", cmake) == ["https://github.com/nvidia/cutlass.git"]
    assert re.fullmatch(r"v\d+\.\d+\.\d+", externals.cutlass_revision(tree) or ""), version


@pytest.mark.parametrize("version", RELEASES)
def test_vllms_own_get_requirements_gives_the_runtime_its_pins(version: str, every_tree: dict[str, Path]) -> None:
    for cuda in ("12.9", "13.0"):
        found = vllm_setup.requirements(every_tree[version], cuda)
        names = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in found}  # type: ignore[union-attr]
        assert {"torch", "torchvision", "torchaudio", "transformers"} <= names, (version, cuda)
        assert any(re.fullmatch(r"torch==[\d.]+", r) for r in found), (version, cuda)


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize(
    ("free_gb", "cores", "arch_list"),
    [(120, 20, "12.1a"), (24, 2, "12.1a"), (1000, 8, "12.0a;12.1a"), (10, 64, "12.1a")],
)
def test_the_plans_build_jobs_mean_what_vllms_setup_py_makes_of_them(
    version: str, free_gb: int, cores: int, arch_list: str, every_tree: dict[str, Path]
) -> None:
    jobs = toolchain.build_jobs(free_gb * GIB, cores, arch_list)
    compiles, threads = vllm_setup.compute_num_jobs(every_tree[version], jobs.max_jobs, jobs.nvcc_threads, cores)
    assert (compiles, threads) == (jobs.compiles, jobs.nvcc_threads)


def test_an_extra_is_read_at_vllms_own_pin(every_tree: dict[str, Path]) -> None:
    """vLLM 0.33.0's b12x extra (FlashInfer's SM12x MoE kernels), as setup.py's extras_require names it."""
    assert vllm_setup.extras(every_tree["0.33.0"], ["b12x"]) == ["b12x==1.5.1"]
    with pytest.raises(vllm_setup.SetupError, match=r"no extra nothing; it has .*b12x"):
        vllm_setup.extras(every_tree["0.33.0"], ["nothing"])
