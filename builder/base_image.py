"""Base images: pinned by digest, or made here with debootstrap + ``docker import``, cached by content."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from builder import cmd, log
from builder.errors import BuildError, ToolMissingError
from builder.matrix import Base

if TYPE_CHECKING:  # planning imports this module and must not need the docker SDK
    from builder.engine import Engine

REPOSITORY = "sparkbuild/base"
# Bump when the way a base is made changes.
RECIPE_VERSION = 1


def reference(base: Base, platform: str) -> tuple[str, str]:
    """(image reference for FROM, identity for the content hash). Pure."""
    if base.image is not None:
        # An unpinned image (no lock yet) keeps its name; plan marks it unresolved and build refuses it.
        return base.image, base.image.rsplit("@", 1)[1] if "@" in base.image else f"unpinned:{base.image}"
    assert base.debootstrap is not None
    recipe = {"debootstrap": asdict(base.debootstrap), "platform": platform, "version": RECIPE_VERSION}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    return f"{REPOSITORY}:{base.name}-{key[:16]}", f"debootstrap:{key}"


def ensure(engine: Engine, base: Base, platform: str, work: Path) -> str:
    """Make the base image unless the engine has it; returns its reference."""
    ref, _ = reference(base, platform)
    if base.image is not None or engine.image_exists(ref):
        log.info(f"base {ref}: present")
        return ref
    spec = base.debootstrap
    assert spec is not None
    if shutil.which("debootstrap") is None:
        raise ToolMissingError("making a base image needs debootstrap: apt-get install debootstrap")
    arch = {"linux/amd64": "amd64", "linux/arm64": "arm64"}[platform]
    with log.step(f"Making base image {ref} with debootstrap ({spec.suite}, {arch})"):
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work, prefix="rootfs-") as tmp:
            root = Path(tmp) / "root"
            args = ["debootstrap", f"--variant={spec.variant}", f"--arch={arch}"]
            if spec.include:
                args.append(f"--include={','.join(spec.include)}")
            result = cmd.run([*args, spec.suite, root, spec.mirror], check=False)
            if result.returncode != 0:
                raise BuildError(
                    f"debootstrap of {spec.suite} from {spec.mirror} failed (exit {result.returncode}); see its output above"
                )
            # Package caches and lists make the image bigger and its content vary from run to run.
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (root / junk).glob("*"):
                    if path.is_file():
                        path.unlink()
            engine.import_rootfs(root, ref, platform)
    return ref
