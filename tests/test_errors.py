"""One exit-code table: every failure has its own code in ``errors.EXIT_CODES``, and the documentation's
table of exit codes (docs/commands.md, which the README's summary links to) says the same."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import sparkbuild
from sparkbuild import errors
from tests.support import ROOT, cli


def documented_table() -> dict[int, str]:
    text = (ROOT / "docs" / "commands.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n#", 1)[0]
    return {int(m[1]): m[2].strip() for m in re.finditer(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE)}


def test_the_documented_table_is_the_one_in_errors() -> None:
    assert documented_table() == errors.EXIT_CODES


def test_the_readme_links_to_the_table() -> None:
    assert "(docs/commands.md#exit-codes)" in (ROOT / "README.md").read_text()


def test_every_failure_class_has_its_own_code_in_the_table() -> None:
    for module in pkgutil.walk_packages(sparkbuild.__path__, prefix=f"{sparkbuild.__name__}."):
        if module.name.endswith(".__main__") or ".resources" in module.name:
            continue  # entry points run when imported; resources are data and scripts for images
        importlib.import_module(module.name)
    found = set()
    todo = list(errors.FatalError.__subclasses__())
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    assert found == set(errors.ERRORS)
    codes = [e.exit_code for e in errors.ERRORS]
    assert len(codes) == len(set(codes))
    assert 1 not in errors.EXIT_CODES  # no bare exit 1: each failure says which it is
    assert {errors.OK, errors.INTERNAL, errors.INTERRUPTED} <= set(errors.EXIT_CODES)


def test_nothing_raises_the_base_class_or_exits_with_a_number_of_its_own() -> None:
    for path in sorted(Path(sparkbuild.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                assert node.exc.func.id != "FatalError", f"{path.name}:{node.lineno} raises the base class"
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.exit" and node.args:
                assert not isinstance(node.args[0], ast.Constant), f"{path.name}:{node.lineno}: sys.exit with a literal"


def test_a_usage_mistake_is_exit_2_like_any_invalid_input() -> None:
    result = cli.run("plan", "--no-such-option", env={})
    assert result.returncode == 2
    assert "No such option" in result.stderr and "Traceback" not in result.stderr
