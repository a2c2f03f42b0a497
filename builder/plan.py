"""Targets -> build plans: rendered Dockerfile, inputs, content-addressed and readable tags.

Pure: reads the matrix, templates and patch files, and never talks to Docker or the network.
The content hash covers every input that changes the image; where wheels are downloaded from
does not change the image and stays out of it.
"""

from __future__ import annotations

import configparser
import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder import __version__, base_image, matrix, patch, render
from builder.errors import ConfigError
from builder.matrix import Target
from builder.options import Options

# Bump when the meaning of the inputs changes, so every tag moves once.
PLAN_FORMAT = 1
STEPS = ("base", "build", "verify", "publish")


@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    target: Target
    base_ref: str
    rendered: render.Rendered
    inputs: dict[str, Any]
    content_hash: str
    content_tag: str
    tags: tuple[str, ...]
    labels: dict[str, str]
    # Where pip finds wheels for this build: build args plus an optional local wheel to mount.
    source_args: dict[str, str] = field(default_factory=dict)
    wheel_files: tuple[Path, ...] = ()
    steps: tuple[str, ...] = STEPS

    @property
    def id(self) -> str:
        return self.target.id

    @property
    def repository(self) -> str:
        return self.target.repository

    def manifest(self) -> dict[str, Any]:
        """The build manifest written into the image: every input, and the tag it gave."""
        return {
            "sparkbuild": __version__,
            "target": self.id,
            "repository": self.repository,
            "content_tag": self.content_tag,
            "content_hash": self.content_hash,
            "inputs": self.inputs,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "profile": self.target.profile,
            "platform": self.target.platform,
            "vllm": {"kind": self.target.vllm.kind, "spec": self.target.vllm.spec, "version": self.target.vllm.version},
            "repository": self.repository,
            "content_tag": self.content_tag,
            "tags": list(self.tags),
            "content_hash": self.content_hash,
            "base": self.base_ref,
            "steps": list(self.steps),
            "check": self.target.check.name,
            "inputs": self.inputs,
            "labels": self.labels,
            "sources": self.source_args,
        }


def select(targets: tuple[Target, ...], only: tuple[str, ...], profile: str | None) -> tuple[Target, ...]:
    chosen = tuple(
        t
        for t in targets
        if (profile is None or t.profile == profile) and (not only or any(fnmatch.fnmatch(t.id, g) for g in only))
    )
    if not chosen:
        ids = ", ".join(t.id for t in targets)
        raise ConfigError(f"no target matches --only {' '.join(only) or '*'} --profile {profile or 'any'}; targets: {ids}")
    return chosen


def make(opts: Options) -> tuple[TargetPlan, ...]:
    """Load the matrix and plan every selected target."""
    m = matrix.load(opts.matrix)
    plans = tuple(plan_target(t, m.patches_dir, opts) for t in select(m.targets, opts.only, opts.profile))
    _check_tag_clash(plans)
    return plans


def plan_target(target: Target, patches_dir: Path, opts: Options) -> TargetPlan:
    base_ref, base_identity = base_image.reference(target.base, target.platform)
    variables = {
        "base_image": base_ref,
        "torch": target.torch,
        "vllm_wheel": target.vllm.spec,
        "vllm_version": target.vllm.version,
        "target": target,
    }
    rendered = render.render(opts.dockerfiles, target.profile, variables)
    patches = {name: patch.digest(patches_dir, name) for name in target.patches}
    inputs: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "id": target.id,
        "profile": target.profile,
        "platform": target.platform,
        "vllm": {"kind": target.vllm.kind, "spec": target.vllm.spec, "repo": target.vllm.repo},
        "triton": target.triton,
        "flashinfer": target.flashinfer,
        "cuda": target.cuda,
        "torch": target.torch,
        "arch_list": target.arch_list,
        "base": base_identity,
        "patches": patches,
        "dockerfile": rendered.digest(),
        "build_args": dict(target.build_args),
    }
    content_hash = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    fields = {"vllm_version": target.vllm.version, "date": opts.date, "id": target.id}
    source_args, wheels = torch_source(target, opts)
    return TargetPlan(
        target=target,
        base_ref=base_ref,
        rendered=rendered,
        inputs=inputs,
        content_hash=content_hash,
        content_tag=f"{target.id}-{content_hash[:12]}",
        tags=tuple(t.format(**fields) for t in target.tags),
        labels=labels(target, base_identity, patches, content_hash),
        source_args=source_args,
        wheel_files=wheels,
    )


