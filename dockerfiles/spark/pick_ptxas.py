"""Pick the ptxas Triton uses for the image's GPU (stdlib only; runs in the runtime stage).

Triton compiles for Blackwell (sm_100 and up, so sm_121) with its bundled ``ptxas-blackwell`` and
for older GPUs with its ``ptxas``. Triton 3.5's could not assemble sm_121a, so the image pointed
Triton at CUDA 13.0's ptxas; Triton 3.8 (torch 2.14's) bundles ptxas-blackwell from CUDA 13.3, and
pointing it at 13.0's is a downgrade. Here every candidate assembles a kernel for the GPU; the
newest that does is linked at LINK (TRITON_PTXAS_PATH and TRITON_PTXAS_BLACKWELL_PATH name it), and
the choice is written to ptxas.json beside it.

    python3 pick_ptxas.py --arch sm_121a --cuda-ptxas PATH --link PATH
"""

import argparse
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

PTX = """.version {version}
.target {arch}
.address_size 64
.visible .entry sparkbuild_probe(.param .u64 p) {{ .reg .b64 %rd<2>; ld.param.u64 %rd1, [p]; ret; }}
"""
# The PTX ISA each CUDA release's ptxas reads (major.minor of the release -> ISA).
ISA = {(12, 8): "8.7", (12, 9): "8.8", (13, 0): "9.0", (13, 1): "9.1", (13, 2): "9.2", (13, 3): "9.3"}


def version(ptxas):
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"{ptxas} --version names no release: {out.strip()}")
    return int(match[1]), int(match[2])


def assembles(ptxas, release, arch):
    """Whether ``ptxas`` assembles a kernel for ``arch``; the reason when it does not."""
    isa = ISA.get(release, "8.8")
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp) / "probe.ptx"
        source.write_text(PTX.format(version=isa, arch=arch))
        done = subprocess.run([ptxas, f"-arch={arch}", str(source), "-o", os.devnull], capture_output=True, text=True)
    return done.returncode == 0, (done.stderr or done.stdout).strip()[-300:]


def candidates(cuda_ptxas):
    spec = importlib.util.find_spec("triton")
    found = []
    if spec is not None and spec.origin:
        folder = pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin"
        found += [("triton " + name, folder / name) for name in ("ptxas-blackwell", "ptxas") if (folder / name).is_file()]
    return [*found, ("cuda", pathlib.Path(cuda_ptxas))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", required=True, help="what the GPU runs, e.g. sm_121a")
    parser.add_argument("--cuda-ptxas", required=True)
    parser.add_argument("--link", required=True, type=pathlib.Path)
    args = parser.parse_args()
    tried = []
    for name, path in candidates(args.cuda_ptxas):
        release = version(path)
        ok, why = assembles(path, release, args.arch)
        shown = f"{release[0]}.{release[1]}"
        tried.append({"name": name, "path": str(path), "release": shown, "assembles": ok, "error": "" if ok else why})
    usable = [t for t in tried if t["assembles"]]
    if not usable:
        sys.exit(f"pick_ptxas: no ptxas assembles {args.arch}: " + json.dumps(tried))
    best = max(usable, key=lambda t: tuple(int(x) for x in t["release"].split(".")))
    args.link.parent.mkdir(parents=True, exist_ok=True)
    if args.link.is_symlink() or args.link.exists():
        args.link.unlink()
    args.link.symlink_to(best["path"])
    report = {"arch": args.arch, "chosen": best, "tried": tried}
    (args.link.parent / "ptxas.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"pick_ptxas: {best['name']} (CUDA {best['release']}) for {args.arch}: {best['path']}")


if __name__ == "__main__":
    main()
