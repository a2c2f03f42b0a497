"""Results kept under the cache by a key of everything they follow from (vLLM's start-up predicted in an
image, check-binary's reports of an image): written whole (gzip'd JSON), read back whole, and each folder
held to its newest ``KEEP`` entries. A nightly's new image is a new key every night; what a rerun asks
for again (a rehearsal run twice, a lane run again on an unchanged image) is among the newest, and a
read makes an entry newest again."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from sparkbuild.util import fsutil, log

# Enough for every target of a matrix across a week of nights and its reruns; each entry is small
# (gzip'd: a start-up prediction about 4 KB, check-binary's reports of vLLM's libraries about 80 KB).
KEEP = 32
SUFFIX = ".json.gz"


def read(folder: Path, key: str) -> Any | None:
    """The entry kept under ``key``, or None where there is none."""
    path = folder / f"{key}{SUFFIX}"
    try:
        data = json.loads(gzip.decompress(path.read_bytes()))
    except FileNotFoundError:
        return None  # never kept, or pruned by another run meanwhile
    except (OSError, EOFError, ValueError) as exc:
        log.warning(f"{path}: not a kept result ({type(exc).__name__}: {exc}); made again, and written over")
        return None
    os.utime(path)
    return data


def write(folder: Path, key: str, data: Any) -> Path:
    """Keep ``data`` under ``key``; the folder's oldest entries past ``KEEP`` are removed."""
    path = folder / f"{key}{SUFFIX}"
    fsutil.write_bytes(path, gzip.compress(json.dumps(data).encode(), mtime=0))
    entries = sorted(folder.glob(f"*{SUFFIX}"), key=_age)
    for old in entries[KEEP:]:
        old.unlink(missing_ok=True)
    return path


def _age(path: Path) -> float:
    """Newest first; an entry another run removed meanwhile counts as oldest."""
    try:
        return -path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")
