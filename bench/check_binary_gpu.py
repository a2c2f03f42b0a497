"""check-binary's rule against a real GPU: one program whose kernels are each built for other code
(one unit per arch, linked into one binary, as vLLM links its units into _C), each kernel launched
on the GPU, and what check-binary predicted for that GPU beside what happened.

Reproduce (nvcc 13 here and on the GPU machine):
  .venv/bin/python bench/check_binary_gpu.py build DIR --arch 9.0   # sources, build.sh, DIR/prog, predicted.json
  (cd COPY-OF-DIR && sh build.sh && ./prog > observed.json)         # on the GPU machine: the same sources and flags
  .venv/bin/python bench/check_binary_gpu.py compare DIR observed.json [--out RESULT.json]

The prediction is check-binary on the program built here; the GPU runs the program built there from
the same sources with the same nvcc flags (CUDA 13.0 on both when this was written).

``--arch`` is the compute capability of the GPU the program will run on (an H100: 9.0, a GB10: 12.1).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.build import binaries  # noqa: E402

# One kernel per unit: its name, and the -gencode of its unit.
UNITS = {
    "k_sm90a": "arch=compute_90a,code=sm_90a",
    "k_sm90": "arch=compute_90,code=sm_90",
    "k_sm89": "arch=compute_89,code=sm_89",
    "k_compute80": "arch=compute_80,code=compute_80",
    "k_compute90a": "arch=compute_90a,code=compute_90a",
    "k_sm100f": "arch=compute_100f,code=sm_100f",
    "k_compute100": "arch=compute_100,code=compute_100",
    "k_sm120a": "arch=compute_120a,code=sm_120a",
    "k_sm120f": "arch=compute_120f,code=sm_120f",
    "k_sm121a": "arch=compute_121a,code=sm_121a",
    "k_compute120f": "arch=compute_120f,code=compute_120f",
}
UNIT = """#include <cstdio>
__global__ void {name}(int* out) {{ *out = {value}; }}
extern "C" int launch_{name}(int* out) {{ {name}<<<1, 1>>>(out); return (int)cudaGetLastError(); }}
"""
MAIN = """#include <cstdio>
#include <cuda_runtime.h>
{declarations}
int main() {{
  int* out; int dev; cudaDeviceProp p;
  cudaGetDevice(&dev); cudaGetDeviceProperties(&p, dev);
  printf("{{\\"gpu\\": \\"%s\\", \\"cc\\": \\"%d.%d\\", \\"kernels\\": [\\n", p.name, p.major, p.minor);
  cudaMalloc(&out, sizeof(int));
{calls}
  printf("]}}\\n");
  return 0;
}}
"""
CALL = """  {{ cudaMemset(out, 0, sizeof(int)); int e = launch_{name}(out); int got = 0;
    if (e == 0) e = (int)cudaDeviceSynchronize();
    cudaMemcpy(&got, out, sizeof(int), cudaMemcpyDeviceToHost);
    printf("%s{{\\"name\\": \\"{name}\\", \\"error\\": \\"%s\\", \\"ran\\": %s}}\\n", {first} ? "" : ",",
           cudaGetErrorString((cudaError_t)e), e == 0 && got == {value} ? "true" : "false"); }}
"""


def build(folder: Path, device: binaries.Arch) -> None:
    """The sources and build.sh in ``folder`` (to copy to a GPU machine that has nvcc), built here
    too, and check-binary's prediction for ``device``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = ["set -e"]
    for i, (name, gencode) in enumerate(UNITS.items(), start=1):
        (folder / f"{name}.cu").write_text(UNIT.format(name=name, value=i))
        script.append(shlex.join(["nvcc", "-c", "-gencode", gencode, f"{name}.cu", "-o", f"{name}.o"]))
    declarations = "\n".join(f'extern "C" int launch_{n}(int* out);' for n in UNITS)
    calls = "".join(CALL.format(name=n, value=i, first="1" if i == 1 else "0") for i, n in enumerate(UNITS, start=1))
    (folder / "main.cu").write_text(MAIN.format(declarations=declarations, calls=calls))
    script.append(shlex.join(["nvcc", "main.cu", *(f"{n}.o" for n in UNITS), "-o", "prog"]))
    (folder / "build.sh").write_text("\n".join(script) + "\n")
    subprocess.run(["sh", "build.sh"], cwd=folder, check=True)
    report = binaries.check_file(folder / "prog", device)
    predicted = {k.name.removeprefix("_Z").lstrip("0123456789").removesuffix("Pi"): k.verdict for k in report.kernels}
    (folder / "predicted.json").write_text(json.dumps({"device": str(device), "verdicts": predicted}, indent=1) + "\n")


def compare(folder: Path, observed_file: Path) -> dict[str, Any]:
    predicted = json.loads((folder / "predicted.json").read_text())
    observed = json.loads(observed_file.read_text())
    rows = []
    for kernel in observed["kernels"]:
        verdict = predicted["verdicts"][kernel["name"]]
        expected = verdict in ("sass", "ptx")
        rows.append({**kernel, "gencode": UNITS[kernel["name"]], "predicted": verdict, "agrees": expected == kernel["ran"]})
    return {"gpu": observed["gpu"], "cc": observed["cc"], "device": predicted["device"], "kernels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("build", "compare"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("observed", type=Path, nargs="?")
    parser.add_argument("--arch", default="9.0", help="compute capability of the GPU to predict for")
    parser.add_argument("--out", type=Path, help="compare: also write the result here")
    args = parser.parse_args()
    if args.step == "build":
        build(args.folder, binaries.Arch.parse(args.arch))
        return
    if args.observed is None:
        parser.error("compare needs the program's output (OBSERVED)")
    result = compare(args.folder, args.observed)
    print(f"{result['gpu']} (compute capability {result['cc']}), predicted for {result['device']}:")
    for row in result["kernels"]:
        ran = "ran" if row["ran"] else f"did not run ({row['error']})"
        agrees = "agrees" if row["agrees"] else "DISAGREES"
        print(f"  {agrees:<9} {row['name']:<14} {row['gencode']:<35} {row['predicted']:<6} {ran}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not all(row["agrees"] for row in result["kernels"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
