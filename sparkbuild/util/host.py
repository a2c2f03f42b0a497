"""What this host is, read from the operating system: its platform, its CPU's features, its memory,
its binfmt_misc handlers and its NVIDIA GPUs (nvidia-smi).

The local profile builds its image for the host's own platform and serves it on the host's CPU, so
which checks can run depends on the host: vLLM's CPU image takes an AMX path for bfloat16 and
quantized MoE on CPUs that have AMX and another path on CPUs without. ``doctor`` reports these
facts; verify reads them to skip, before any server starts, a check the host cannot run.
"""

from __future__ import annotations

import os
import platform as _platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# What `uname -m` prints, by the OCI platform it runs natively.
MACHINES = {"x86_64": "linux/amd64", "amd64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}
# The other way: the machine name binfmt_misc and /proc/cpuinfo use for each OCI platform.
PLATFORM_MACHINES = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
CPUINFO = Path("/proc/cpuinfo")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
# x86 feature flags that decide which CPU kernels vLLM takes (its CPU build dispatches on them).
X86_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
ARM_FEATURES = ("asimd", "sve", "sve2", "bf16", "i8mm")


class UnknownMachineError(ValueError):
    """``uname -m`` printed a machine sparkbuild builds no image for."""


def platform_of(machine: str) -> str:
    """The OCI platform a machine name (``uname -m``) runs natively: ``linux/amd64`` or ``linux/arm64``."""
    try:
        return MACHINES[machine.lower()]
    except KeyError:
        known = ", ".join(sorted(MACHINES))
        raise UnknownMachineError(f"machine '{machine}' is none sparkbuild builds for (known: {known})") from None


def machine() -> str:
    return _platform.machine()


def host_platform() -> str:
    """This host's own OCI platform."""
    return platform_of(machine())


def build_platform(target: str) -> str:
    """The platform BuildKit's ``$BUILDPLATFORM`` names here: this host's own, or ``target`` on a
    host of a machine sparkbuild builds for none (everything then runs emulated)."""
    try:
        return host_platform()
    except UnknownMachineError:
        return target


def emulated(platform: str) -> bool:
    """Whether images of ``platform`` run emulated here: not this host's own platform (a host of a
    machine sparkbuild builds for none natively runs every image emulated)."""
    try:
        return platform != host_platform()
    except UnknownMachineError:
        return True


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU's feature flags from the text of /proc/cpuinfo: ``flags`` on x86, ``Features`` on Arm."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model", "Hardware"):
            return value.strip()
    return ""


def arm_cores(cpuinfo: str) -> tuple[str, ...]:
    """An Arm CPU's core types as ``implementer:part`` from /proc/cpuinfo (a Spark's GB10 has two: Cortex-X925
    and Cortex-A725); empty on x86."""
    fields = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in cpuinfo.splitlines())]
    implementers = [v for k, v in fields if k == "CPU implementer"]
    parts = [v for k, v in fields if k == "CPU part"]
    return tuple(sorted({f"{i}:{p}" for i, p in zip(implementers, parts, strict=False)}))


@dataclass(frozen=True, kw_only=True)
class Cpu:
    model: str
    cores: int
    flags: frozenset[str]

    @property
    def amx(self) -> bool:
        """Intel AMX with bfloat16 (vLLM's CPU build then takes its AMX grouped GEMM for MoE)."""
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    def features(self) -> tuple[str, ...]:
        """The features that matter to vLLM's CPU kernels, in a fixed order."""
        return tuple(f for f in (*X86_FEATURES, *ARM_FEATURES) if f in self.flags)


def read_cpu(path: Path = CPUINFO) -> Cpu:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return Cpu(model=cpu_model(text), cores=os.cpu_count() or 1, flags=cpu_flags(text))


