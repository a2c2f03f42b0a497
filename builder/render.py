"""Render a target's Dockerfile from ``dockerfiles/<profile>/`` with jinja2 (StrictUndefined).

A profile folder holds ``Dockerfile.j2`` and the small files the build copies or mounts; they are
part of the build context and of the content hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from builder.errors import ConfigError

TEMPLATE = "Dockerfile.j2"


@dataclass(frozen=True, kw_only=True)
class Rendered:
    dockerfile: str
    # Support files of the profile: (name, content), sorted by name.
    files: tuple[tuple[str, bytes], ...]

    def digest(self) -> str:
        h = hashlib.sha256(self.dockerfile.encode())
        for name, content in self.files:
            h.update(f"\0{name}\0".encode())
            h.update(content)
        return h.hexdigest()


def profile_dir(dockerfiles: Path, profile: str) -> Path:
    folder = dockerfiles / profile
    if not (folder / TEMPLATE).is_file():
        raise ConfigError(f"{folder / TEMPLATE}: no Dockerfile template for profile '{profile}'")
    return folder


def render(dockerfiles: Path, profile: str, variables: dict[str, Any]) -> Rendered:
    folder = profile_dir(dockerfiles, profile)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - Dockerfiles, not HTML
    )
    try:
        text = env.get_template(TEMPLATE).render(**variables)
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"{folder / TEMPLATE}: {exc.message}; the plan gives: {', '.join(sorted(variables))}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{folder / TEMPLATE}:{exc.lineno}: template syntax error: {exc.message}") from None
    files = tuple((path.name, path.read_bytes()) for path in sorted(folder.iterdir()) if path.is_file() and path.name != TEMPLATE)
    return Rendered(dockerfile=text, files=files)
