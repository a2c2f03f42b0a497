"""The package is a stack of sub-packages: no module imports one above it, and the imports form no
cycle, counting the imports inside functions and under ``TYPE_CHECKING``: a module's dependencies
are what it names, wherever it names them."""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import sparkbuild
from sparkbuild import cli
from sparkbuild.models import moe
from sparkbuild.models.moe import trained
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from sparkbuild.publish import wheels

PACKAGE = sparkbuild.__name__
ROOT = Path(sparkbuild.__file__).resolve().parent


def inner(module: ModuleType) -> str:
    """A module's name inside the package (``plan``), as the graph names it."""
    return module.__name__.removeprefix(f"{PACKAGE}.")


# No cycle is known; one that appears fails the test with its modules.
KNOWN_CYCLES: set[frozenset[str]] = set()


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to it (``plan``, ``patch.engine``; the
    package itself is ``""``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that ``name`` imports, anywhere in it (module level, functions,
    ``TYPE_CHECKING`` blocks); ``from P import x`` counts x where x is a module, else P."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([PACKAGE, *here[: len(here) - node.level + 1], *([base] if base else [])])
            targets = [f"{base}.{a.name}" if _inner(f"{base}.{a.name}") in known else base for a in node.names]
        else:
            continue
        for target in targets:
            inner = _inner(target)
            while inner is not None and inner and inner not in known:
                inner = inner.rpartition(".")[0]
            if inner and inner != name:
                yield inner


def _inner(dotted: str) -> str | None:
    """``sparkbuild.plan.plan`` -> ``plan``; None for a module outside the package."""
    if dotted == PACKAGE:
        return ""
    return dotted[len(PACKAGE) + 1 :] if dotted.startswith(f"{PACKAGE}.") else None


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_graph_sees_imports_inside_functions_and_type_checking() -> None:
    edges = graph()
    assert inner(plan) in edges[inner(cli)]  # cli imports plan inside its commands only
    assert inner(trained) in edges[inner(moe)]  # moe.make imports each format's module when it makes one
    assert Engine.__module__.removeprefix(f"{PACKAGE}.") in edges[inner(wheels)]  # under TYPE_CHECKING


def test_no_import_cycle() -> None:
    assert set(cycles(graph())) == KNOWN_CYCLES


# --- the stack: no module imports one above it ---------------------------------------------------------

# Bottom to top; "" is the package's own __init__. A module's layer is its first part: a top-level
# module's own name, or its sub-package's. A new sub-package or top-level module must be placed here.
STACK = (
    "",
    "errors",
    "util",
    "resources",
    "image",
    "config",
    "upstream",
    "oci",
    "patch",
    "models",
    "plan",
    "build",
    "verify",
    "publish",
    "report",
    "lanes",
    "cli",
    "__main__",
)
MAX_TOP_LEVEL_MODULES = 12


def layer(module: str) -> int:
    return STACK.index(module.split(".")[0])


def test_every_module_has_a_place_in_the_stack() -> None:
    assert [m for m in graph() if m.split(".")[0] not in STACK] == []


def test_no_module_imports_one_above_it() -> None:
    upward = [f"{a} imports {b}" for a, targets in graph().items() for b in sorted(targets) if layer(b) > layer(a)]
    assert upward == [], "move the shared piece down, or the module up"


def test_every_test_folder_is_collected() -> None:
    """pytest skips a folder named like one of norecursedirs (by default build and dist): none of the
    test folders that mirror the package may be."""
    skipped = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["norecursedirs"]
    folders = [p.name for p in (ROOT.parent / "tests").iterdir() if p.is_dir()]
    assert [f for f in folders if any(fnmatch.fnmatch(f, pattern) for pattern in skipped)] == []


def test_the_top_level_stays_small() -> None:
    top = [p for p in ROOT.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(p.name for p in top)
