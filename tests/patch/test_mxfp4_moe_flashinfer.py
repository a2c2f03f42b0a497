"""mxfp4-moe-flashinfer-sm12x on the release it applies to: FlashInfer's CUTLASS MXFP4 x MXFP8 before
Marlin in the walk vLLM's MXFP4 oracle makes for gpt-oss's layers on SM12x.

The change is evaluated, not matched as text: the release's own ``Mxfp4MoeBackend`` class and
``_filter_by_activation`` are executed on the release's own priority list for gpt-oss (the SM12x
branch of ``_get_priority_backends_for_gpt_oss``), then the statement the rule adds, with vLLM's
platform faked (a GB10, an H100). Then the status by content: applied, upstream, a marker without its
change, a layout the rule does not know. vLLM's real selector runs in the rehearsed image
(tests/lanes/test_rehearsal.py, tests/data/select_moe_backend.py).
"""

from __future__ import annotations

import ast
import enum
from pathlib import Path
from typing import Any

from sparkbuild import patch
from sparkbuild.patch.overlay import Overlay
from sparkbuild.patch.rules import mxfp4_moe_flashinfer_sm12x as rule
from tests.support.trees import PATCHES, TreeFactory, replace_once, status_of

ORACLE = rule.ORACLE
NAME = rule.NAME
FILTER_LINE = "    AVAILABLE_BACKENDS = _filter_by_activation(\n"


class Platform:
    """vLLM's current_platform as the added statement asks it (a fake: no GPU here)."""

    def __init__(self, family: int) -> None:
        self.family = family

    def is_cuda(self) -> bool:
        return True

    def is_device_capability_family(self, family: int) -> bool:
        return family == self.family


