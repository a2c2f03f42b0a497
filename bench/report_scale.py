"""Time ``sparkbuild report`` on a registry holding a year of nights for ten targets, made here cheaply.

Reproduce with:  .venv/bin/python bench/report_scale.py [--nights 365] [--targets 10] [--out FILE]

Made in an embedded registry (Debian's docker-registry, as the suite uses): per target and night one
run, pushed as each target job of the fanned-out nightly pushes its own (``sparkbuild.publish.runrecord``)
from the lane's own rows (``TargetRun.row()``: real benchmark figures of tests/data/bench judged by
the real speed gate, the kernel path, a patch's status); every 17th night a target fails with its
error.log kept, every 23rd its image is held back by the speed gate. The images of the newest
``report.NIGHTS`` nights (those the report gives a page) are tiny real images with a verify result
and an SBOM attached; older ones are gone, as retention (``sparkbuild gc``) leaves them.

Timed, each ``sparkbuild report`` a new process as a user or CI runs it: cold (an empty cache, every
document read once), warm (nothing new: the tag list and the pointers), and after one more night of
every target (what a nightly adds). Wall-clock numbers: compare only runs on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.config.options import Options  # noqa: E402
from sparkbuild.lanes import pipeline  # noqa: E402
from sparkbuild.oci.registry import Registry, embedded  # noqa: E402
from sparkbuild.plan import plan  # noqa: E402
from sparkbuild.publish import runrecord  # noqa: E402
from sparkbuild.report import history  # noqa: E402
from sparkbuild.verify import benchreport, regression, verify  # noqa: E402
from sparkbuild.verify.verify import VerifyResult  # noqa: E402
from tests.support import nights as made  # noqa: E402

FIRST = datetime(2025, 12, 1, 3, tzinfo=UTC)


class Maker:
    """Rows and documents for one made-up target, from a real plan."""

    def __init__(self, p: plan.TargetPlan, index: int, out: Path) -> None:
        self.plan = dataclasses.replace(p, target=dataclasses.replace(p.target, id=f"{p.id}-{index:02d}"))
        self.out = out
        self.base, self.slower = made.figures("baseline.json"), made.figures("slower.json")
        self.sbom = self._sbom()

    def _sbom(self) -> bytes:
        packages = [{"type": "library", "name": f"package-{i}", "version": f"1.{i}.0"} for i in range(300)]
        return json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.6", "components": packages}).encode()

    def row(self, night: int, digest: str | None) -> tuple[dict[str, Any], VerifyResult]:
        failed, held = night % 17 == 16, night % 23 == 22
        measured = self.slower if held else self.base
        result = made.alphabet_result(measured)
        status = pipeline.Status.FAILED if failed else (pipeline.Status.REGRESSED if held else pipeline.Status.PUBLISHED)
        run = pipeline.TargetRun(self.plan, status=status, digest=None if failed else digest, result=result)
        if failed:
            run.failed_at, run.error = pipeline.Status.BUILDING, "the vLLM stage failed"
            (self.out / self.plan.id).mkdir(parents=True, exist_ok=True)
            (self.out / self.plan.id / "error.log").write_text(f"night {night}: ninja: build stopped\n" * 50)
        else:
            run.verified = verify.Verified(checks=("alphabet",), results={"alphabet": result}, failures={})
            gate = regression.compare(measured, self.base, threshold_pct=10, baseline_of="sha256:before")
            table = benchreport.table(measured, self.base, gate)
            check = self.plan.target.checks[0]
            speed = pipeline.Speed(check=check, measured=measured, baseline=self.base, gate=gate, table=table, plot=Path("p.png"))
            run.speeds["alphabet"] = speed
            if held:
                run.held = ("alphabet",)
        row = run.row()
        row["patches"] = {"cpu-moe-fix": "applies" if night < 200 else "upstream"}
        return row, result


def make_nights(registry: Registry, makers: list[Maker], nights: range, keep_from: int) -> None:
    for night in nights:
        started = FIRST + timedelta(days=night)
        for maker in makers:
            repository = maker.plan.repository
            digest = None
            row, result = maker.row(night, None)
            if night >= keep_from and row["status"] != "failed":
                digest = made.tiny_image(registry, repository, f"{maker.plan.id} {night}", "arm64")
                row, result = maker.row(night, digest)
                made.attach(registry, repository, digest, json.dumps(result.to_json()).encode(), maker.sbom)
            elif row["status"] != "failed":
                row["digest"] = "sha256:" + hashlib.sha256(f"{maker.plan.id} {night}".encode()).hexdigest()
            runrecord.push(
                registry,
                repository,
                lane="nightly",
                night=started.strftime("%Y%m%d"),
                started=started + timedelta(seconds=makers.index(maker)),
                rows=[row],
                out=maker.out,
            )


def report(registry: Registry, repository: str, cache: Path, site: Path) -> dict[str, Any]:
    env = {**os.environ, "SPARKBUILD_REGISTRY": registry.host, "SPARKBUILD_CACHE": str(cache)}
    args = [sys.executable, "-m", "sparkbuild", "report", "--repository", repository, "--site", str(site), "--json"]
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 2)
    return {"seconds": seconds, **json.loads(done.stdout)["repositories"][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nights", type=int, default=365)
    parser.add_argument("--targets", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "report-scale.json")
    args = parser.parse_args()
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", profile="local"))
    with tempfile.TemporaryDirectory(prefix="report-bench-") as tmp, embedded(Path(tmp) / "registry") as registry:
        folder = Path(tmp)
        makers = [Maker(p, i, folder / "out") for i in range(args.targets)]
        start = time.perf_counter()
        make_nights(registry, makers, range(args.nights), keep_from=args.nights - history.NIGHTS)
        made_s = round(time.perf_counter() - start, 1)
        repository = p.repository
        cold = report(registry, repository, folder / "cache", folder / "site")
        warm = report(registry, repository, folder / "cache", folder / "site")
        make_nights(registry, makers, range(args.nights, args.nights + 1), keep_from=args.nights)
        next_night = report(registry, repository, folder / "cache", folder / "site")
        files = list((folder / "site").rglob("*"))
        size = sum(f.stat().st_size for f in files if f.is_file())
    result = {
        "nights": args.nights,
        "targets": args.targets,
        "runs": args.nights * args.targets,
        "made_in_s": made_s,
        "cold": cold,
        "warm": warm,
        "after_one_more_night": next_night,
        "site_files": len(files),
        "site_mb": round(size / 1e6, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
