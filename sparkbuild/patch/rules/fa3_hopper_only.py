"""fa3-hopper-only: vLLM's setup.py builds flash-attention's FA3 only where the arch list has a 9.x target.

``setup.py`` adds the ``_vllm_fa3_C`` extension whenever nvcc is 12.3 or newer, and builds every
extension it lists (``cmake --build --target ...``). flash-attention's CMake file defines that
target even when its arch intersection (``"9.0a"`` with the build's list) is empty: then its
units (about 190 of them in vllm-project/flash-attention) get no ``-gencode`` for any GPU of the
list and are compiled anyway, tens of minutes to hours of nvcc on a cold Spark build, for a library
no GPU of the list can load. vLLM imports without it (``vllm_flash_attn/flash_attn_interface.py``
catches the ImportError and reports FA3 unavailable; an SM12x GPU runs FA2).

The rule puts that one ``ext_modules.append(...)`` statement under an ``if`` on the arch list the
build asks for (``TORCH_CUDA_ARCH_LIST``, which vLLM's CMake reads too): an entry starting with
``9.`` keeps it, an unset list keeps it (torch then picks the visible GPU's arch, which may be
Hopper). The statement is found with Python's parser, in every form the releases write it. The
``if`` line carries the marker: the status comes from the content (the statement under an ``if``
that reads the arch list: ``applied`` with the marker, ``upstream`` without; the marker without
that ``if`` is a conflict). Only ``setup.py`` changes: a build from upstream's wheel (already
compiled) cannot take it, so a target lists it where vLLM is compiled.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, judged, marker_without_change
from sparkbuild.patch.source import line_layout

NAME = "fa3-hopper-only"
MARKER = f"sparkbuild {NAME}"
SETUP = "setup.py"
READS = (SETUP,)
WRITES = (SETUP,)
EXTENSION = "vllm.vllm_flash_attn._vllm_fa3_C"
ARCH_VARIABLE = "TORCH_CUDA_ARCH_LIST"
# The arch list as the build gives it ("9.0a;12.1a", "9.0 12.1a", "12.1a"); unset: the GPU decides.
CONDITION = f'any(a.startswith("9.") for a in os.environ.get("{ARCH_VARIABLE}", "9.0").replace(";", " ").split())'
COMMENT = f"# {MARKER}: FA3's kernels are sm_90a only; for an arch list without 9.x they compile for no GPU"
# setup.py adds the extension from this nvcc on (its comment: "FA3 requires CUDA 12.3 or later").
FROM_CUDA = (12, 3)


def run(overlay: Overlay, folder: Path) -> Outcome:
    del folder  # no fragments: the change is one `if` around one statement
    if not overlay.exists(SETUP):
        return Outcome("not-applicable", f"no {SETUP} in this layout")
    text = overlay.read(SETUP)
    return judged(SETUP, lambda: _judge(text))


def _judge(text: str) -> Outcome:
    module = ast.parse(text)
    found = fa3_statement(module)
    if found is None:
        return Outcome("not-applicable", f"{SETUP} adds no {EXTENSION} extension (no FA3 to build)")
    statement, guards = found
    if any(ARCH_VARIABLE in ast.unparse(g.test) for g in guards):
        if MARKER in text:
            return Outcome("applied", f"sparkbuild's {NAME} is in {SETUP}: {EXTENSION} only for a 9.x arch", files=(SETUP,))
        return Outcome("upstream", f"{SETUP}: {EXTENSION} is already built only for the arch list's {ARCH_VARIABLE}")
    if MARKER in text:
        return Outcome("conflict", marker_without_change(SETUP, NAME, f"no `if` on {ARCH_VARIABLE} around {EXTENSION}"))
    if not any(isinstance(n, ast.Import) and any(a.name == "os" for a in n.names) for n in module.body):
        raise RuleConflict("does not `import os` at its top, which the rule's condition reads; update the rule")
    return Outcome(
        "applies",
        f"{SETUP}: {EXTENSION} (line {statement.lineno}) built only where {ARCH_VARIABLE} has a 9.x target",
        (Edit(SETUP, text, guard(text, statement)),),
    )


def fa3_statement(module: ast.Module) -> tuple[ast.stmt, list[ast.If]] | None:
    """The one ``ext_modules.append(CMakeExtension(name=EXTENSION))`` statement, and the ``if``
    statements it stands in (outermost first)."""
    found: list[tuple[ast.stmt, list[ast.If]]] = []

    def visit(body: list[ast.stmt], guards: list[ast.If]) -> None:
        for node in body:
            if _is_fa3_append(node):
                found.append((node, guards))
            if isinstance(node, ast.If):
                visit(node.body, [*guards, node])
                visit(node.orelse, guards)

    visit(module.body, [])
    if len(found) > 1:
        raise RuleConflict(f"adds {EXTENSION} in {len(found)} places; update the rule")
    return found[0] if found else None


def _is_fa3_append(node: ast.stmt) -> bool:
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "append" and len(call.args) == 1):
        return False
    if not (isinstance(call.func.value, ast.Name) and call.func.value.id == "ext_modules"):
        return False
    ext = call.args[0]
    return isinstance(ext, ast.Call) and any(
        k.arg == "name" and isinstance(k.value, ast.Constant) and k.value.value == EXTENSION for k in ext.keywords
    )


def guard(text: str, statement: ast.stmt) -> str:
    """``text`` with ``statement`` (all its lines) indented under ``if CONDITION:``, marker above."""
    assert statement.end_lineno is not None
    lines = text.splitlines(keepends=True)
    first = lines[statement.lineno - 1]
    indent, ending = line_layout(first)
    body = [("    " + line if line.strip() else line) for line in lines[statement.lineno - 1 : statement.end_lineno]]
    head = [f"{indent}{COMMENT}{ending}", f"{indent}if {CONDITION}:{ending}"]
    return "".join(lines[: statement.lineno - 1] + head + body + lines[statement.end_lineno :])


def needed(tree: Path, cuda: str, arch_list: str) -> tuple[bool, str]:
    """Needed where vLLM is compiled for an arch list with no 9.x target by an nvcc that setup.py
    builds FA3 with (12.3 on): then every FA3 unit compiles with no code for any GPU of the list."""
    nines = [e for e in arch_list.replace(";", " ").split() if e.startswith("9.")]
    if nines:
        return False, f"the arch list {arch_list} has {', '.join(nines)}: FA3's sm_90a kernels run there"
    if tuple(int(p) for p in cuda.split(".")[:2]) < FROM_CUDA:
        return False, f"setup.py builds FA3 with nvcc 12.3 or newer only; the build's CUDA is {cuda}"
    found = fa3_statement(ast.parse((tree / SETUP).read_text(encoding="utf-8")))
    if found is None:
        return False, f"{SETUP} adds no {EXTENSION} extension"
    statement, _ = found
    return True, (
        f"{SETUP}:{statement.lineno} builds {EXTENSION} with nvcc >= 12.3 for any arch list; flash-attention's FA3 "
        f"units are for 9.0a only, so for {arch_list} each compiles with no code for any GPU of the list "
        "(about 190 units of nvcc, when vLLM is compiled from source)"
    )
