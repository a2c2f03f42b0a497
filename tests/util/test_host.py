"""What sparkbuild reads of the host: platform, CPU features, binfmt handlers (from recorded texts,
so the same on every machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkbuild.util import host

XEON_AMX = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
"""
EPYC = """processor	: 0
model name	: AMD EPYC
flags		: fpu sse sse2 avx avx2 fma
"""
GRACE = """processor	: 0
BogoMIPS	: 2000.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve sve2 bf16 i8mm
CPU implementer	: 0x41
"""


@pytest.mark.parametrize(
    ("text", "amx", "avx512", "features"),
    [
        (XEON_AMX, True, True, ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")),
        (EPYC, False, False, ("avx2",)),
        (GRACE, False, False, ("asimd", "sve", "sve2", "bf16", "i8mm")),
    ],
)
def test_cpu_features_from_cpuinfo(tmp_path: Path, text: str, amx: bool, avx512: bool, features: tuple[str, ...]) -> None:
    (tmp_path / "cpuinfo").write_text(text)
    cpu = host.read_cpu(tmp_path / "cpuinfo")
    assert (cpu.amx, cpu.avx512, cpu.features()) == (amx, avx512, features)


def test_platform_of_each_machine_name() -> None:
    assert host.platform_of("x86_64") == host.platform_of("amd64") == "linux/amd64"
    assert host.platform_of("aarch64") == host.platform_of("arm64") == "linux/arm64"
    with pytest.raises(host.UnknownMachineError, match="known: "):
        host.platform_of("riscv64")


def test_a_foreign_platform_runs_only_with_a_binfmt_handler(tmp_path: Path) -> None:
    own = host.host_platform()
    other = next(p for p in host.PLATFORM_MACHINES if p != own)
    assert host.can_run(own, tmp_path)[0]
    ok, reason = host.can_run(other, tmp_path)
    assert not ok and "binfmt_misc" in reason and "qemu-user-static" in reason
    name = host.PLATFORM_MACHINES[other]
    (tmp_path / f"qemu-{name}").write_text("enabled\ninterpreter /usr/bin/qemu-" + name + "\nflags: POCF\n")
    (tmp_path / "status").write_text("enabled\n")
    ok, reason = host.can_run(other, tmp_path)
    assert ok and f"qemu-{name}" in reason
