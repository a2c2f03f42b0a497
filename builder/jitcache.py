"""Where a vLLM server keeps what it compiles at run time, so a second start finds it.

torch.compile (vLLM's compile cache and inductor's), Triton, FlashInfer's JIT and the CUDA driver's
PTX JIT (ComputeCache) each write to a folder of their own under the user's home by default: a new
container starts with none of it and compiles again (minutes on a Spark; FA2 ships as PTX for SM12x
and is JIT-compiled in every new container). Pointed at one folder on a named volume, they are
kept between containers. The image's own files are not hidden: the volume is mounted beside them.
"""

from __future__ import annotations

MOUNT = "/var/cache/sparkbuild-jit"
ENV = {
    "VLLM_CACHE_ROOT": f"{MOUNT}/vllm",
    "TORCHINDUCTOR_CACHE_DIR": f"{MOUNT}/inductor",
    "TRITON_CACHE_DIR": f"{MOUNT}/triton",
    "FLASHINFER_WORKSPACE_BASE": f"{MOUNT}/flashinfer",
    "CUDA_CACHE_PATH": f"{MOUNT}/nv",
    # The driver's default ComputeCache is 256 MiB: vLLM's kernels for one model fill more.
    "CUDA_CACHE_MAXSIZE": str(4 << 30),
}


def volume_for(image_id: str) -> str:
    """The named volume of one image (by its ID): what it compiled belongs to it alone, so a
    changed image starts from nothing and compiles (and proves) its own."""
    return "sparkbuild-jit-" + image_id.removeprefix("sha256:")[:16]
