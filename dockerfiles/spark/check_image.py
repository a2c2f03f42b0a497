"""Run inside the Spark image at build time: fail the build unless it holds what the plan asked for
and what serving needs. Every check runs the real thing (no GPU needed):

- torch is the CUDA build asked for (a CPU wheel swapped in by pip is the classic failure), and vLLM
  the version asked for, built from the pinned commit or installed from the pinned upstream wheel
  (its sha256 in the record of sources; the commit the wheel names in vllm/_version.py is recorded);
- vLLM's compiled extensions (``--kernels real``): every extension module under the vllm package
  imports, after torch, as vLLM imports it; a module that links the CUDA driver (libcuda.so.1) finds
  the CUDA toolkit's stub (``--driver-stub``, mounted for this check only: no driver at build time);
  the torch vLLM's own metadata requires is the torch installed;
- Triton can build its CUDA driver stub (it does so on the first kernel launch): its own build
  function compiles its own driver.c, with a C compiler and Python's headers;
- CUDA's compiler and headers for run-time JIT (FlashInfer, DeepGEMM): nvcc of the image's CUDA
  version compiles a unit that includes the runtime, NVRTC, cuBLAS, cuRAND and CUB headers, and
  FlashInfer finds that toolkit;
- torchvision, torchaudio and torchcodec import, matching torch;
- ray imports and the RDMA user-space libraries NCCL opens for two Sparks load; the NCCL torch loads is
  not one that deadlocks CUDA graphs across nodes (2.28.9 to before 2.30.4, vLLM #52504);
- Triton is pointed at the ptxas pick_ptxas.py chose for the GPU (it assembled a kernel for it);
- fastsafetensors (vLLM's --load-format fastsafetensors) imports and the libnuma it opens loads;
- every plugin vLLM loads at start-up (``vllm.general_plugins``) loads: vLLM logs a failing one and
  serves without it (b12x's, with FlashInfer's b12x shim installed over b12x);
- a file two distributions install holds its owner's bytes (``shared_files.py``).
"""

import argparse
import ctypes
import importlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import subprocess
import sys
import tempfile

parser = argparse.ArgumentParser()
parser.add_argument("--vllm-version", required=True)
source = parser.add_mutually_exclusive_group(required=True)
source.add_argument("--vllm-commit", help="vLLM was compiled from this commit")
source.add_argument("--vllm-wheel-sha256", help="vLLM is upstream's wheel of this sha256 (patched or not)")
parser.add_argument("--torch", required=True)
parser.add_argument("--cuda", required=True)
parser.add_argument(
    "--kernels", choices=("real", "none"), required=True, help="none: a rehearsal's Python-only wheel, no extension"
)
parser.add_argument("--driver-stub", help="a stub libcuda.so the extension imports may load (no driver at build time)")
parser.add_argument(
    "--only", action="append", metavar="CHECK", help="run this check alone (repeatable), to look at one again; writes no record"
)
args = parser.parse_args()

import torch  # noqa: E402

problems = []
found = {}


def check(name, func):
    try:
        found[name] = func()
    except Exception as exc:  # every failure is reported with the others, then the build stops
        problems.append(f"{name}: {type(exc).__name__}: {exc}".strip())


def torch_build():
    # A plan that names no local version ("2.14.0", PyPI's build) accepts its +cuXYZ tag.
    installed = torch.__version__ if "+" in args.torch else torch.__version__.split("+")[0]
    if installed != args.torch:
        raise RuntimeError(f"torch {torch.__version__} is installed, the plan asked for {args.torch}")
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)")
    if not torch.version.cuda.startswith(args.cuda):
        raise RuntimeError(f"torch is built for CUDA {torch.version.cuda}, the plan asked for {args.cuda}")
    return {"version": torch.__version__, "cuda": torch.version.cuda}


def vllm_source():
    # Every problem is named at once: a wrong version and a missing record are two fixes.
    problems = []
    installed = importlib.metadata.version("vllm")
    if installed.split("+")[0] != args.vllm_version:
        problems.append(f"vLLM {installed} is installed, the plan asked for {args.vllm_version}")
    record = pathlib.Path("/opt/sparkbuild/sources.txt")
    sources = record.read_text().split() if record.is_file() else []
    wanted = args.vllm_commit or f"sha256:{args.vllm_wheel_sha256}"
    if not sources:
        problems.append(f"{record} is missing: the source stage did not record the commits it fetched")
    elif wanted not in sources:
        problems.append(
            f"vLLM is not from {'commit ' if args.vllm_commit else 'the wheel of '}{wanted}; sources: {' '.join(sources)}"
        )
    if problems:
        raise RuntimeError("; ".join(problems))
    import vllm

    found = {"version": installed, "path": str(pathlib.Path(vllm.__file__).parent)}
    if args.vllm_commit:
        return {**found, "commit": args.vllm_commit}
    # Upstream's wheel names its own commit (vcs-versioning's short form, e.g. g4ba787ec9).
    from vllm import _version

    return {**found, "wheel_sha256": args.vllm_wheel_sha256, "commit": getattr(_version, "__commit_id__", None)}


