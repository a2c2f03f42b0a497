"""Where a run's inputs come from, so that sparkbuild runs in a team's own repository as in its checkout.

The matrix is ``./matrix.yaml`` (or ``--matrix``, or ``SPARKBUILD_MATRIX``). A profile's stage templates
are ``dockerfiles/<profile>/`` beside the matrix where that folder exists, else the packaged one; a
patch is found by name in the matrix's own patch folders (``patches_dir:``, default ``patches/`` beside
it), else in the packaged set. cibuildwheel and ``docker buildx bake`` read a project's files the same
way: from where they run, not from where they are installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.resources import packaged

PACKAGED = "packaged"
BESIDE = "beside the matrix"
FROM_OPTION = "SPARKBUILD_DOCKERFILES"


@dataclass(frozen=True)
class Found:
    """A folder, and the rule that chose it (``plan`` says both)."""

    path: Path
    origin: str

    def text(self) -> str:
        return f"{self.path} ({self.origin})"

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "origin": self.origin}


def origin(path: Path, kind: packaged.Kind, rule: str) -> str:
    """In a checkout the folders beside the matrix are the packaged ones: say so, not "beside"."""
    return PACKAGED if path.resolve().is_relative_to(packaged.folder(kind).resolve()) else rule


def dockerfile_roots(opts: Options) -> tuple[tuple[Path, str], ...]:
    """The folders searched for ``<profile>/``, in order, with the rule each stands for."""
    if opts.dockerfiles is not None:
        return ((opts.dockerfiles, FROM_OPTION),)
    return ((opts.matrix.parent / "dockerfiles", BESIDE), (packaged.folder("dockerfiles"), PACKAGED))


def profile_folder(opts: Options, profile: str) -> Found:
    """The stage templates of ``profile``: the first root that has the profile."""
    roots = dockerfile_roots(opts)
    for root, rule in roots:
        if (root / profile).is_dir():
            return Found(root / profile, origin(root / profile, "dockerfiles", rule))
    searched = ", ".join(str(root / profile) for root, _ in roots)
    raise ConfigError(
        f"no stage templates for profile '{profile}': none of {searched} exists; "
        f"add dockerfiles/{profile}/ beside {opts.matrix} or use a packaged profile ({', '.join(packaged_profiles())})"
    )


def packaged_profiles() -> list[str]:
    root = packaged.folder("dockerfiles")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))) if root.is_dir() else []


def patch_found(folder: Path) -> Found:
    """A patch folder of ``Matrix.patch_folders`` and whether it is the matrix's own or packaged."""
    return Found(folder, origin(folder, "patches", "the matrix's patches"))
