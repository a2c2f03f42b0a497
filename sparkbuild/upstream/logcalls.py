"""The log statements of Python sources, read without importing or running them: each
``logger.<level>(...)`` call's message as literal text and holes (the values it formats in), with
its file and line.

What holds ``kernel-paths.yaml`` to vLLM's own source (tests/upstream/test_kernel_logs.py): the
patterns must match what a release can log. The standard library's ``ast`` reads the message forms
vLLM uses: a string, an f-string, ``%``-style arguments (as ``logging`` formats them), ``+``
concatenation, a conditional expression, and a call of a function of the same module that returns
one of those (``logger.info_once(_make_log_backend(backend))``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# The logger methods vLLM calls (its logger adds the *_once variants).
LEVELS = frozenset({"debug", "info", "warning", "warn", "error", "debug_once", "info_once", "warning_once", "error_once"})
# What stands in for a hole where no value is given: a word, as backend names are.
SENTINEL = "HOLE"
# A %-directive as logging's %-formatting reads it; "%%" is a literal percent sign.
_DIRECTIVE = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?([diouxXeEfFgGcrsa%])")
# Helpers are followed this deep (a helper that calls a helper).
_DEPTH = 3


@dataclass(frozen=True)
class Hole:
    """A value the message formats in: its expression as written (``backend.value``)."""

    expression: str
    quoted: bool = False  # %r or !r: the value's repr, in quotes for a string


Part = str | Hole
# The functions of a module by name: where a message built by a helper is read.
Helpers = dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]


@dataclass(frozen=True)
class Statement:
    file: str  # relative to the tree's root
    line: int
    level: str
    parts: tuple[Part, ...]

    @property
    def holes(self) -> tuple[Hole, ...]:
        return tuple(p for p in self.parts if isinstance(p, Hole))

    def text(self, *values: str, default: str = SENTINEL) -> str:
        """The message with its holes filled in order by ``values`` (the rest by ``default``), as
        the log would show it."""
        filled = iter(values)
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value = next(filled, default)
            out.append(repr(value) if part.quoted else value)
        return "".join(out)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.level}: {self.text(default='{}')!r}"


def statements(path: Path, root: Path) -> list[Statement]:
    """Every log statement of one Python file whose message can be read (a message held in a
    variable or built by another module is skipped: vLLM's backend choices are not)."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
    helpers: Helpers = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            helpers.setdefault(node.name, []).append(node)
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(tree):
        level = _log_level(node)
        if level is None:
            continue
        assert isinstance(node, ast.Call)  # _log_level says so
        formatted = len(node.args) > 1  # logging %-formats only when it has arguments
        for parts in _message(node.args[0], helpers, _DEPTH):
            found.append(Statement(rel, node.lineno, level, _percent(parts, node.args[1:]) if formatted else _merge(parts)))
    return sorted(found, key=lambda s: (s.line, repr(s.parts)))


def tree_statements(root: Path, files: Sequence[Path]) -> list[Statement]:
    """The statements of ``files`` (under ``root``), in file order."""
    return [s for path in sorted(files) for s in statements(path, root)]


def _log_level(node: ast.AST) -> str | None:
    """``logger.info_once(...)``, ``_logger.debug(...)``, ``self.logger.warning(...)``: the level."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.func, ast.Attribute):
        return None
    if node.func.attr not in LEVELS:
        return None
    owner = node.func.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return node.func.attr if "log" in name.lower() else None


def _message(node: ast.expr, helpers: Helpers, depth: int, bound: dict[str, str] | None = None) -> Iterator[list[Part]]:
    """Each text ``node`` can evaluate to, as parts; nothing where it cannot be read. ``bound``:
    a helper's parameters that its caller passed as literal text."""
    bound = bound or {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield [node.value]
    elif isinstance(node, ast.JoinedStr):
        yield [_fstring_part(v, bound) for v in node.values]
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        rights = list(_message(node.right, helpers, depth, bound))
        for left in _message(node.left, helpers, depth, bound):
            yield from ([*left, *right] for right in rights)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        args = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        yield from (list(_percent(parts, args)) for parts in _message(node.left, helpers, depth, bound))
    elif isinstance(node, ast.IfExp):
        yield from _message(node.body, helpers, depth, bound)
        yield from _message(node.orelse, helpers, depth, bound)
    elif isinstance(node, ast.Call) and depth > 0:
        yield from _helper(node, helpers, depth)


def _fstring_part(value: ast.expr, bound: dict[str, str]) -> Part:
    if isinstance(value, ast.Constant):
        return str(value.value)
    assert isinstance(value, ast.FormattedValue)
    inner = value.value
    if isinstance(inner, ast.Name) and inner.id in bound and value.conversion == -1:
        return bound[inner.id]
    return Hole(ast.unparse(inner), quoted=value.conversion == ord("r"))


def _helper(node: ast.Call, helpers: Helpers, depth: int) -> Iterator[list[Part]]:
    """What a function of the same module returns: ``_make_log_backend(backend)``, ``self._msg()``;
    a parameter its caller passes as a literal (``_make_log_backend("Marlin")``) is that text."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    for definition in helpers.get(name, []):
        params = [a.arg for a in definition.args.args if a.arg not in ("self", "cls")]
        passed = {**dict(zip(params, node.args, strict=False)), **{k.arg: k.value for k in node.keywords if k.arg}}
        bound = {p: v.value for p, v in passed.items() if isinstance(v, ast.Constant) and isinstance(v.value, str)}
        for inner in ast.walk(definition):
            if isinstance(inner, ast.Return) and inner.value is not None:
                yield from _message(inner.value, helpers, depth - 1, bound)


def _percent(parts: Sequence[Part], args: Sequence[ast.expr]) -> tuple[Part, ...]:
    """Literal text with %-directives as logging formats it: each directive a hole for its argument."""
    values = iter(args)
    out: list[Part] = []
    for part in parts:
        if isinstance(part, Hole):
            out.append(part)
            continue
        at = 0
        for match in _DIRECTIVE.finditer(part):
            out.append(part[at : match.start()])
            if match.group(1) == "%":
                out.append("%")
            else:
                arg = next(values, None)
                out.append(Hole("?" if arg is None else ast.unparse(arg), quoted=match.group(1) == "r"))
            at = match.end()
        out.append(part[at:])
    return _merge(out)


def _merge(parts: Sequence[Part]) -> tuple[Part, ...]:
    """Adjacent literal texts joined, empty ones dropped."""
    out: list[Part] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part != "":
            out.append(part)
    return tuple(out)
