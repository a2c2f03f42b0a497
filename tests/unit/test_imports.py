"""The package's imports form no cycle, counting the imports inside functions and under
``TYPE_CHECKING``: a module's dependencies are what it names, wherever it names them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import builder
from builder import cli, moe, plan, wheels
from builder.engine import Engine
from builder.moe import trained

PACKAGE = builder.__name__
ROOT = Path(builder.__file__).resolve().parent


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
    """``builder.plan`` -> ``plan``; None for a module outside the package."""
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
