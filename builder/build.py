"""Build stage: base image, build context, BuildKit build of one planned target."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from builder import base_image, log
from builder.engine import Engine
from builder.options import Options
from builder.plan import TargetPlan


def local_ref(plan: TargetPlan) -> str:
    return f"{plan.repository}:{plan.content_tag}"


def write_context(plan: TargetPlan, folder: Path) -> Path:
    """Lay out the build context: Dockerfile, profile files, manifest, and local wheels to mount."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "wheels").mkdir(parents=True)
    (folder / "Dockerfile").write_text(plan.rendered.dockerfile, encoding="utf-8")
    for name, content in plan.rendered.files:
        (folder / name).write_bytes(content)
    (folder / "sparkbuild-manifest.json").write_text(json.dumps(plan.manifest(), indent=2, sort_keys=True) + "\n")
    for wheel in plan.wheel_files:
        try:
            os.link(wheel, folder / "wheels" / wheel.name)
        except OSError:  # another file system: a copy is the same bytes
            shutil.copy2(wheel, folder / "wheels" / wheel.name)
    return folder


def build(engine: Engine, plan: TargetPlan, opts: Options) -> str:
    """Build the target's image into the engine; returns its local reference."""
    base_image.ensure(engine, plan.target.base, plan.target.platform, opts.cache / "rootfs")
    context = write_context(plan, opts.cache / "contexts" / plan.id)
    secrets = {"pip-ca": opts.ca_bundle} if opts.ca_bundle and opts.ca_bundle.is_file() else {}
    if not secrets:
        log.info(f"no CA bundle at {opts.ca_bundle}: pip in the build uses the image's own certificates")
    ref = local_ref(plan)
    with log.step(f"Building {ref}"):
        engine.build(
            context=context,
            tag=ref,
            platform=plan.target.platform,
            labels=plan.labels,
            build_args={**dict(plan.target.build_args), **plan.source_args},
            secrets=secrets,
            log_file=opts.out / plan.id / "build.log",
        )
    return ref
