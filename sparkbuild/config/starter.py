"""``sparkbuild init``: a commented starter ``matrix.yaml`` for a team's own repository."""

from __future__ import annotations

import os
from pathlib import Path

from sparkbuild.errors import ConfigError
from sparkbuild.resources import packaged
from sparkbuild.util import log

STARTER = "starter-matrix.yaml"


def text() -> str:
    return packaged.resource(STARTER).read_text(encoding="utf-8")


def write(path: Path) -> Path:
    """Write the starter to ``path``; one that exists (even one made a moment ago) is never replaced."""
    try:
        # O_EXCL: the existence check and the creation are one step, so no second writer is overwritten.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConfigError(f"{path} exists; sparkbuild init never replaces a matrix (remove it, or pass --matrix NEW)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write it ({exc.strerror}); pass --matrix FILE in a writable folder") from None
    with os.fdopen(fd, "w", encoding="utf-8") as stream:
        stream.write(text())
    log.info(f"wrote {path}; next: sparkbuild plan")
    return path
