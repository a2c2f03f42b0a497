"""Run options: one frozen dataclass, read once. Precedence: defaults.yaml, environment, command line."""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


@cache
def defaults() -> dict[str, Any]:
    text = (resources.files("builder") / "resources" / "defaults.yaml").read_text(encoding="utf-8")
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def project_root() -> Path:
    """The checkout that holds ``matrix.yaml``, ``dockerfiles/`` and ``patches/``."""
    return Path(__file__).resolve().parent.parent


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparkbuild"


def today() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d")


@dataclass(frozen=True, kw_only=True)
class Options:
    matrix: Path
    dockerfiles: Path
    cache: Path
    out: Path
    date: str
    only: tuple[str, ...] = ()
    profile: str | None = None
    # The lock file; None: <matrix>.lock.json beside the matrix, when it exists.
    lock: Path | None = None
    # None: start an embedded registry for the run.
    registry: str | None = None
    torch_cpu_index: str = ""
    ca_bundle: Path | None = None
    # What the compile may use: available memory (bytes) and cores where BuildKit runs.
    build_memory: int = 0
    build_cores: int = 1

    @classmethod
    def from_env(cls, **overrides: Any) -> Options:
        """Defaults, then SPARKBUILD_* variables, then ``overrides`` (the command line) where not None."""
        from builder import toolchain  # toolchain imports the matrix module: only planning needs it

        root = project_root()
        d = defaults()["options"]
        env = os.environ
        ca = env.get("SPARKBUILD_CA_BUNDLE", d["ca_bundle"])
        memory, cores = toolchain.host_resources()
        if env.get("SPARKBUILD_BUILD_MEMORY_GB"):
            memory = int(float(env["SPARKBUILD_BUILD_MEMORY_GB"]) * toolchain.GIB)
        if env.get("SPARKBUILD_BUILD_CORES"):
            cores = int(env["SPARKBUILD_BUILD_CORES"])
        values: dict[str, Any] = {
            "matrix": Path(env.get("SPARKBUILD_MATRIX", root / "matrix.yaml")),
            "dockerfiles": Path(env.get("SPARKBUILD_DOCKERFILES", root / "dockerfiles")),
            "cache": Path(env.get("SPARKBUILD_CACHE", default_cache())),
            "out": Path(env.get("SPARKBUILD_OUT", Path.cwd() / "sparkbuild-out")),
            "date": env.get("SPARKBUILD_DATE", today()),
            "registry": env.get("SPARKBUILD_REGISTRY") or None,
            "lock": Path(env["SPARKBUILD_LOCK"]) if env.get("SPARKBUILD_LOCK") else None,
            "torch_cpu_index": env.get("SPARKBUILD_TORCH_CPU_INDEX", d["torch_cpu_index"]),
            "ca_bundle": Path(ca) if ca else None,
            "build_memory": memory,
            "build_cores": cores,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
