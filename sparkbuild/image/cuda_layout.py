"""Lay NVIDIA's pip-installed CUDA wheels out as a toolkit where CMake, nvcc and JIT compilers look.

pip installs CUDA 13 components into one ``nvidia/cu13/`` folder and CUDA 12 components into one
folder each (``nvidia/cuda_nvcc/``, ``nvidia/cuda_runtime/``, ...), every one with ``bin``,
``include``, ``lib`` and ``nvvm`` below it. A toolkit is those merged into one tree, with ``lib64``
beside ``lib`` and ``libX.so`` beside ``libX.so.N``. Two components that ship one path with
different content are an error, never a silent overwrite.

Used for the ``cuda_wheels`` base images (copies, on the host) and in the runtime image for the
compilers FlashInfer and DeepGEMM run at serve time (symlinks into the virtual environment).
Standard library only: the runtime stage runs ``python3 -m builder.cuda_layout NVIDIA DEST``.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
from pathlib import Path

# The README's exit codes (this script runs in the image, without builder.errors).
USAGE, BUILD = 2, 5
# Python package files of the wheels, not part of a toolkit.
_SKIP = ("__init__.py", "__pycache__")


class LayoutError(Exception):
    """Two components ship the same path with different content."""


def lay_out(nvidia: Path, dest: Path, *, copy: bool) -> int:
    """Merge every ``nvidia/<package>/<part>/...`` under ``dest``; returns the number of files.

    ``copy`` writes the files (a base image); otherwise ``dest`` holds symlinks to them.
    """
    count = 0
    for package in sorted(p for p in nvidia.iterdir() if p.is_dir() and p.name not in _SKIP and not p.name.startswith(".")):
        for path in sorted(package.rglob("*")):
            relative = path.relative_to(package)
            if path.is_dir() or relative.parts[0].startswith(".") or any(part in _SKIP for part in relative.parts):
                continue
            count += _place(path, dest / relative, copy=copy)
    _link_libraries(dest)
    return count


def _place(source: Path, target: Path, *, copy: bool) -> int:
    if target.exists() or target.is_symlink():
        if filecmp.cmp(source, target, shallow=False):
            return 0
        raise LayoutError(f"{source} and {target.resolve()} are the same toolkit path with different content")
    target.parent.mkdir(parents=True, exist_ok=True)
    if copy:
        shutil.copy2(source, target)
    else:
        target.symlink_to(source)
    return 1


def _link_libraries(toolkit: Path) -> None:
    """``lib64`` beside ``lib`` and ``libX.so`` beside ``libX.so.N``, where CMake and linkers look."""
    lib = toolkit / "lib"
    if lib.is_dir() and not (toolkit / "lib64").exists():
        (toolkit / "lib64").symlink_to("lib")
    for versioned in sorted(lib.glob("*.so.*")) if lib.is_dir() else []:
        plain = lib / (versioned.name.split(".so.")[0] + ".so")
        if not plain.exists() and not plain.is_symlink():
            plain.symlink_to(versioned.name)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python3 cuda_layout.py NVIDIA_DIR DEST", file=sys.stderr)
        return USAGE
    nvidia, dest = Path(args[0]), Path(args[1])
    if not nvidia.is_dir():
        print(f"error: {nvidia}: no such folder; pip installs CUDA wheels under site-packages/nvidia", file=sys.stderr)
        return USAGE
    try:
        count = lay_out(nvidia, dest, copy=False)
    except LayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BUILD
    print(f"{dest}: {count} files of {nvidia} laid out as a CUDA toolkit ({os.fspath(dest / 'bin')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
