"""File writes that a Ctrl-C, a kill or a second writer never leaves half done, and removals that
never reach outside the folder they belong to."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from sparkbuild.errors import ConfigError


def write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then a rename."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
        Path(name).replace(path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def inside(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or under it once both are resolved (symlinks and ``..`` followed)."""
    return path.resolve().is_relative_to(root.resolve())


def remove_tree(path: Path, root: Path) -> None:
    """Remove the folder ``path``, which must lie strictly inside ``root`` and not be a symlink."""
    if path.is_symlink() or not inside(path, root) or path.resolve() == root.resolve():
        raise ConfigError(f"refusing to remove {path}: it is not a folder inside {root}")
    shutil.rmtree(path, ignore_errors=True)


def files(folder: Path) -> list[Path]:
    """Every file under ``folder``, sorted. A symlink is followed only where it stays inside the folder:
    one that points out (``/etc/shadow``, ``../../.venv``) is refused, so nothing outside a patch or
    profile folder reaches a build context or an image."""
    found = []
    root = folder.resolve()
    for parent, dirs, names in os.walk(folder):
        # Python writes __pycache__ where it compiles a folder's .py files (pip does in an installed
        # wheel's package data): never an input, and it must not change a patch's digest.
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in [*dirs, *names]:
            path = Path(parent) / name
            if points_out(path, root):
                raise ConfigError(f"{path} is a symlink to {path.resolve()}, outside {folder}; copy the file in instead")
        found += [Path(parent) / n for n in names if (Path(parent) / n).is_file()]
    return sorted(found)


def points_out(path: Path, root: Path) -> bool:
    """``path`` is a symlink to a place outside ``root`` (a resolved folder)."""
    return path.is_symlink() and not path.resolve().is_relative_to(root)


def glob_regex(pattern: str) -> str:
    """A path glob as a regular expression: ``**/`` any folders (none included), ``*`` and ``?``
    within one name."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:[^/]+/)*", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out
