"""Patches: ``patches/<name>/`` folders. This module gives each one a content digest for the plan."""

from __future__ import annotations

import hashlib
from pathlib import Path


def digest(patches_dir: Path, name: str) -> str:
    """sha256 over every file of the patch folder (relative path and content), in sorted order."""
    folder = patches_dir / name
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f"\0{path.relative_to(folder).as_posix()}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()