def labels(target: Target, base_identity: str, patches: dict[str, str], content_hash: str) -> dict[str, str]:
    oci = "org.opencontainers.image"
    return {
        f"{oci}.title": f"vLLM {target.vllm.version} ({target.id})",
        f"{oci}.description": "vLLM built, patched and verified by sparkbuild",
        f"{oci}.version": target.vllm.version,
        f"{oci}.revision": target.vllm.spec if target.vllm.kind == "wheel" else "unresolved",
        f"{oci}.source": target.vllm.repo or "https://github.com/vllm-project/vllm",
        f"{oci}.base.name": target.base.image or f"debootstrap:{target.base.name}",
        "io.sparkbuild.target": target.id,
        "io.sparkbuild.content-hash": content_hash,
        "io.sparkbuild.vllm.version": target.vllm.version,
        "io.sparkbuild.vllm.source": f"{target.vllm.kind}:{target.vllm.spec}",
        "io.sparkbuild.vllm.commit": "none (PyPI wheel)" if target.vllm.kind == "wheel" else "unresolved",
        "io.sparkbuild.patches": ",".join(target.patches),
        "io.sparkbuild.patch-hashes": ",".join(f"{n}={h[:16]}" for n, h in patches.items()),
        "io.sparkbuild.cuda": target.cuda or "none",
        "io.sparkbuild.torch": target.torch,
        "io.sparkbuild.arch-list": target.arch_list,
        "io.sparkbuild.base": base_identity,
        "io.sparkbuild.check": target.check.name,
    }


def _check_tag_clash(plans: tuple[TargetPlan, ...]) -> None:
    owner: dict[tuple[str, str], str] = {}
    for p in plans:
        for tag in p.tags:
            key = (p.repository, tag)
            if key in owner:
                raise ConfigError(
                    f"{p.target.where}: readable tag {p.repository}:{tag} is claimed by {owner[key]} and {p.id}; "
                    "give one of them its own 'repository:' or 'tags:'"
                )
            owner[key] = p.id


# --- where pip finds torch -------------------------------------------------------------------


def torch_source(target: Target, opts: Options) -> tuple[dict[str, str], tuple[Path, ...]]:
    """Build args and local wheels that let pip find ``torch==<target.torch>``.

    ``torch_index`` is a folder of wheels, an index URL, or ``auto``: the folders in this host's pip
    configuration (``find-links``) when one holds the wheel, else the configured PyTorch CPU index.
    """
    if target.profile != "local":
        return {}, ()
    choice = target.torch_index
    folders = _pip_find_links() if choice == "auto" else ([Path(choice)] if "://" not in choice else [])
    for folder in folders:
        wheel = _find_wheel(folder, target.torch, target.platform)
        if wheel is not None:
            return {"PIP_FIND_LINKS": "/wheels"}, (wheel,)
    if choice == "auto":
        return {"PIP_EXTRA_INDEX_URL": opts.torch_cpu_index}, ()
    if "://" in choice:
        return {"PIP_EXTRA_INDEX_URL": choice}, ()
    raise ConfigError(f"{target.where}: torch_index '{choice}' holds no torch {target.torch} wheel for {target.platform}")


def _find_wheel(folder: Path, version: str, platform: str) -> Path | None:
    machine = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}[platform]
    if not folder.is_dir():
        return None
    found = sorted(folder.glob(f"torch-{version}-*{machine}.whl"))
    return found[0] if found else None


def _pip_find_links() -> list[Path]:
    """``find-links`` folders from PIP_FIND_LINKS and pip's configuration files."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    files = [
        os.environ.get("PIP_CONFIG_FILE", ""),
        "/etc/pip.conf",
        "/etc/xdg/pip/pip.conf",
        str(Path.home() / ".config/pip/pip.conf"),
        str(Path.home() / ".pip/pip.conf"),
    ]
    for name in files:
        if not name or not Path(name).is_file():
            continue
        parser = configparser.ConfigParser()
        parser.read(name)
        for section in ("global", "install"):
            values.extend(parser.get(section, "find-links", fallback="").split())
    return [Path(v.removeprefix("file://")) for v in values if "://" not in v or v.startswith("file://")]
