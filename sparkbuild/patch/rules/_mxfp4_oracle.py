"""vLLM's MXFP4 MoE oracle as the MXFP4 rules read it (a helper, not a rule: its name starts with ``_``).

From 0.22.0, ``select_mxfp4_moe_backend``'s automatic walk starts from one statement of its own body,
``AVAILABLE_BACKENDS = _filter_by_activation(...)``, which offers a layer that declares no activation
format (gpt-oss's) the BF16-activation backends only. ``mxfp4-moe-flashinfer-sm12x`` adds its change
right after that statement; ``mxfp4-cutlass-sm12x``'s verdict (need) follows from it.
"""

from __future__ import annotations

import ast

ORACLE = "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py"
SELECTOR = "select_mxfp4_moe_backend"
LIST = "AVAILABLE_BACKENDS"
FILTER = "_filter_by_activation"


def selectors(text: str) -> list[ast.FunctionDef]:
    """Every top-level ``def select_mxfp4_moe_backend`` of the oracle's text (one, in a known layout)."""
    return [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == SELECTOR]


def filtered_walks(selector: ast.FunctionDef) -> list[ast.Assign]:
    """The ``AVAILABLE_BACKENDS = _filter_by_activation(...)`` statements of the selector's own body."""
    return [
        n
        for n in selector.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == LIST for t in n.targets)
        and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Name)
        and n.value.func.id == FILTER
    ]
