"""What a container's source stage copies to run ``python3 -m sparkbuild.patch``: derived, not listed.

Starting from ``sparkbuild.patch.__main__`` and every rule module (rules are imported by name at run
time, so no import statement names them), follow each ``import sparkbuild...`` / ``from sparkbuild...``
statement through sparkbuild's own modules, with the ``__init__.py`` of every package on the way.
Read with ``ast`` rather than by importing: the answer must not depend on what happens to be
imported already, and a module that is only listed here is never executed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sparkbuild.patch import rules

PACKAGE = __name__.partition(".")[0]  # sparkbuild's own top-level package
ROOT = Path(__file__).resolve().parents[__name__.count(".")]  # the folder that holds it
ENTRY = "sparkbuild.patch.__main__"


def modules() -> tuple[str, ...]:
    """Dotted names of every sparkbuild module the patch engine runs, sorted."""
    todo = [ENTRY, *(f"{rules.__name__}.{name.replace('-', '_')}" for name in rules.names())]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages on the way
        todo += _imports(name)
    return tuple(sorted(seen))


def files() -> tuple[tuple[str, bytes], ...]:
    """(path relative to the package root, content) of every module the engine runs."""
    return tuple((p.relative_to(ROOT).as_posix(), p.read_bytes()) for p in map(path_of, modules()))


def path_of(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imports(module: str) -> list[str]:
    """The sparkbuild modules ``module`` imports (``from sparkbuild import x`` counts when x is a module)."""
    tree = ast.parse(path_of(module).read_text(encoding="utf-8"))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == PACKAGE:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if _exists(f"{node.module}.{a.name}")]
    return found


def _exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.is_dir() or base.with_suffix(".py").is_file()
