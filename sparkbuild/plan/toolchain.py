"""Pure decisions about the CUDA compile: parallelism sized to memory, FlashInfer's arch list.

No I/O: the plan passes in what it read from the host, so every rule is testable as a function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from sparkbuild.errors import ConfigError
from sparkbuild.plan.matrix import BuildJobs

GIB = 1024**3
# The peak memory of vLLM's heaviest CUDA units, one nvcc compile each (its cicc, ptxas and host
# compiler), GiB, largest first: vLLM 0.33.0's CUTLASS GEMMs (3.x for SM120, and 2.x) compiled for
# 12.1a with CUDA 13.0 and GCC 14, measured by bench/compile_memory.py
# (bench/results/compile-memory.json; docs/spark.md, build jobs). ninja may start any of them beside
# any other, so the plan sizes its compiles for the worst case: the heaviest ones all at once.
HEAVY_UNITS_GIB = (8.9, 7.4, 7.0, 5.6, 5.4)
# Every other unit, GiB: the largest measured outside those GEMMs is 0.7 (Mamba's selective scan);
# flash-attention's units are not measured here (stand-ins in the rehearsal), hence the room.
OTHER_UNIT_GIB = 2.0
# Room above the measured peaks: another CUTLASS or CUDA release, and on the Spark's unified memory
# whatever the GPU side takes after the plan read MemAvailable.
MARGIN = 1.25
# Memory left to the OS, the engine and the linker.
RESERVED_GIB = 8


def worst_case_gib(compiles: int, threads: int) -> float:
    """The memory ``compiles`` parallel compiles of ``threads`` nvcc threads each can need at once:
    the heaviest units together, with the margin."""
    peaks = [*HEAVY_UNITS_GIB, *[OTHER_UNIT_GIB] * max(0, compiles - len(HEAVY_UNITS_GIB))][:compiles]
    return MARGIN * threads * sum(peaks)


@dataclass(frozen=True, kw_only=True)
class Jobs:
    """What the plan gives vLLM's build: ``MAX_JOBS`` and ``NVCC_THREADS`` as vLLM's setup.py reads
    them (it runs ``MAX_JOBS // NVCC_THREADS`` compiles at once, each with ``NVCC_THREADS`` threads)."""

    max_jobs: int
    nvcc_threads: int
    compiles: int
    why: str

    def build_args(self) -> dict[str, str]:
        return {"MAX_JOBS": str(self.max_jobs), "NVCC_THREADS": str(self.nvcc_threads)}

    def text(self) -> str:
        return f"MAX_JOBS={self.max_jobs} NVCC_THREADS={self.nvcc_threads}: {self.compiles} parallel compiles ({self.why})"


def arch_count(arch_list: str) -> int:
    return len([a for a in re.split(r"[;\s,]+", arch_list.strip()) if a])


def build_jobs(free_memory: int, cores: int, arch_list: str = "12.1a", override: BuildJobs | None = None) -> Jobs:
    """Parallel compiles sized to memory and cores, in vLLM's own terms.

    nvcc's ``--threads`` compiles a unit's gencode targets in parallel, so a single-arch list gains
    nothing from it: one thread per compile, and every core a compile of its own, as many as fit in
    free memory less ``RESERVED_GIB`` when the heaviest units run at once (``worst_case_gib``).
    vLLM divides ``MAX_JOBS`` by ``NVCC_THREADS``, so ``MAX_JOBS`` is compiles x threads. The matrix
    may set either value (``build_jobs:``); vLLM's division then applies to what it set.
    """
    override = override or BuildJobs()
    threads = override.nvcc_threads or min(arch_count(arch_list), 4)
    room = free_memory / GIB - RESERVED_GIB
    if override.max_jobs:
        max_jobs = override.max_jobs
        compiles = max(1, max_jobs // threads)
    else:
        compiles = max([1, *(k for k in range(1, cores // threads + 1) if worst_case_gib(k, threads) <= room)])
        max_jobs = compiles * threads
    why = f"{free_memory / GIB:.0f} GiB free, {cores} cores, {worst_case_gib(compiles, threads):.0f} GB at worst"
    why += f" (the heaviest units at once, measured peaks x {MARGIN}), {arch_count(arch_list)} arch(s)"
    if override.max_jobs or override.nvcc_threads:
        why += "; set in the matrix (build_jobs)"
    return Jobs(max_jobs=max_jobs, nvcc_threads=threads, compiles=compiles, why=why)


FIRST_FLASHINFER = Version("0.5.3")


def flashinfer_arch_list(flashinfer_version: str, arch_list: str) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` for a FlashInfer version and the target's arch list.

    FlashInfer 0.5.3-0.6.6 use each entry verbatim; 0.6.7 turns a plain ``12.x`` into ``12.0f``
    and 0.6.8+ a plain ``12.1`` into ``12.1a``; every version keeps an entry that has a suffix.
    So each SM12x entry is given its arch-specific suffix: the FP4 kernels need it, and the
    result is the same on every version. Entries are separated by spaces.
    """
    try:
        version = Version(flashinfer_version)
    except InvalidVersion:
        raise ConfigError(
            f"FlashInfer ref '{flashinfer_version}' is not a release tag; sparkbuild picks the arch list "
            "per FlashInfer version, so build FlashInfer from a tag like v0.6.6"
        ) from None
    if version < FIRST_FLASHINFER:
        raise ConfigError(
            f"FlashInfer {version} predates FLASHINFER_CUDA_ARCH_LIST support for SM12x (first: {FIRST_FLASHINFER}); "
            "set 'flashinfer: null' to use vLLM's pinned wheel"
        )
    out = []
    for entry in re.split(r"[;\s,]+", arch_list.strip()):
        if not entry:
            continue
        if re.fullmatch(r"12\.\d", entry):
            entry += "a"
        out.append(entry)
    return " ".join(dict.fromkeys(out))
