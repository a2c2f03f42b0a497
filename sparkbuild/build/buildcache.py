"""BuildKit's build cache across runners: which cache a builder can carry, and the flags it is given.

Stage images already travel through the registry by content (``sparkbuild/stages:<stage>-<hash>``):
an unchanged stage is pulled, never rebuilt. The build cache is for a stage whose hash changed: its
unchanged layers (toolchain, torch) come from the last build of the same stage of the same target,
on any runner, kept under a moving tag ``<registry>/sparkbuild/cache:<target>-<stage>``.

- ``registry``: buildx with a driver that exports a cache (docker-container, remote, kubernetes):
  ``--cache-from type=registry,ref=REF`` and ``--cache-to type=registry,ref=REF,mode=max`` on every
  stage, the image's too; BuildKit writes the cache while it builds.
- ``inline``: ``docker build`` without buildx (Debian's docker.io 20.10 client), or buildx's docker
  driver, which cannot export a cache ("cache export feature is currently not supported for docker
  driver"): a stage image is built with ``BUILDKIT_INLINE_CACHE=1`` (the cache metadata rides in
  its config), pushed as before and then under its cache tag; a build reads it with ``--cache-from
  REF``. The target's image gets none: it is pushed only by publish, after verify.
- ``none``: no registry in the run, or ``SPARKBUILD_BUILD_CACHE=off``.

The flags go to the build command only, in no Dockerfile and no hash: stage hashes and content tags
are the same in every mode. Pure: ``plan`` shows what each mode passes without asking Docker; the
builder is probed (``buildkit.find_build_cli``) when a build starts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sparkbuild import oci
from sparkbuild.config.options import BuildCacheSetting
from sparkbuild.errors import ConfigError
from sparkbuild.oci.buildkit import EXPORTING_DRIVERS, Builder
from sparkbuild.plan.plan import StagePlan, TargetPlan

CACHE_REPOSITORY = "sparkbuild/cache"
# What the shown flags put in place of a registry the plan does not know yet (the embedded one's port).
SOME_REGISTRY = "<registry>"


class Mode(StrEnum):
    REGISTRY = "registry"
    INLINE = "inline"
    NONE = "none"


WHEN: dict[BuildCacheSetting, str] = {
    "auto": f"registry with buildx ({', '.join(EXPORTING_DRIVERS)} driver), else inline (docker build without buildx, "
    "like Debian's 20.10, or buildx's docker driver)",
    "registry": "registry (SPARKBUILD_BUILD_CACHE=registry)",
    "inline": "inline (SPARKBUILD_BUILD_CACHE=inline)",
}
WHAT: dict[Mode, str] = {
    Mode.REGISTRY: "--cache-from type=registry,ref=REF --cache-to type=registry,ref=REF,mode=max on every stage",
    Mode.INLINE: "stage images carry BuildKit's inline cache (--build-arg BUILDKIT_INLINE_CACHE=1), pushed as REF too; "
    "--cache-from REF (the image: none, publish pushes it after verify)",
    Mode.NONE: "no build cache from other runners",
}


@dataclass(frozen=True)
class Choice:
    mode: Mode
    why: str

    def text(self) -> str:
        """``inline (docker 20.10 build, no buildx): stage images carry ...``, as a build logs it."""
        return f"{self.mode} ({self.why}): {WHAT[self.mode]}"


def choose(setting: BuildCacheSetting, builder: Builder, registry: bool) -> Choice:
    """The cache a build uses: the setting, where the run has a registry and the builder can."""
    if setting == "off":
        return Choice(Mode.NONE, "SPARKBUILD_BUILD_CACHE=off")
    if not registry:
        return Choice(Mode.NONE, "no registry in this run")
    if setting == "inline":
        return Choice(Mode.INLINE, f"SPARKBUILD_BUILD_CACHE=inline, {builder.text()}")
    if builder.exports_cache:
        return Choice(Mode.REGISTRY, builder.text())
    if setting == "registry":
        raise ConfigError(
            f"SPARKBUILD_BUILD_CACHE=registry: {builder.text()} cannot export a build cache; use a builder that can "
            "(docker buildx create --use --driver docker-container), or set SPARKBUILD_BUILD_CACHE=auto (inline cache)"
        )
    return Choice(Mode.INLINE, builder.text())


def tag(target_id: str, stage: str) -> str:
    """The moving cache tag of one stage of one target; a stage name too long for it is hashed."""
    name = f"{target_id}-{stage}"
    return name if oci.is_tag(name) else f"{target_id}-{hashlib.sha256(stage.encode()).hexdigest()[:12]}"


def ref(host: str, target_id: str, stage: str) -> str:
    return f"{host}/{CACHE_REPOSITORY}:{tag(target_id, stage)}"


def flags(mode: Mode, cache_ref: str, *, final: bool) -> tuple[str, ...]:
    """What the build command is given for one stage (``final``: the target's image)."""
    if mode is Mode.REGISTRY:
        return ("--cache-from", f"type=registry,ref={cache_ref}", "--cache-to", f"type=registry,ref={cache_ref},mode=max")
    if mode is Mode.INLINE and not final:
        return ("--build-arg", "BUILDKIT_INLINE_CACHE=1", "--cache-from", cache_ref)
    return ()


def stage_flags(mode: Mode, host: str, plan: TargetPlan, stage: StagePlan) -> tuple[str, ...]:
    return flags(mode, ref(host, plan.id, stage.name), final=stage.final)


def shown_modes(setting: BuildCacheSetting) -> tuple[Mode, ...]:
    """The modes a build may use under ``setting``, when the builder is not known yet."""
    return {"auto": (Mode.REGISTRY, Mode.INLINE), "registry": (Mode.REGISTRY,), "inline": (Mode.INLINE,), "off": ()}[setting]


def describe(plan: TargetPlan, setting: BuildCacheSetting, host: str | None) -> dict[str, Any]:
    """What ``plan --json`` shows: each stage's cache ref, and its flags in each mode a build may use."""
    where = host or SOME_REGISTRY
    return {
        "setting": setting,
        "refs": {s.name: ref(where, plan.id, s.name) for s in plan.stages},
        "modes": {
            str(mode): {s.name: list(stage_flags(mode, where, plan, s)) for s in plan.stages} for mode in shown_modes(setting)
        },
    }


def lines(plan: TargetPlan, setting: BuildCacheSetting, host: str | None) -> list[str]:
    """What ``plan`` prints: the mode (or modes, the builder deciding), what each passes, each stage's REF."""
    if setting == "off":
        return ["none (SPARKBUILD_BUILD_CACHE=off)"]
    where = host or SOME_REGISTRY
    return [
        f"{WHEN[setting]}; none without a registry",
        *(f"{mode + ':':<9} {WHAT[mode]}" for mode in shown_modes(setting)),
        *(f"{s.name:<11} REF {ref(where, plan.id, s.name)}" for s in plan.stages),
    ]