# Imports each extension module in a process of its own, as vLLM does (torch first); prints one JSON line.
IMPORT_ALL = """
import importlib, json, sys, torch
done, failed = [], {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        done.append(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"imported": done, "failed": failed}))
"""


def vllm_extensions():
    """Every compiled module of the installed vLLM, imported; with --kernels none (a rehearsal's
    Python-only wheel) there must be none."""
    import importlib.util

    package = pathlib.Path(importlib.util.find_spec("vllm").origin).parent
    names = sorted(".".join(("vllm", *p.relative_to(package).parent.parts, p.name.split(".")[0])) for p in package.rglob("*.so"))
    if args.kernels == "none":
        if names:
            raise RuntimeError(f"a Python-only vLLM was asked for, and it has compiled modules: {', '.join(names)}")
        return {"modules": [], "note": "Python-only wheel (rehearsal): no compiled module"}
    if not names:
        raise RuntimeError(f"no compiled module under {package}: this vLLM has no kernels")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as stub_dir:
        if args.driver_stub:
            # The loader looks for the driver by its soname; the stub answers every call with an error.
            os.symlink(args.driver_stub, os.path.join(stub_dir, "libcuda.so.1"))
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (stub_dir, env.get("LD_LIBRARY_PATH", "")) if p)
        done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *names], capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"importing vLLM's compiled modules failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["failed"]:
        raise RuntimeError("; ".join(f"{name} does not import: {why}" for name, why in result["failed"].items()))
    return {"modules": result["imported"], "driver_stub": args.driver_stub, "torch": vllm_torch()}


def vllm_torch():
    """The torch vLLM's metadata requires, and the one installed: the torch its kernels were built against."""
    from packaging.requirements import Requirement

    required = [r for r in importlib.metadata.requires("vllm") or [] if Requirement(r).name == "torch"]
    installed = torch.__version__.split("+")[0]
    for line in required:
        req = Requirement(line)
        if (req.marker is None or req.marker.evaluate()) and not req.specifier.contains(installed, prereleases=True):
            raise RuntimeError(f"vLLM requires {line}, and torch {torch.__version__} is installed")
    return {
        "required": required or "none (a source build drops vLLM's torch pin: use_existing_torch.py)",
        "installed": torch.__version__,
    }


def triton_driver_stub():
    import triton
    from triton.runtime import build

    driver_c = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "driver.c"
    include = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "cuda_utils.c"
        src.write_text(driver_c.read_text())
        # Triton's own compile step for the stub it builds on first use; libcuda is linked at run time.
        # Triton 3.7+ takes compiler flags too.
        flags = {"ccflags": []} if "ccflags" in inspect.signature(build._build).parameters else {}
        so = build._build("cuda_utils", str(src), tmp, [], [str(include)], [], **flags)
        size = pathlib.Path(so).stat().st_size
    return {"triton": triton.__version__, "compiler": build._find_compiler("c"), "stub_bytes": size}


JIT_UNIT = """
#include <cuda_runtime.h>
#include <nvrtc.h>
#include <cublas_v2.h>
#include <curand_kernel.h>
#include <cub/cub.cuh>
__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }
"""


