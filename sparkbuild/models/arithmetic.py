"""The arithmetic a check model is made with, pinned, and named in its cache key.

A check model is trained for thousands of steps; a difference in the last bit of one product early on
ends in another model. Left to themselves, torch's CPU kernels differ from machine to machine (issue 42,
measured on one Intel Xeon with AMX): ATen picks its vectorized kernels by the CPU (AVX512 here, AVX2 on
many others), and MKL, torch's BLAS on x86_64, picks its sgemm kernels by the CPU's instruction set and
vendor and, outside its reproducible mode, by the memory alignment of its operands (the same machine gave
two models, in the suite and from the command line). So the making runs in a process of its own
(``sparkbuild.models.making``) with its arithmetic pinned:

- **x86_64**: ATen's AVX2 kernels (``ATEN_CPU_CAPABILITY``, every x86_64 CPU that runs torch's AVX2
  build), MKL's conditional numerical reproducibility on its ``COMPATIBLE`` branch, ``STRICT`` (the same
  results on every Intel and AMD CPU, whatever the alignment; its ``AVX2`` branch binds Intel CPUs only),
  one thread. The same bytes on every x86_64 machine: ``tests/models/test_arithmetic.py`` makes them under
  the instruction sets this machine can select and compares.
- **aarch64**: ATen's NEON kernels (``default``: a Spark's cores would pick SVE128, a Graviton3 SVE256),
  one thread. torch's aarch64 BLAS is NVIDIA's NVPL, which picks its kernels by the CPU and has no switch to
  pin them, so the bytes may differ between aarch64 CPUs: the key names the CPU's cores (``CPU part`` in
  /proc/cpuinfo), and the making there reaches a proven model by a bounded search (moe.search).
- **both**: oneDNN off (``torch.backends.mkldnn``, set in the process): it picks its bf16 kernels by the
  CPU (AMX, AVX512-BF16, AVX2 gave three different products here), and without it torch's own bf16 GEMM
  gives one product under every instruction-set setting.

The key also names the versions of the tools that compute the model (torch, transformers, tokenizers,
the quantizers): another version is another model. Two different models never share a key.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sparkbuild.errors import ToolMissingError
from sparkbuild.util import host

CPUINFO = Path("/proc/cpuinfo")
# The distributions whose code computes a model's bytes.
TOOLS = ("torch", "transformers", "tokenizers", "safetensors", "compressed-tensors", "llmcompressor")
# Set in the making's process whatever the caller's environment says (a user's own ATEN_CPU_CAPABILITY or
# OMP_NUM_THREADS must not reach it). Threads: one (MKL's reproducible mode needs a fixed count, and on a
# busy 2-core machine two threads waiting on each other made a step 20 times slower).
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
PINS: dict[str, dict[str, str]] = {
    "x86_64": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT", **THREADS},
    "aarch64": {"ATEN_CPU_CAPABILITY": "default", **THREADS},
}
# Set inside the making's process (no environment variable reaches it): torch.backends.mkldnn.enabled.
MKLDNN = False
# What torch must report once the pin took (torch.backends.cpu.get_cpu_capability()).
CAPABILITY = {"x86_64": "AVX2", "aarch64": "DEFAULT"}
# The x86_64 pin runs ATen's AVX2 kernels: a CPU without these cannot run them.
X86_FLAGS = ("avx2", "fma")


@dataclass(frozen=True)
class Arithmetic:
    """Where a model is made, as far as its bytes can tell: the machine, the pinned environment, the CPU
    (aarch64 only: its BLAS cannot be pinned) and the tools' versions."""

    machine: str
    pins: Mapping[str, str]
    cpu: str
    tools: Mapping[str, str | None] = field(default_factory=dict)

    def key(self) -> str:
        payload = json.dumps(self.record(with_key=False), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:8]

    def describe(self) -> str:
        tools = ", ".join(f"{k} {v}" for k, v in self.tools.items() if v)
        pins = " ".join(f"{k}={v}" for k, v in self.pins.items() if k not in THREADS)
        return f"{self.machine} ({self.cpu}), {pins}, oneDNN off, one thread; {tools}"

    def can_make(self) -> bool:
        """Whether this host has the tools a making needs (torch first of all)."""
        return self.tools.get("torch") is not None

    def same_machine(self, recorded: Mapping[str, object]) -> bool:
        """Whether a model's recorded arithmetic (sparkbuild-model.json) is this one's but for the tools."""
        mine = self.record(with_key=False)
        return all(recorded.get(k) == mine[k] for k in ("machine", "cpu", "pins", "mkldnn"))

    def record(self, *, with_key: bool = True) -> dict[str, object]:
        """What sparkbuild-model.json says of it; without the key, what the key hashes."""
        fields: dict[str, object] = {"machine": self.machine, "cpu": self.cpu, "pins": dict(self.pins), "mkldnn": MKLDNN}
        fields["tools"] = dict(self.tools)
        return {"key": self.key(), **fields} if with_key else fields


def current(cpuinfo: Path = CPUINFO, machine: str | None = None) -> Arithmetic:
    """This machine's arithmetic for making a model; raises where it cannot be pinned."""
    machine = machine or platform.machine()
    if machine not in PINS:
        raise ToolMissingError(
            f"check models are made on x86_64 or aarch64, not {machine}: make them on one of those and give the "
            "folder to the check (model: {path: DIR})"
        )
    text = cpuinfo.read_text(encoding="utf-8", errors="replace") if cpuinfo.is_file() else ""
    if machine == "x86_64":
        _require_x86_flags(text)
        cpu = "any x86_64 with AVX2"  # the pins give every such CPU the same bytes
    else:
        cpu = "cores " + (",".join(host.arm_cores(text)) or "unknown")
    return Arithmetic(machine=machine, pins=PINS[machine], cpu=cpu, tools={t: _version(t) for t in TOOLS})


def _require_x86_flags(cpuinfo: str) -> None:
    flags = host.cpu_flags(cpuinfo)
    if not flags:
        return  # no /proc/cpuinfo to read: the making's own check (CAPABILITY) stops it if AVX2 is missing
    if missing := [f for f in X86_FLAGS if f not in flags]:
        raise ToolMissingError(
            f"this CPU lacks {', '.join(missing)}, which the check models' pinned arithmetic (ATen's AVX2 kernels) "
            "needs: make them on another x86_64 or aarch64 machine and copy the cache folder's models/ here"
        )


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
