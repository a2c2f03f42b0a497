"""What runs BuildKit: buildx with its driver, or a pre-23 ``docker build`` with BuildKit built in.

Found by running the docker CLI (``buildx version``, ``buildx inspect``, ``version``), never through
the docker SDK: ``plan`` shows the build cache each builder gets without loading the SDK.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.config import options
from sparkbuild.errors import EngineError
from sparkbuild.util import cmd, log

# buildx drivers whose BuildKit can export a cache to a registry (the docker driver cannot).
EXPORTING_DRIVERS = ("docker-container", "remote", "kubernetes")


@dataclass(frozen=True, kw_only=True)
class Builder:
    """What runs BuildKit, as far as its cache goes: buildx and its driver, or ``docker build``."""

    buildx: bool
    # buildx's driver; "docker" for ``docker build``, whose BuildKit is the engine's own.
    driver: str
    # The docker client's version ("20.10.24+dfsg1"); shown only.
    client: str = ""

    def text(self) -> str:
        if self.buildx:
            return f"buildx, {self.driver} driver"
        return f"docker {'.'.join(self.client.split('.')[:2]) or '(unknown version)'} build, no buildx"

    @property
    def exports_cache(self) -> bool:
        return self.buildx and self.driver in EXPORTING_DRIVERS


@dataclass(frozen=True)
class BuildCli:
    """How to invoke BuildKit: the command prefix and the environment it needs."""

    prefix: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # What its BuildKit can do with a build cache (buildcache.choose reads it).
    builder: Builder


def find_build_cli(candidates: Sequence[str] | None = None) -> BuildCli:
    """The first docker CLI that can drive BuildKit; ``SPARKBUILD_DOCKER_CLI`` picks one."""
    chosen = options.env("SPARKBUILD_DOCKER_CLI")
    names = [chosen] if chosen else list(candidates or (shutil.which("docker") or "", "/usr/bin/docker"))
    tried = []
    for name in dict.fromkeys(n for n in names if n):
        if not Path(name).exists() and shutil.which(name) is None:
            tried.append(f"{name} (not found)")
            continue
        if _quiet([name, "buildx", "version"]):
            builder = Builder(buildx=True, driver=_buildx_driver(name))
            return BuildCli(prefix=(name, "buildx", "build"), env=(), builder=builder)
        version = _client_version(name)
        major = version.split(".")[0]
        if major.isdigit() and int(major) < 23:
            builder = Builder(buildx=False, driver="docker", client=version)
            return BuildCli(prefix=(name, "build"), env=(("DOCKER_BUILDKIT", "1"),), builder=builder)
        tried.append(f"{name} (client {version or None}, no buildx)")
    raise EngineError(
        f"no docker CLI that can run BuildKit builds: tried {', '.join(tried) or 'none'}; "
        "install buildx (apt-get install docker-buildx) or Debian's docker.io client, "
        "or set SPARKBUILD_DOCKER_CLI"
    )


def _quiet(args: list[str]) -> bool:
    return subprocess.run(args, capture_output=True, check=False).returncode == 0


def _client_version(name: str) -> str:
    result = subprocess.run([name, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True, check=False)
    return result.stdout.strip()


def _buildx_driver(name: str) -> str:
    """The current buildx builder's driver ("docker", "docker-container", ...); "unknown" when
    ``buildx inspect`` does not say, which gets the inline cache every driver can carry."""
    args = [name, "buildx", "inspect"]
    log.info(cmd.show(args))
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    return buildx_driver(result.stdout) if result.returncode == 0 else "unknown"


def buildx_driver(inspect_output: str) -> str:
    """The ``Driver:`` of ``docker buildx inspect``'s output (its first builder node's)."""
    for line in inspect_output.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Driver" and value.strip():
            return value.strip()
    return "unknown"
