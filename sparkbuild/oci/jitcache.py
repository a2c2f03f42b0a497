"""Where a vLLM server keeps what it compiles at run time, so that a second start finds it.

FlashInfer's JIT modules, vLLM's torch.compile artifacts, TorchInductor's and Triton's kernels and
the CUDA driver's ComputeCache (PTX compiled for the GPU: FlashAttention 2, vLLM's default attention
on SM12x, ships only as PTX) each live in a folder of their own: a new container starts with none of
them and compiles again (minutes on a Spark). Each goes on a named volume that outlives the
container. ``sparkbuild run`` names the volumes for the user (one set, shared by the images they
run); verify names them for the image (by its ID): what an image compiled belongs to it alone, so
a changed image starts from nothing and compiles, and proves, its own.
"""

from __future__ import annotations

from dataclasses import dataclass

HOME = "/root"
# The ComputeCache is 256 MiB by default, less than the PTX one image JIT-compiles; 4 GiB is its largest.
CUDA_CACHE_MAXSIZE = "4294967296"


@dataclass(frozen=True)
class Cache:
    """One cache of run-time compiled code: a named volume mounted where the program looks."""

    name: str
    path: str
    what: str
    env: str | None = None


CACHES = (
    Cache("flashinfer", f"{HOME}/.cache/flashinfer", "FlashInfer's JIT-compiled modules"),
    Cache("vllm", f"{HOME}/.cache/vllm", "vLLM's torch.compile artifacts (torch_compile_cache)"),
    # Inductor's default is /tmp/torchinductor_<user>, which no volume should hold: point it here.
    Cache("inductor", f"{HOME}/.cache/torchinductor", "TorchInductor's generated kernels", "TORCHINDUCTOR_CACHE_DIR"),
    Cache("triton", f"{HOME}/.triton", "Triton's compiled kernels"),
    Cache("cuda", f"{HOME}/.nv/ComputeCache", "the CUDA driver's ComputeCache (PTX compiled for the GPU)", "CUDA_CACHE_PATH"),
)


def environment() -> dict[str, str]:
    """What points each program at its cache, where its default is not the path mounted."""
    return {**{c.env: c.path for c in CACHES if c.env}, "CUDA_CACHE_MAXSIZE": CUDA_CACHE_MAXSIZE}


def volumes(prefix: str) -> dict[str, str]:
    """Each cache's named volume (``prefix`` + its name) and where it is mounted."""
    return {f"{prefix}{c.name}": c.path for c in CACHES}


def for_image(image_id: str) -> dict[str, str]:
    """The volumes of one image's caches, by its ID."""
    return volumes(f"sparkbuild-jit-{image_id.removeprefix('sha256:')[:16]}-")
