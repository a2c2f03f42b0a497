"""mxfp4-moe-flashinfer-sm12x: vLLM's automatic MXFP4 MoE selection tries FlashInfer's CUTLASS
MXFP4 x MXFP8 kernel before Marlin on SM12x, for layers whose checkpoint declares no activation
format (gpt-oss).

``select_mxfp4_moe_backend`` walks ``AVAILABLE_BACKENDS = _filter_by_activation(...)``: a layer that
declares no activation format (gpt-oss's) is offered the BF16-activation backends only, and on
SM12x none of them ahead of Marlin takes MXFP4 weights (FlashInfer's CUTLASS W4A16 is SM90's, the
TRT-LLM ones SM10x's), so a DGX Spark serves gpt-oss's MoE on Marlin (vLLM issue #41477). FlashInfer's
CUTLASS fused MoE runs MXFP8 activations x MXFP4 weights on SM120/SM121 (FlashInfer 0.7.2.post1, the
release's pin), takes gpt-oss's expert biases and its swigluoai activation, and vLLM's own
``FlashInferExperts`` predicate accepts it there; only the activation filter keeps it out of the walk.

The rule adds one ``if`` right after that assignment: on capability family 120, for a layer with
no requested activation format, ``FLASHINFER_CUTLASS_MXFP4_MXFP8`` goes into the list just before
``MARLIN``. Nothing else changes: the backend's own ``is_supported_config`` stays the authority
(FlashInfer installed, the capability, the scheme, the activation, the parallel config), so where
it refuses, the walk goes on to Marlin as before, and a checkpoint that declares its activations
is untouched. The statement is found with Python's parser; the ``if`` carries the marker as a
comment, so the status comes from the content. Python only: one ``.py`` file, nothing compiled.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, judged, marker_without_change
from sparkbuild.patch.rules import _mxfp4_oracle as mxfp4
from sparkbuild.patch.source import line_layout

NAME = "mxfp4-moe-flashinfer-sm12x"
MARKER = f"sparkbuild {NAME}"
ORACLE = mxfp4.ORACLE
READS = (ORACLE,)
# The only file the rule may change: a Python module, so a build with this patch needs no compile.
WRITES = (ORACLE,)
SELECTOR = mxfp4.SELECTOR
LIST = mxfp4.LIST
FILTER = mxfp4.FILTER
ENUM = "Mxfp4MoeBackend"
BACKEND = "FLASHINFER_CUTLASS_MXFP4_MXFP8"
MARLIN = "MARLIN"
REQUESTED = "requested_activation_key"
INSERT = f"{LIST}.insert({LIST}.index({ENUM}.{MARLIN}), {ENUM}.{BACKEND})"
BLOCK = (
    f"if (  # {MARKER}: gpt-oss's MoE on FlashInfer's CUTLASS MXFP4 x MXFP8, else Marlin\n"
    f"    {REQUESTED} is None\n"
    "    and current_platform.is_cuda()\n"
    "    and current_platform.is_device_capability_family(120)\n"
    f"    and {ENUM}.{MARLIN} in {LIST}\n"
    f"    and {ENUM}.{BACKEND} not in {LIST}\n"
    "):\n"
    f"    {LIST}.insert(\n"
    f"        {LIST}.index({ENUM}.{MARLIN}),\n"
    f"        {ENUM}.{BACKEND},\n"
    "    )\n"
)


def run(overlay: Overlay, folder: Path) -> Outcome:
    del folder  # no fragments: the change is one statement
    if not overlay.exists(ORACLE):
        return Outcome("not-applicable", f"no {ORACLE} in this layout (no MXFP4 MoE oracle)")
    text = overlay.read(ORACLE)
    return judged(ORACLE, lambda: _judge(text))


def _judge(text: str) -> Outcome:
    """The status of the oracle's text, by its content (see the module's docstring)."""
    members = backend_members(text)
    if BACKEND not in members or MARLIN not in members:
        return Outcome("not-applicable", f"{ORACLE}: {ENUM} has no {BACKEND} or no {MARLIN}")
    selector = selector_function(text)
    if has_change(selector):
        if MARKER in text:
            return Outcome("applied", f"sparkbuild's {NAME} is in {ORACLE}: {BACKEND} before {MARLIN} on SM12x", files=(ORACLE,))
        return Outcome("upstream", f"{ORACLE}: {SELECTOR} already puts {BACKEND} before {MARLIN} itself")
    if MARKER in text:
        return Outcome("conflict", marker_without_change(ORACLE, NAME, f"no {INSERT} in {SELECTOR}()"))
    at = filtered_list(selector)
    after = insert(text, at)
    return Outcome(
        "applies",
        f"{ORACLE}: {ENUM}.{BACKEND} before {MARLIN} on SM12x after {SELECTOR}'s {LIST} (line {at.lineno})",
        (Edit(ORACLE, text, after),),
    )


def needed(tree: Path, cuda: str, arch_list: str) -> tuple[bool, str]:
    """Needed where the build targets SM12x (an arch-list entry 12.x): the change is for capability
    family 120 alone. The CUDA version does not matter: the change is Python."""
    del cuda
    if not [e for e in arch_list.replace(";", " ").split() if e.startswith("12.")]:
        return False, f"the arch list {arch_list} has no SM12x target, and the change is for SM120/SM121 only"
    text = (tree / ORACLE).read_text(encoding="utf-8")
    selector = selector_function(text)
    where = f"{ORACLE}:{filtered_list(selector).lineno}"
    if has_change(selector):
        return True, f"{SELECTOR}() puts {BACKEND} before {MARLIN} on SM12x ({where}): this tree carries the change"
    return True, (
        f"{SELECTOR}() offers a layer that declares no activation format (gpt-oss) the BF16-activation "
        f"backends only ({FILTER}, {where}); on SM12x none ahead of {MARLIN} takes MXFP4 weights, so gpt-oss's "
        "MoE runs on Marlin (vLLM issue #41477)"
    )


def backend_members(text: str) -> list[str]:
    """The members of ``class Mxfp4MoeBackend(Enum)``, in order."""
    classes = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == ENUM]
    if len(classes) != 1:
        raise RuleConflict(f"expected one class {ENUM}, found {len(classes)}; update the rule")
    return [t.id for n in classes[0].body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]


def selector_function(text: str) -> ast.FunctionDef:
    found = mxfp4.selectors(text)
    if len(found) != 1:
        raise RuleConflict(f"expected one {SELECTOR}(), found {len(found)}; update the rule")
    return found[0]


def filtered_list(selector: ast.FunctionDef) -> ast.Assign:
    """The one ``AVAILABLE_BACKENDS = _filter_by_activation(...)`` statement of the selector's
    automatic path, a statement of the function's own body (so an ``if`` can follow it)."""
    found = mxfp4.filtered_walks(selector)
    if len(found) != 1:
        raise RuleConflict(f"expected one {LIST} = {FILTER}(...) in {SELECTOR}(), found {len(found)}; update the rule")
    names = {n.id for n in ast.walk(selector) if isinstance(n, ast.Name)}
    if REQUESTED not in names:
        raise RuleConflict(f"{SELECTOR}() has no {REQUESTED}; update the rule")
    return found[0]


def has_change(selector: ast.FunctionDef) -> bool:
    """Whether the selector inserts FLASHINFER_CUTLASS_MXFP4_MXFP8 before MARLIN itself."""
    return any(isinstance(n, ast.Call) and ast.unparse(n) == INSERT for n in ast.walk(selector))


def insert(text: str, statement: ast.Assign) -> str:
    """``text`` with the rule's ``if`` on the lines right after ``statement``, at its indent."""
    assert statement.end_lineno is not None
    lines = text.splitlines(keepends=True)
    first = lines[statement.lineno - 1]
    indent, ending = line_layout(first)
    block = [f"{indent}{line}{ending}" for line in BLOCK.splitlines()]
    lines[statement.end_lineno : statement.end_lineno] = block
    return "".join(lines)
