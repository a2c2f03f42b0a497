"""Configuration in one place: every environment variable the code reads is declared in
``options.VARIABLES`` (or ``READ_FROM_OTHERS``), read through ``options.env`` outside the modules that
may not import options, and listed in docs/configuration.md; held to each other as the exit-code
table is."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import sparkbuild
from sparkbuild.config import options
from sparkbuild.patch import bundle
from sparkbuild.plan.plan import IMAGE_SCRIPTS
from sparkbuild.util import log
from tests.support import ROOT

PACKAGE = Path(sparkbuild.__file__).resolve().parent
DOC = ROOT / "docs" / "configuration.md"
DECLARED = {**options.VARIABLES, **options.READ_FROM_OTHERS}
# Modules that read os.environ themselves: options; log, which options stands on; and the code that
# runs inside images (the patch engine's modules, the image scripts), which has no options to ask.
OWN_READERS = {
    Path(options.__file__).resolve(),
    Path(log.__file__).resolve(),
    *(bundle.path_of(name).resolve() for name in bundle.modules()),
    *(Path(str(module.__file__)).resolve() for module in IMAGE_SCRIPTS.values()),
}


def reads(tree: ast.AST) -> Iterator[tuple[int, str, bool]]:
    """(line, variable, direct) of each read of a named variable: ``os.environ.get(NAME)``,
    ``os.environ[NAME]``, ``os.getenv(NAME)`` (direct), ``env(NAME)``, ``options.env(NAME)``,
    ``env.get(NAME)`` and ``env[NAME]`` on a mapping passed in (through options)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            target, key, line = ast.unparse(node.func), node.args[0], node.lineno
        elif isinstance(node, ast.Subscript):
            target, key, line = ast.unparse(node.value), node.slice, node.lineno
        else:
            continue
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        if re.fullmatch(r"os\.environ(\.get)?|os\.getenv", target):
            yield line, key.value, True
        elif re.fullmatch(r"(options\.)?env|env\.get", target):
            yield line, key.value, False


def package_reads() -> list[tuple[Path, int, str, bool]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, name, direct in reads(ast.parse(path.read_text(encoding="utf-8"))):
            found.append((path.resolve(), line, name, direct))
    return found


def test_every_variable_read_is_declared() -> None:
    undeclared = [f"{p.relative_to(ROOT)}:{line}: {name}" for p, line, name, _ in package_reads() if name not in DECLARED]
    assert undeclared == [], "declare each in sparkbuild/config/options.py VARIABLES (with its meaning) and docs/configuration.md"


def test_every_declared_variable_is_read() -> None:
    read = {name for *_, name, _ in package_reads()}
    assert set(DECLARED) - read == set()


def test_reads_go_through_options_outside_the_modules_that_cannot_ask_it() -> None:
    direct = [f"{p.relative_to(ROOT)}:{line}: {name}" for p, line, name, d in package_reads() if d and p not in OWN_READERS]
    assert direct == [], "read it with options.env(NAME)"


def test_env_refuses_a_name_not_declared() -> None:
    with pytest.raises(KeyError, match="not declared"):
        options.env("SPARKBUILD_NOT_A_VARIABLE")


def documented(heading: str) -> list[str]:
    """The variables in the first column of the table under ``heading`` in docs/configuration.md."""
    section = DOC.read_text(encoding="utf-8").split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([A-Z0-9_]+)` \|", section, re.MULTILINE)]


def test_the_docs_list_exactly_the_declared_variables() -> None:
    assert documented("Options from the environment") == list(options.VARIABLES)
    assert documented("Read from others") == list(options.READ_FROM_OTHERS)
