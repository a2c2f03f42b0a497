"""Measure the memory of vLLM's heaviest CUDA units, compiled as the Spark build compiles them.

Reproduce with:  .venv/bin/python bench/compile_memory.py [--only vllm-0.33.0-cu130-sm121] [--units REGEX] [--out FILE]

The target is rehearsed as a source build (``vllm_from: source``, offline sources: see
`sparkbuild rehearse --offline`) and its preflight is asked to compile, besides the patched units,
every configured unit ``--units`` finds (``SPARKBUILD_PREFLIGHT_MEASURE``): vLLM's real configure for
the target's arch list, each unit with exactly the flags CMake gave it, on the rehearsal's build base
(GCC 14, CUDA 13.0's nvcc), without ccache. Each unit's peak is the largest resident set of its
compile's processes (nvcc, cicc, ptxas, the host compiler), read with wait4() per compile, so units
compiled side by side are measured apart. That is what one of vLLM's parallel compiles needs: the
plan sizes its compiles so that the heaviest units fit at once (``HEAVY_UNITS_GIB`` in
sparkbuild/plan/toolchain.py, held to this file's figures by tests/plan/test_spark_plan.py).

Memory does not depend on the cores or the CPU's speed: cicc and ptxas generate the same GPU code
on any host, and only the host compiler's part (GCC for x86_64 here, for aarch64 on a Spark) differs.
What is swapped: CUTLASS's headers are FlashInfer's bundled copy (the rehearsal's), and
flash-attention's units are stand-ins (not measured here).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from preflight import emit, new_commit  # noqa: E402  (bench/preflight.py: this folder is sys.path[0])

from sparkbuild.build import build  # noqa: E402
from sparkbuild.config.options import Options  # noqa: E402
from sparkbuild.lanes import offline, rehearse  # noqa: E402
from sparkbuild.oci.engine import Engine  # noqa: E402
from sparkbuild.plan import plan  # noqa: E402
from sparkbuild.upstream import gitrepo  # noqa: E402

# The heaviest families of a 12.1a build, one or more units each: CUTLASS 3.x GEMMs for SM120 (FP8,
# blockwise FP8, NVFP4, the NVFP4 grouped MoE GEMM), CUTLASS 2.x GEMMs, Marlin (dense and MoE: the
# most units), GPTQ/AWQ, Mamba's selective scan.
UNITS = "|".join(
    [
        r"cutlass/scaled_mm_c3x_sm120\.cu$",
        r"c3x/scaled_mm_sm120_fp8\.cu$",
        r"c3x/scaled_mm_blockwise_sm120_fp8\.cu$",
        r"cutlass/scaled_mm_c2x\.cu$",
        r"fp4/nvfp4_scaled_mm_sm120_kernels\.cu$",
        r"fp4/nvfp4_blockwise_moe_kernel\.cu$",
        r"quantization/marlin/sm80_kernel_bfloat16_fe2m1f_bfloat16\.cu$",
        r"marlin_moe_wna16/sm80_kernel_bfloat16_u4b8_bfloat16\.cu$",
        r"gptq/q_gemm\.cu$",
        r"mamba/selective_scan_fwd\.cu$",
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="vllm-0.33.0-cu130-sm121")
    parser.add_argument("--units", default=UNITS, help="a regular expression over the configured units' paths")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    opts = Options.from_env(only=(args.only,))
    m = plan.load_matrix(opts)
    (target,) = [t for t in m.targets if t.id == args.only]
    rehearsed = rehearse.rehearsal_target(dataclasses.replace(target, vllm_from="source"), m)
    with gitrepo.daemon(opts.cache / "offline") as url:
        # A commit no earlier run built, so BuildKit runs the preflight (ccache is off for measured units).
        found = new_commit(offline.prepare(rehearsed, opts.cache), target.vllm.version, opts)
        p = plan.plan_target(found.apply(rehearsed), m.patch_folders, opts)
        p = dataclasses.replace(p, git_insteadof=f"{url}/={offline.URL}/")
        report = build.run_preflight(Engine(), p, opts, measure=args.units)
    units = sorted((c for c in report.compiled if c.measured), key=lambda c: -c.peak_rss_mb)
    result = {
        "target": args.only,
        "arch_list": target.arch_list,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "compiles_at_once": p.jobs.compiles if p.jobs else None,
        "units": [{"file": c.file, "peak_mb": c.peak_rss_mb, "seconds": c.seconds, "ok": c.ok} for c in units],
        "largest_mb": units[0].peak_rss_mb if units else 0,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