def memory_gb(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Total memory, or None where /proc/meminfo is not there."""
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return None


def can_run(platform: str, binfmt: Path = BINFMT, native: str | None = None) -> tuple[bool, str]:
    """Whether an image of ``platform`` runs on this host: natively, or through a binfmt_misc
    handler (qemu-user) for its machine; with the reason in words. ``native``: the platform the
    engine runs natively (default: this host's)."""
    own = native or host_platform()
    if platform == own:
        return True, f"{platform} is this host's own platform"
    wanted = PLATFORM_MACHINES.get(platform, platform)
    handlers = binfmt_handlers(binfmt)
    if wanted in handlers:
        flags = binfmt_flags(binfmt / handlers[wanted]) or "none"
        if "F" not in flags:
            return False, (
                f"{platform} images cannot run on this {own} host: binfmt_misc handler {handlers[wanted]} has no F flag "
                f"(flags: {flags}), so containers cannot reach its interpreter; install qemu-user-static, which "
                "registers it with F (as root: scripts/emulation in sparkbuild's checkout)"
            )
        return True, f"{platform} runs under emulation (binfmt_misc handler {handlers[wanted]}; slow)"
    return False, (
        f"{platform} images cannot run on this {own} host: no binfmt_misc handler for {wanted} "
        "(install qemu-user-static (QEMU >= 8; Debian bookworm: from bookworm-backports) and binfmt-support, "
        "or run scripts/emulation from sparkbuild's checkout as root, which does both; or build for the host's own platform)"
    )


def binfmt_flags(entry: Path) -> str:
    """The ``flags:`` of a binfmt_misc entry (``F``: the interpreter is opened when registered, so it
    works inside containers, which do not have it in their own file system)."""
    try:
        text = entry.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("flags:"):
            return line.partition(":")[2].strip()
    return ""


def binfmt_handlers(binfmt: Path = BINFMT) -> dict[str, str]:
    """The enabled binfmt_misc handlers by the machine they run (``aarch64`` -> ``qemu-aarch64``)."""
    found: dict[str, str] = {}
    if not binfmt.is_dir():
        return found
    for entry in sorted(binfmt.iterdir()):
        if entry.name in ("register", "status") or not entry.is_file():
            continue
        try:
            text = entry.read_text(errors="replace")
        except OSError:
            continue  # an entry the kernel does not let this user read is none we can use
        if not text.startswith("enabled"):
            continue
        for name in PLATFORM_MACHINES.values():
            if name in entry.name:
                found[name] = entry.name
    return found


# --- NVIDIA GPUs ------------------------------------------------------------------------------

SMI_FIELDS = "index,name,driver_version,compute_cap,memory.total"


@dataclass(frozen=True, kw_only=True)
class Gpu:
    index: int
    name: str
    driver: str
    # "12.1" for a GB10, "9.0" for an H100.
    compute_cap: str
    # None where the GPU has no memory of its own to report (the GB10's is unified with the CPU's).
    memory_mib: int | None


@dataclass(frozen=True, kw_only=True)
class Gpus:
    """What nvidia-smi says: the GPUs, the driver, and the newest CUDA version the driver supports;
    ``error`` says why none were read (no nvidia-smi, no driver loaded)."""

    found: tuple[Gpu, ...] = ()
    cuda: str | None = None
    error: str | None = None

    @property
    def driver(self) -> str | None:
        return self.found[0].driver if self.found else None


def parse_gpus(csv_text: str) -> tuple[Gpu, ...]:
    """Rows of ``nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total
    --format=csv,noheader,nounits``."""
    found = []
    for line in csv_text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        index, name, driver, cap, memory = cells
        found.append(
            Gpu(index=int(index), name=name, driver=driver, compute_cap=cap, memory_mib=int(memory) if memory.isdigit() else None)
        )
    return tuple(found)


def parse_cuda_version(smi_text: str) -> str | None:
    """The CUDA version the driver supports, from nvidia-smi's banner (``CUDA Version: 13.0``)."""
    match = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", smi_text)
    return match.group(1) if match else None


def read_gpus(smi: str | None = None, timeout_s: float = 30) -> Gpus:
    """The NVIDIA GPUs nvidia-smi reports; none (with why) where it is not installed or fails."""
    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        return Gpus(error="nvidia-smi is not installed (no NVIDIA driver on this host)")
    try:
        banner = subprocess.run([smi], capture_output=True, text=True, timeout=timeout_s, check=False)
        query = subprocess.run(
            [smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Gpus(error=f"{smi} did not answer: {exc}")
    if query.returncode != 0:
        said = (query.stdout + query.stderr).strip().splitlines()
        return Gpus(error=f"{smi} failed (exit {query.returncode}): {said[0] if said else 'no output'}")
    found = parse_gpus(query.stdout)
    return Gpus(found=found, cuda=parse_cuda_version(banner.stdout), error=None if found else f"{smi} lists no GPU")