def walk(text: str, family: int, requested: Any = None) -> list[str]:
    """The backends select_mxfp4_moe_backend walks for a layer that requests ``requested``: the
    release's enum, priority list (as on the GPU family: Triton moved behind Marlin on SM12x),
    filter, and every statement between the filter and the walk, executed."""
    module = ast.parse(text)
    named = {n.name: n for n in module.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    scope: dict[str, Any] = {"Enum": enum.Enum, "current_platform": Platform(family), "prioritize_humming": lambda b: b}
    for name in ("Mxfp4MoeBackend", "_backend_activation_key", "_filter_by_activation"):
        exec(compile(ast.Module(body=[named[name]], type_ignores=[]), name, "exec"), scope)
    scope.update(kFp8Dynamic128Sym="fp8", kMxfp8Dynamic="mxfp8", kFp8StaticTensorSym="fp8s", kMxfp4Dynamic="mxfp4")
    priority = named["_get_priority_backends_for_gpt_oss"]
    listed = next(n for n in priority.body if isinstance(n, ast.Assign))
    backends = eval(compile(ast.Expression(listed.value), "<list>", "eval"), scope)
    if family == 120:  # the release's own SM12x branch: Triton behind BATCHED_MARLIN
        triton = scope["Mxfp4MoeBackend"].TRITON
        backends.remove(triton)
        backends.insert(backends.index(scope["Mxfp4MoeBackend"].BATCHED_MARLIN) + 1, triton)
    selector = rule.selector_function(text)
    start = rule.filtered_list(selector)
    loop = next(n for n in selector.body if isinstance(n, ast.For) and ast.unparse(n.iter) == "AVAILABLE_BACKENDS")
    between: list[ast.stmt] = [
        n for n in selector.body if start.lineno <= n.lineno < loop.lineno and isinstance(n, ast.Assign | ast.If)
    ]
    scope.update(requested_activation_key=requested, _get_priority_backends_for_gpt_oss=lambda: backends)
    exec(compile(ast.Module(body=between, type_ignores=[]), "<between>", "exec"), scope)
    return [b.name for b in scope["AVAILABLE_BACKENDS"]]


def only(tree: Path, version: str) -> patch.Result:
    return status_of(tree, version, NAME)


def edit(tree: Path, old: str, new: str) -> None:
    replace_once(tree / ORACLE, old, new)


def test_unpatched_gpt_oss_walks_no_non_marlin_mxfp4_kernel_on_sm12x(pristine: TreeFactory) -> None:
    """vLLM 0.33.0 as released: gpt-oss's layer (no activation format) is offered BF16-activation
    backends only, and on SM12x the first of them that serves it is Marlin (the TRT-LLM and AITER ones
    are other GPUs', FlashInfer's CUTLASS W4A16 SM90's): FLASHINFER_CUTLASS_MXFP4_MXFP8 is not walked."""
    walked = walk((pristine("0.33.0") / ORACLE).read_text(), 120)
    assert "FLASHINFER_CUTLASS_MXFP4_MXFP8" not in walked and "CUTLASS_MXFP4_MXFP4" not in walked
    assert walked.index("MARLIN") < walked.index("TRITON")


def test_patched_gpt_oss_walks_flashinfers_cutlass_right_before_marlin_on_sm12x_only(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.33.0")
    before = (tree / ORACLE).read_text()
    patch.apply(patch.check(tree, patch.load(PATCHES, (NAME,)), "0.33.0"))
    text = (tree / ORACLE).read_text()
    walked = walk(text, 120)
    assert walked[walked.index("MARLIN") - 1] == "FLASHINFER_CUTLASS_MXFP4_MXFP8"
    assert [b for b in walked if b != "FLASHINFER_CUTLASS_MXFP4_MXFP8"] == walk(before, 120)
    # Another GPU, and a checkpoint that names its activations, walk as before.
    assert walk(text, 90) == walk(before, 90) and walk(text, 100) == walk(before, 100)
    assert walk(text, 120, requested="mxfp4") == walk(before, 120, requested="mxfp4")
    # The statement sits right after the filter, in the selector's own body, before the walk.
    after_filter = text[text.index(FILTER_LINE) :].split("\n", 3)[3]
    assert after_filter.startswith(f"    if (  # {rule.MARKER}: ")


def test_applied_upstream_and_a_marker_without_its_change_read_by_content(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.33.0")
    patch.apply(patch.check(tree, patch.load(PATCHES, (NAME,)), "0.33.0"))
    (tree / patch.RECORD).unlink()  # judged by the tree alone
    result = only(tree, "0.33.0")
    assert (result.status, result.files) == ("applied", (ORACLE,))
    text = (tree / ORACLE).read_text()
    (line,) = [ln for ln in text.splitlines(keepends=True) if rule.MARKER in ln]
    edit(tree, line, "    if (\n")
    assert only(tree, "0.33.0").status == "upstream"  # the same change without sparkbuild's marker
    edit(
        tree,
        "            Mxfp4MoeBackend.FLASHINFER_CUTLASS_MXFP4_MXFP8,\n        )\n",
        "            Mxfp4MoeBackend.MARLIN,\n        )\n",
    )
    edit(
        tree,
        "    if (\n        requested_activation_key is None",
        f"    if (  # {rule.MARKER}\n        requested_activation_key is None",
    )
    result = only(tree, "0.33.0")
    assert result.status == "conflict" and result.detail.startswith(
        f"{ORACLE}: carries sparkbuild's {NAME} marker but not its change (no {rule.INSERT} in select_mxfp4_moe_backend())"
    )


def test_a_layout_the_rule_does_not_know_is_a_conflict_and_older_releases_are_out_of_range(
    tree_copy: TreeFactory, pristine: TreeFactory
) -> None:
    tree = tree_copy("0.33.0")
    edit(tree, FILTER_LINE, "    AVAILABLE_BACKENDS = list(\n")
    result = only(tree, "0.33.0")
    assert result.status == "conflict" and "expected one AVAILABLE_BACKENDS = _filter_by_activation(...)" in result.detail
    assert only(pristine("0.32.0"), "0.32.0").status == "not-applicable"
    outcome = rule.run(Overlay(pristine("0.13.0")), PATCHES / NAME)
    assert outcome.status == "not-applicable" and outcome.detail.startswith(f"no {ORACLE}")


def test_the_rule_writes_only_the_file_it_declares(pristine: TreeFactory) -> None:
    """WRITES: one Python file, so a target with this patch takes upstream's compiled wheel."""
    assert rule.WRITES == (ORACLE,)
    outcome = rule.run(Overlay(pristine("0.33.0")), PATCHES / NAME)
    assert outcome.status == "applies" and [e.path for e in outcome.edits] == [ORACLE]
