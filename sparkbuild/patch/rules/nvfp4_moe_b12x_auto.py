"""nvfp4-moe-b12x-auto: vLLM's automatic NVFP4 MoE selection considers the B12X backend before Marlin.

vLLM's direct B12X FP4 MoE backend (PR #52018) serves NVFP4 MoE on SM120/SM121, but
``select_nvfp4_moe_backend`` walks an ``AVAILABLE_BACKENDS`` list that never names
``NvFp4MoeBackend.B12X``: only ``--moe-backend b12x`` reaches it, and with ``auto`` a DGX Spark
falls through to Marlin (vLLM issue #54666). The rule puts ``NvFp4MoeBackend.B12X`` into that list
immediately before ``NvFp4MoeBackend.MARLIN``, as the open upstream PRs #54669 and #54719 do, and
changes nothing else: B12X's own ``is_supported_config`` (the b12x package, capability family 120,
the quantization scheme, expert biases, the shape, the parallel config) stays the authority, so where it refuses,
the walk goes on to Marlin as before, and every backend ahead of Marlin keeps its place.

The list is found with Python's parser: the one ``AVAILABLE_BACKENDS = [...]`` literal of
``select_nvfp4_moe_backend``, whatever its members and line numbers. The inserted line carries the
marker as a trailing comment, so the status comes from the content: B12X ahead of Marlin with the
marker is ``applied``, without it ``upstream``; the marker anywhere without that change is a
conflict naming the file. Python only: one ``.py`` file, nothing compiled.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, judged, marker_without_change
from sparkbuild.patch.source import line_layout

NAME = "nvfp4-moe-b12x-auto"
MARKER = f"sparkbuild {NAME}"
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
READS = (ORACLE,)
# The only file the rule may change: a Python module, so a build with this patch needs no compile.
WRITES = (ORACLE,)
SELECTOR = "select_nvfp4_moe_backend"
LIST = "AVAILABLE_BACKENDS"
ENUM = "NvFp4MoeBackend"
B12X = "B12X"
MARLIN = "MARLIN"
COMMENT = f"# {MARKER}: B12X's own predicate decides, else Marlin"


def run(overlay: Overlay, folder: Path) -> Outcome:
    del folder  # no fragments: the change is one list entry
    if not overlay.exists(ORACLE):
        return Outcome("not-applicable", f"no {ORACLE} in this layout (no NVFP4 MoE oracle)")
    text = overlay.read(ORACLE)
    return judged(ORACLE, lambda: _judge(text))


def _judge(text: str) -> Outcome:
    """The status of the oracle's text, by its content (see the module's docstring)."""
    if B12X not in backend_members(text):
        return Outcome("not-applicable", f"{ORACLE}: {ENUM} has no {B12X} member (the b12x MoE backend, PR #52018)")
    order = selector_order(text)
    if has_change(order):
        if MARKER in text:
            return Outcome("applied", f"sparkbuild's {NAME} is in {ORACLE}: {B12X} before {MARLIN}", files=(ORACLE,))
        return Outcome("upstream", f"{ORACLE}: {SELECTOR} already walks {B12X} before {MARLIN}")
    if MARKER in text:
        return Outcome("conflict", marker_without_change(ORACLE, NAME, f"{LIST} has no {B12X} before {MARLIN}"))
    if B12X in [name for name, _ in order]:
        raise RuleConflict(f"{LIST} has {B12X} after {MARLIN}; upstream chose that order, update the rule")
    at = _line_of(order, MARLIN)
    after = insert(text, order)
    return Outcome(
        "applies",
        f"{ORACLE}: {ENUM}.{B12X} before {MARLIN} in {SELECTOR}'s {LIST} (line {at})",
        (Edit(ORACLE, text, after),),
    )


def needed(tree: Path, cuda: str, arch_list: str) -> tuple[bool, str]:
    """Needed where the build targets SM12x (an arch-list entry 12.x): B12X serves capability family
    120 alone, so elsewhere its predicate refuses and the list entry changes nothing. The CUDA
    version does not matter: the change is Python. Said with the line of the list that lacks B12X."""
    del cuda
    sm12x = [e for e in arch_list.replace(";", " ").split() if e.startswith("12.")]
    if not sm12x:
        return False, f"the arch list {arch_list} has no SM12x target, and B12X serves SM120/SM121 only"
    text = (tree / ORACLE).read_text(encoding="utf-8")
    where = f"{ORACLE}:{available_list(text).lineno}"
    if has_change(selector_order(text)):
        return True, f"{SELECTOR}() walks {LIST} ({where}) with {B12X} before {MARLIN}: this tree carries the change"
    return True, (
        f"{SELECTOR}() walks {LIST} ({where}) without {B12X}: on SM12x an NVFP4 MoE layer that no "
        f"CUTLASS backend takes (W4A16) runs on Marlin unless served with --moe-backend b12x (vLLM issue #54666)"
    )


def backend_members(text: str) -> list[str]:
    """The members of ``class NvFp4MoeBackend(Enum)``, in order."""
    module = ast.parse(text)
    classes = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == ENUM]
    if len(classes) != 1:
        raise RuleConflict(f"expected one class {ENUM}, found {len(classes)}; update the rule")
    return [t.id for n in classes[0].body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]


def available_list(text: str) -> ast.List:
    """The one ``AVAILABLE_BACKENDS = [...]`` literal of ``select_nvfp4_moe_backend``."""
    module = ast.parse(text)
    selectors = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == SELECTOR]
    if len(selectors) != 1:
        raise RuleConflict(f"expected one {SELECTOR}(), found {len(selectors)}; update the rule")
    literals = [
        n.value
        for n in ast.walk(selectors[0])
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == LIST for t in n.targets)
        and isinstance(n.value, ast.List)
    ]
    if len(literals) != 1:
        raise RuleConflict(f"expected one {LIST} = [...] in {SELECTOR}(), found {len(literals)}; update the rule")
    return literals[0]


def selector_order(text: str) -> list[tuple[str, int]]:
    """The backends ``select_nvfp4_moe_backend`` walks, in order, each with its line: the members
    of its ``AVAILABLE_BACKENDS = [...]`` literal (later statements only reorder Humming or filter)."""
    order = []
    for element in available_list(text).elts:
        if not (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and element.value.id == ENUM):
            raise RuleConflict(f"{LIST} holds {ast.unparse(element)!r}, not an {ENUM} member; update the rule")
        order.append((element.attr, element.lineno))
    if MARLIN not in [name for name, _ in order]:
        raise RuleConflict(f"{LIST} in {SELECTOR}() has no {ENUM}.{MARLIN} to put {B12X} before; update the rule")
    return order


def insert(text: str, order: list[tuple[str, int]]) -> str:
    """``text`` with ``NvFp4MoeBackend.B12X,`` on its own line just above ``NvFp4MoeBackend.MARLIN,``."""
    lines = text.splitlines(keepends=True)
    at = _line_of(order, MARLIN)
    marlin = lines[at - 1]
    if marlin.strip() != f"{ENUM}.{MARLIN},":
        raise RuleConflict(f"line {at} is {marlin.strip()!r}, not {ENUM}.{MARLIN}, on a line of its own; update the rule")
    indent, ending = line_layout(marlin)
    lines.insert(at - 1, f"{indent}{ENUM}.{B12X},  {COMMENT}{ending}")
    return "".join(lines)


def has_change(order: list[tuple[str, int]]) -> bool:
    """Whether B12X comes before MARLIN in the walk."""
    names = [name for name, _ in order]
    return B12X in names and names.index(B12X) < names.index(MARLIN)


def _line_of(order: list[tuple[str, int]], name: str) -> int:
    return next(line for member, line in order if member == name)
