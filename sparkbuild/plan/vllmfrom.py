"""Where a Spark target's vLLM comes from: its source, compiled, or upstream's published wheel.

``vllm_from: auto`` (the default) takes upstream's wheel of the release when all of these hold, and
compiles the source otherwise:

- the target names a release (``vllm: {version: X.Y.Z}``): upstream publishes wheels of releases only;
- no patch of its set touches compiled sources (``sparkbuild.patch.scope``: only the ``vllm/``
  package's Python files, which the wheel installs as they are);
- ``sparkbuild resolve`` pinned the wheel for the target's platform (the lock's ``wheels``);
- check-binary passed on every kernel of the wheel for the target's GPU;
- the wheel requires the target's torch, and its extensions link the target's CUDA major.

``wheel`` asks for the wheel and refuses what stands against it (a ConfigError at the key, or at the
patch); ``source`` always compiles. The choice and its reason are part of the plan (``sparkbuild plan``).
Pure: reads the patch folders and the lock's pin, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement

from sparkbuild import patch
from sparkbuild.patch import scope
from sparkbuild.plan.lock import WheelPin

ASKED = ("auto", "source", "wheel")
Mode = Literal["source", "wheel"]


@dataclass(frozen=True, kw_only=True)
class Choice:
    asked: Literal["auto", "source", "wheel"]
    mode: Mode
    why: str
    # The pinned wheel the build installs (wheel mode only).
    wheel: WheelPin | None = None

    def to_json(self) -> dict[str, object]:
        found: dict[str, object] = {"asked": self.asked, "mode": self.mode, "why": self.why}
        if self.wheel is not None:
            found["wheel"] = {"filename": self.wheel.filename, "url": self.wheel.url, "sha256": self.wheel.sha256}
        return found

    def text(self) -> str:
        return f"{self.mode} ({'vllm_from: ' + self.asked + '; ' if self.asked != 'auto' else ''}{self.why})"


@dataclass(frozen=True, kw_only=True)
class Against:
    """What stands against the wheel: the reason, and for a patch its name and the file."""

    why: str
    patch: str | None = None
    pinned: bool = True


def compiled_changes(names: tuple[str, ...], folders: Mapping[str, Path]) -> list[tuple[str, str]]:
    """(patch, file) for each file a patch of the set may change that is not an installed Python file."""
    return [(name, path) for name in names for path in scope.compiled(patch.load_one(folders[name]))]


def against(
    *,
    kind: str,
    version: str,
    platform: str,
    patches: tuple[str, ...],
    folders: Mapping[str, Path],
    pin: WheelPin | None,
    gpu: str,
    torch: str,
    cuda: str | None,
) -> Against | None:
    """The first reason the target cannot use upstream's wheel; None when it can."""
    if kind != "version":
        what = "a release candidate (a git tag)" if kind == "candidate" else f"a git {kind}"
        return Against(why=f"vLLM from {what}: upstream publishes wheels of releases only")
    compiled = compiled_changes(patches, folders)
    if compiled:
        name, path = compiled[0]
        more = f" (and {len(compiled) - 1} more)" if len(compiled) > 1 else ""
        return Against(why=f"patch {name} changes {path}{more}, a compiled source the wheel cannot take", patch=name)
    if pin is None:
        return Against(
            why=f"upstream's wheel of vLLM {version} for {platform} is not pinned: run `sparkbuild resolve`", pinned=False
        )
    if pin.missing is not None:
        return Against(why=pin.missing)
    verdict = pin.check_binary.get(gpu)
    if verdict is None:
        return Against(
            why=f"{pin.filename} has no check-binary verdict for GPU {gpu} in the lock: run `sparkbuild resolve`", pinned=False
        )
    if not verdict.ok:
        return Against(why=f"{pin.filename} fails check-binary for GPU {gpu}: {verdict.text()}")
    wrong_torch = _torch_disagrees(pin.torch, torch)
    if wrong_torch:
        return Against(why=f"{pin.filename} {wrong_torch}")
    major = None if cuda is None else cuda.split(".")[0]
    if pin.cuda is not None and pin.cuda != major:
        return Against(
            why=f"{pin.filename}'s extensions link libcudart.so.{pin.cuda} (CUDA {pin.cuda}); the target is CUDA {cuda}"
        )
    return None


def _torch_disagrees(required: str | None, torch: str) -> str:
    """Why the wheel's torch requirement does not admit the target's torch; "" when it does."""
    if required is None:
        return ""
    try:
        wanted = Requirement(required)
    except InvalidRequirement:
        return f"requires torch as {required!r}, which is not a requirement pip reads"
    # "2.14.0" admits its "+cu130" build: the local label names the build, not the version.
    if not wanted.specifier.contains(torch.split("+")[0], prereleases=True):
        return f"requires {required}; the target's torch is {torch}"
    return ""


def choose(
    asked: Literal["auto", "source", "wheel"],
    *,
    kind: str,
    version: str,
    platform: str,
    patches: tuple[str, ...],
    folders: Mapping[str, Path],
    pin: WheelPin | None,
    gpu: str,
    torch: str,
    cuda: str | None,
) -> Choice:
    """The target's mode and why. ``wheel`` with something against it raises ``Refused`` (the caller
    names the matrix line), except an unpinned wheel: that is unresolved, and the build refuses it."""
    if asked == "source":
        return Choice(asked=asked, mode="source", why="the matrix asks for the source build")
    found = against(
        kind=kind, version=version, platform=platform, patches=patches, folders=folders, pin=pin, gpu=gpu, torch=torch, cuda=cuda
    )
    if found is None:
        assert pin is not None and pin.sha256 is not None
        verdict = pin.check_binary[gpu]
        said = f"{_named(patches)}: Python files only" if patches else "no patch"
        links = f"CUDA {pin.cuda}" if pin.cuda else "no libcudart"
        why = (
            f"{said}; upstream's {pin.filename} (sha256 {pin.sha256[:16]}...) passes check-binary for GPU {gpu} "
            f"({verdict.text()}), requires {pin.torch or 'no particular torch'} and links {links}"
        )
        return Choice(asked=asked, mode="wheel", why=why, wheel=pin)
    if asked == "wheel" and found.pinned:
        raise Refused(found)
    if asked == "wheel":
        return Choice(asked=asked, mode="wheel", why=found.why)
    return Choice(asked=asked, mode="source", why=found.why)


def _named(patches: tuple[str, ...]) -> str:
    return ("patch " if len(patches) == 1 else "patches ") + ", ".join(patches)


class Refused(Exception):
    """``vllm_from: wheel`` where the wheel cannot be used: the caller raises it as a ConfigError naming
    the matrix line (the key, or the patch)."""

    def __init__(self, found: Against) -> None:
        super().__init__(found.why)
        self.found = found
