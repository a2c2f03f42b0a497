"""``sparkbuild run IMAGE MODEL``: start a published image the way a DGX Spark needs it.

What every public Spark guide does by hand, in one command that prints the ``docker run`` it runs
(``--print`` only prints it, for a machine without sparkbuild):

- the host's IPC namespace (``--ipc host``: PyTorch and NCCL share memory through /dev/shm, which
  Docker caps at 64 MB otherwise) and network (``--network host``: the OpenAI API on the host's port,
  and Ray and NCCL across two Sparks);
- every GPU (``--gpus all``) unless the image says it has no CUDA (``io.sparkbuild.cuda: none``);
- the Hugging Face cache from the host (``$HF_HOME`` or ``~/.cache/huggingface``), so a model
  downloaded once, in or out of a container, is not downloaded again; ``HF_TOKEN`` passed by name;
- the caches of what is compiled at serve time, on named volumes that outlive the container, so the
  second start of an image is warm: FlashInfer's JIT modules, vLLM's torch.compile artifacts,
  TorchInductor's and Triton's kernels, and the CUDA driver's ComputeCache (PTX that the driver
  compiles for the GPU: FlashAttention 2, vLLM's default attention on SM12x, ships only as PTX).

A MODEL that is a local folder is mounted read-only at ``/models/<name>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.config import options
from sparkbuild.errors import ConfigError, EngineError, ToolMissingError
from sparkbuild.oci.jitcache import CACHES, HOME, Cache, environment
from sparkbuild.util import cmd, log

PREFIX = "sparkbuild-"


@dataclass(frozen=True, kw_only=True)
class Launch:
    image: str
    model: str
    args: tuple[str, ...] = ()
    name: str | None = None
    port: int = 8000
    hf_cache: Path | None = None
    prefix: str = PREFIX
    gpus: bool | None = None
    detach: bool = False


def volume(cache: Cache, prefix: str) -> str:
    return f"{prefix}{cache.name}"


def hf_cache(given: Path | None) -> Path:
    """The host's Hugging Face cache: the one given, else ``$HF_HOME``, else ``~/.cache/huggingface``."""
    if given is not None:
        return given
    home = options.env("HF_HOME")
    return Path(home) if home else Path.home() / ".cache" / "huggingface"


def docker() -> str:
    """``docker``, by the name a user would type (the printed command is one to copy)."""
    if shutil.which("docker") is None:
        raise ToolMissingError("sparkbuild run starts the image with the docker command, which is not on PATH; install Docker")
    return "docker"


def has_cuda(image: str) -> bool:
    """Whether ``image`` wants the GPUs: unless its label says it has no CUDA. Pulled if absent."""
    inspect = [docker(), "image", "inspect", "--format", "{{json .Config.Labels}}", image]
    done = subprocess.run(inspect, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        cmd.run([docker(), "pull", image])
        done = cmd.run(inspect, capture=True, check=False)
        if done.returncode != 0:
            raise EngineError(f"cannot read the labels of {image}: {done.stderr.strip()}")
    labels = json.loads(done.stdout or "null") or {}
    return labels.get("io.sparkbuild.cuda") != "none"


def command(launch: Launch, gpus: bool) -> list[str]:
    """The ``docker run`` argument list."""
    out, model = options_and_model(launch, gpus)
    return [*out, launch.image, model, "--port", str(launch.port), *launch.args]


def options_and_model(launch: Launch, gpus: bool, env: Mapping[str, str] = {}) -> tuple[list[str], str]:
    """``docker run`` and its options (``env`` added to the environment), and the model as the server sees it."""
    # --init reaps the server's children (inductor's compile workers), as verify's servers do.
    out = [docker(), "run", "--init", "--network", "host", "--ipc", "host"]
    if launch.detach:
        out.append("--detach")  # kept when it stops, with its logs: `docker rm` removes it
    else:
        out.append("--rm")  # its logs are on the terminal
        if sys.stdin.isatty():
            out += ["--interactive", "--tty"]
    if launch.name:
        out += ["--name", launch.name]
    if gpus:
        out += ["--gpus", "all"]
    out += ["--volume", f"{hf_cache(launch.hf_cache)}:{HOME}/.cache/huggingface"]
    for cache in CACHES:
        out += ["--volume", f"{volume(cache, launch.prefix)}:{cache.path}"]
    out += [arg for key, value in {**environment(), **env}.items() for arg in ("--env", f"{key}={value}")]
    if options.env("HF_TOKEN"):
        out += ["--env", "HF_TOKEN"]  # by name: the value stays out of the command line
    model = launch.model
    folder = Path(launch.model)
    if folder.is_dir():
        model = f"/models/{folder.resolve().name}"
        out += ["--volume", f"{folder.resolve()}:{model}:ro"]
    return out, model


def run(launch: Launch, *, dry_run: bool) -> list[str]:
    """Start the image (in the foreground unless ``detach``); returns the command."""
    if launch.port <= 0 or launch.port > 65535:
        raise ConfigError(f"--port {launch.port}: expected a TCP port, 1-65535")
    gpus = launch.gpus if launch.gpus is not None else has_cuda(launch.image)
    args = command(launch, gpus)
    if dry_run:
        return args
    if not launch.detach:
        hf_cache(launch.hf_cache).mkdir(parents=True, exist_ok=True)
        log.info(cmd.show(args))
        sys.stdout.flush()
        sys.stderr.flush()
        # docker takes over the terminal and its signals (Ctrl-C stops the server, --rm removes it).
        os.execvp(args[0], args)  # noqa: S606 - an argument list, never a shell string
    hf_cache(launch.hf_cache).mkdir(parents=True, exist_ok=True)
    done = cmd.run(args, capture=True, check=False)
    if done.returncode != 0:
        raise EngineError(f"docker run of {launch.image} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return args