def cuda_jit():
    home = pathlib.Path(os.environ["CUDA_HOME"])
    nvcc = home / "bin" / "nvcc"
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    release = version.split("release ")[1].split(",")[0]
    if not release.startswith(args.cuda):
        raise RuntimeError(f"nvcc in {home} is CUDA {release}, the image is for CUDA {args.cuda}")
    with tempfile.TemporaryDirectory() as tmp:
        unit = pathlib.Path(tmp) / "jit.cu"
        unit.write_text(JIT_UNIT)
        done = subprocess.run(
            [str(nvcc), "-c", str(unit), "-o", str(unit.with_suffix(".o")), "-arch=sm_120"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nvcc could not compile a unit with CUDA's headers:\n{done.stderr[-2000:]}")
    return {"cuda_home": str(home), "nvcc": release}


def flashinfer_toolkit():
    try:
        importlib.import_module("flashinfer")
    except ImportError:
        return "not installed"
    from flashinfer.jit import cpp_ext

    path = cpp_ext.get_cuda_path()
    cubins = pathlib.Path("/opt/sparkbuild/cubins.txt")
    return {
        "version": importlib.metadata.version("flashinfer-python"),
        "cuda_path": str(path),
        "cubins": cubins.read_text().strip() if cubins.is_file() else "unknown",
    }


def companions():
    versions = {}
    for name in ("torchvision", "torchaudio", "torchcodec"):
        importlib.import_module(name)
        versions[name] = importlib.metadata.version(name)
    return versions


def multi_node():
    import ray

    libraries = {}
    for name in ("libibverbs.so.1", "librdmacm.so.1"):
        ctypes.CDLL(name)
        libraries[name] = "loads"
    return {"ray": ray.__version__, **libraries, "nccl_h": nccl_header(), "nccl": nccl_version()}


# NCCL deadlocks CUDA graphs captured across nodes from 2.28.9, as reported, until 2.30.4 fixed it (vLLM #52504):
# two Sparks serving with graphs hang. Earlier releases were not reported to.
NCCL_HANGS = ((2, 28, 9), (2, 30, 4))


def nccl_version():
    """The NCCL torch loads, by its own ncclGetVersion (no GPU needed), outside the range that hangs. Not
    torch.cuda.nccl.version(): that is the NCCL torch was compiled against (2.30.7 in torch 2.14.0's wheel
    whatever libnccl.so.2 is installed; measured), and a wheel installed over it is what this check is for."""
    # torch loaded libnccl.so.2 by its path; asked by its soname, the loader gives that same library.
    library = ctypes.CDLL("libnccl.so.2")
    code = ctypes.c_int()
    if library.ncclGetVersion(ctypes.byref(code)) != 0:
        raise RuntimeError("ncclGetVersion failed in the NCCL torch loads")
    found = (code.value // 10000, code.value % 10000 // 100, code.value % 100)  # NCCL_VERSION_CODE since 2.9
    text = ".".join(map(str, found))
    first, fixed = NCCL_HANGS
    if first <= found < fixed:
        raise RuntimeError(
            f"torch loads NCCL {text}, which deadlocks CUDA graphs across nodes (vLLM #52504, from "
            f"{'.'.join(map(str, first))}; fixed in {'.'.join(map(str, fixed))}): install nvidia-nccl at "
            f"{'.'.join(map(str, fixed))} or later"
        )
    return text


def nccl_header():
    """vLLM's NCCL allocator (symmetric memory, multi-GPU) compiles against nccl.h at run time and
    looks for it in the nvidia-nccl wheel (vLLM's Dockerfile installed libnccl-dev before that)."""
    try:
        from vllm.utils.nccl import find_nccl_include_paths
    except ModuleNotFoundError:
        return "not looked up by this vLLM"
    found = [p for p in find_nccl_include_paths() or [] if os.path.isfile(os.path.join(p, "nccl.h"))]
    if not found:
        raise RuntimeError("vLLM finds no nccl.h (nvidia-nccl wheel or VLLM_NCCL_INCLUDE_PATH)")
    return found[0]


def triton_ptxas():
    chosen = json.loads(pathlib.Path("/opt/sparkbuild/bin/ptxas.json").read_text())
    for variable in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        if os.path.realpath(os.environ.get(variable, "")) != os.path.realpath(chosen["chosen"]["path"]):
            raise RuntimeError(f"{variable}={os.environ.get(variable)} is not the ptxas chosen for {chosen['arch']}")
    return {"arch": chosen["arch"], "name": chosen["chosen"]["name"], "release": chosen["chosen"]["release"]}


def fastsafetensors():
    try:
        version = importlib.metadata.version("fastsafetensors")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    importlib.import_module("fastsafetensors")
    ctypes.CDLL("libnuma.so.1")  # what its native part opens (fastsafetensors/cpp/ext.cpp)
    return {"version": version, "libnuma.so.1": "loads"}


def vllm_plugins():
    """Each vllm.general_plugins entry point loads, as vLLM's load_plugins_by_group loads it."""
    loaded, failed = {}, []
    for entry in importlib.metadata.entry_points(group="vllm.general_plugins"):
        try:
            entry.load()
            loaded[entry.name] = f"{entry.value} ({entry.dist.name if entry.dist else '?'})"
        except Exception as exc:
            failed.append(f"{entry.name} = {entry.value}: {type(exc).__name__}: {exc}")
    if failed:
        raise RuntimeError("vLLM would serve without " + "; ".join(failed))
    return loaded


def shared_files():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import shared_files as owners  # beside this script: the owner rule has one home

    return owners.check()


CHECKS = (
    ("torch", torch_build),
    ("vllm", vllm_source),
    ("vllm_extensions", vllm_extensions),
    ("triton", triton_driver_stub),
    ("cuda_jit", cuda_jit),
    ("flashinfer", flashinfer_toolkit),
    ("companions", companions),
    ("multi_node", multi_node),
    ("triton_ptxas", triton_ptxas),
    ("fastsafetensors", fastsafetensors),
    ("vllm_plugins", vllm_plugins),
    ("shared_files", shared_files),
)
unknown = sorted(set(args.only or ()) - {name for name, _ in CHECKS})
if unknown:
    sys.exit(f"no such check: {', '.join(unknown)}; the checks are {', '.join(name for name, _ in CHECKS)}")
for name, func in CHECKS:
    if not args.only or name in args.only:
        check(name, func)
if problems:
    sys.exit("image check failed:\n  " + "\n  ".join(problems))
if not args.only:  # the image's record holds every check, never some
    found["vllm_path"] = found["vllm"]["path"]
    pathlib.Path("/opt/sparkbuild/installed.json").write_text(json.dumps(found, indent=2) + "\n")
print(json.dumps(found))
