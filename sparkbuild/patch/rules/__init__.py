"""The rules: one module per rule, named after it (``cmake-arch-sm121`` is ``cmake_arch_sm121.py``).

A rule module has ``NAME``, ``READS`` (globs of the tree files it reads, relative to the tree),
``WRITES`` (globs of the files it may change: what a plan knows of the rule without a tree, and
what the engine holds each of its edits to) and ``run(overlay, folder) -> Outcome``; its upstream
fragments live in the patch's folder. It may have ``needed(tree, cuda, arch_list) -> (bool, why)``:
whether a build needs the change where it applies (the support table's NEEDED column,
``sparkbuild.patch.need``; run on the host only). A new rule is a new module here: nothing else
lists them, and only the rules a patch set names are imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.patch.overlay import Rule

# (release tree, CUDA version, arch list) -> (needed, why).
Needed = Callable[[Path, str, str], tuple[bool, str]]


@dataclass(frozen=True)
class RuleModule:
    name: str
    run: Rule
    reads: tuple[str, ...]
    writes: tuple[str, ...] = ()
    needed: Needed | None = None


def names() -> tuple[str, ...]:
    """Every rule there is, without importing one."""
    return tuple(sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def load(name: str) -> RuleModule:
    module = importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
    return RuleModule(
        name=module.NAME,
        run=module.run,
        reads=tuple(module.READS),
        writes=tuple(module.WRITES),
        needed=getattr(module, "needed", None),
    )


def source(name: str) -> bytes:
    """The bytes of a rule's module, read without importing it."""
    spec = importlib.util.find_spec(f"{__name__}.{name.replace('-', '_')}")
    assert spec is not None and spec.origin is not None, name
    return Path(spec.origin).read_bytes()
