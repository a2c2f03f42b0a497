"""What a base image is called: its content-addressed reference, from the recipe that makes it.

Pure: the plan hashes a target's bases with it, and base_image makes (or finds) the image it names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from sparkbuild.plan.matrix import Base

REPOSITORY = "sparkbuild/base"
# Bump when the way a base is made changes.
RECIPE_VERSION = 1
CUDA_RECIPE_VERSION = 2


def reference(base: Base, platform: str) -> tuple[str, str]:
    """(image reference for FROM, identity for the content hash). Pure."""
    if base.image is not None:
        # An unpinned image (no lock yet) keeps its name; plan marks it unresolved and build refuses it.
        return base.image, base.image.rsplit("@", 1)[1] if "@" in base.image else f"unpinned:{base.image}"
    key = hashlib.sha256(json.dumps(recipe(base, platform), sort_keys=True).encode()).hexdigest()
    kind = "cuda-wheels" if base.cuda_wheels is not None else "debootstrap"
    return f"{REPOSITORY}:{base.name}-{key[:16]}", f"{kind}:{key}"


def recipe(base: Base, platform: str) -> dict[str, object]:
    """Everything that decides a made base's content."""
    if base.cuda_wheels is not None:
        cuda = base.cuda_wheels
        return {
            "cuda_wheels": {"toolkit": cuda.toolkit, "flavor": cuda.flavor, "components": sorted(cuda.components)},
            "on": reference(cuda.base, platform)[1],
            "platform": platform,
            "version": CUDA_RECIPE_VERSION,
        }
    assert base.debootstrap is not None
    return {"debootstrap": asdict(base.debootstrap), "platform": platform, "version": RECIPE_VERSION}
