"""nvfp4-moe-b12x-auto on every release it applies to: B12X ahead of Marlin in the list vLLM walks.

No SM12x GPU runs here, so the proof is read from each release's real oracle (every distinct
content of ``oracle/nvfp4.py`` the patch changes, found by hash across every release): unpatched,
``select_nvfp4_moe_backend`` walks a list without ``NvFp4MoeBackend.B12X`` (the failure: on SM121 an
NVFP4 layer that no CUTLASS backend takes lands on Marlin); patched, B12X stands immediately before
MARLIN and every other backend keeps its order. The list is evaluated, not matched as text: the
release's own ``NvFp4MoeBackend`` class and the list literal are executed, and what the selector
does to the list before its walk is read statement by statement. Then the status by content:
applied, upstream in either form upstream may take, a marker without its change, an order the rule
does not know. ``tests/data/select_moe_backend.py`` runs the real selector where vLLM is installed.
"""

from __future__ import annotations

import ast
import enum
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.patch import need
from sparkbuild.patch.overlay import Overlay
from sparkbuild.patch.rules import nvfp4_moe_b12x_auto as rule
from tests.support import ROOT
from tests.support.trees import PATCHES, RELEASES, TreeFactory, Variant, replace_once, status_of, variants

ORACLE = rule.ORACLE
NAME = rule.NAME
FIRST = "0.29.0"  # the first release with NvFp4MoeBackend.B12X (PR #52018)


def selector(module: ast.Module) -> ast.FunctionDef:
    (fn,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "select_nvfp4_moe_backend"]
    return fn


def walked(text: str) -> list[str]:
    """The backends select_nvfp4_moe_backend walks with moe_backend="auto", in order, on a GPU where
    Humming does not outrank Marlin (only SM90 does) and a model without a SwiGLU clamp: the list
    literal evaluated with the release's own NvFp4MoeBackend, after checking that every statement
    between it and the walk only reorders Humming or filters by the clamp set."""
    module = ast.parse(text)
    (cls,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "NvFp4MoeBackend"]
    scope: dict[str, object] = {"Enum": enum.Enum}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), "<NvFp4MoeBackend>", "exec"), scope)
    fn = selector(module)
    assigns = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "AVAILABLE_BACKENDS" for t in n.targets)
    ]
    literal, *later = sorted(assigns, key=lambda n: n.lineno)
    assert isinstance(literal.value, ast.List)
    for node in later:
        said = ast.unparse(node.value)
        assert said in (
            "prioritize_humming(AVAILABLE_BACKENDS)",
            "[b for b in AVAILABLE_BACKENDS if b in NVFP4_BACKENDS_WITH_CLAMP]",
        ), said
    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For) and ast.unparse(n.iter) == "AVAILABLE_BACKENDS"]
    assert len(loops) == 1 and loops[0].lineno > max(n.lineno for n in assigns)
    members = eval(compile(ast.Expression(literal.value), "<AVAILABLE_BACKENDS>", "eval"), scope)
    return [m.name for m in members]


def clamp_set(text: str) -> set[str]:
    for node in ast.walk(selector(ast.parse(text))):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "NVFP4_BACKENDS_WITH_CLAMP":
            assert isinstance(node.value, ast.Set)
            return {ast.unparse(e).removeprefix("NvFp4MoeBackend.") for e in node.value.elts}
    raise AssertionError("no NVFP4_BACKENDS_WITH_CLAMP")


@pytest.fixture(scope="module")
def oracles(sweep: dict[str, patch.Report]) -> list[Variant]:
    return variants(sweep, "nvfp4.py")


def test_the_patch_reaches_every_release_with_b12x_and_no_other(sweep: dict[str, patch.Report]) -> None:
    for version, report in sweep.items():
        (result,) = [r for r in report.results if r.patch == NAME]
        has_b12x = "    B12X = " in (report.source / ORACLE).read_text() if (report.source / ORACLE).is_file() else False
        assert (result.status == "applies") is has_b12x, (version, result)
        assert has_b12x is (RELEASES.index(version) >= RELEASES.index(FIRST)), version
        if has_b12x:
            assert result.files == (ORACLE,) and result.detail.startswith(f"{ORACLE}: NvFp4MoeBackend.B12X before MARLIN")


def test_unpatched_auto_selection_never_reaches_b12x(oracles: list[Variant], pristine: TreeFactory) -> None:
    """The failure: B12X is a backend of the release (explicit --moe-backend b12x maps to it, its
    experts class is wired), and the automatic walk never tries it: Marlin is the next stop after
    the CUTLASS backends."""
    for v in oracles:
        text = (pristine(v.version) / v.path).read_text()
        order = walked(text)
        assert "B12X" not in order and "FLASHINFER_B12X" not in order, (v.versions, order)
        assert order[order.index("MARLIN") - 1] == "VLLM_CUTLASS", order
        assert '"b12x": NvFp4MoeBackend.B12X' in text and "if backend == NvFp4MoeBackend.B12X:" in text


def test_patched_auto_selection_tries_b12x_right_before_marlin(
    oracles: list[Variant], sweep: dict[str, patch.Report], pristine: TreeFactory
) -> None:
    """Every variant of the patched oracle compiles, walks B12X immediately before MARLIN with every
    other backend in its old order, keeps FlashInfer's B12X out (upstream's choice), and keeps B12X
    through the SwiGLU-clamp filter."""
    assert len(oracles) == 3, [v.versions for v in oracles]  # 0.29.0 - 0.30.0, 0.31.0, 0.32.0 - 0.33.0
    for v in oracles:
        text = sweep[v.version].overlay.read(v.path)
        compile(text, v.path, "exec")
        before = walked((pristine(v.version) / v.path).read_text())
        after = walked(text)
        at = before.index("MARLIN")
        assert after == [*before[:at], "B12X", *before[at:]], (v.versions, after)
        assert "FLASHINFER_B12X" not in after
        assert "B12X" in clamp_set(text)
        (line,) = [ln for ln in text.splitlines() if rule.MARKER in ln]
        assert line.strip().startswith("NvFp4MoeBackend.B12X,  # sparkbuild nvfp4-moe-b12x-auto")


# --- the status, by content ------------------------------------------------------------------------


def only(tree: Path, version: str) -> patch.Result:
    return status_of(tree, version, NAME)


def edit(tree: Path, old: str, new: str) -> None:
    replace_once(tree / ORACLE, old, new)


# MARLIN in the walked list (its next entry, HUMMING, tells it from the clamp set's MARLIN).
def reset(tree: Path, pristine: Path) -> None:
    (tree / ORACLE).write_text((pristine / ORACLE).read_text())


MARLIN = "        NvFp4MoeBackend.MARLIN,\n"
HUMMING = "        NvFp4MoeBackend.HUMMING,\n"
AVAILABLE = "    AVAILABLE_BACKENDS = [\n        NvFp4MoeBackend.FLASHINFER_TRTLLM,\n"


@pytest.mark.parametrize("version", [FIRST, "0.33.0"])
def test_the_change_reads_applied_with_its_file(version: str, tree_copy: TreeFactory) -> None:
    tree = tree_copy(version)
    patch.apply(patch.check(tree, patch.load(PATCHES, (NAME,)), version))
    (tree / patch.RECORD).unlink()  # judged by the tree alone
    result = only(tree, version)
    assert (result.status, result.files) == ("applied", (ORACLE,))
    (p,) = patch.load(PATCHES, (NAME,))
    said = need.judge(p, result.status, result.detail, tree, need.Build("13.0")).why
    assert said.endswith("with B12X before MARLIN: this tree carries the change"), said


def test_the_marker_without_its_change_is_an_error_naming_the_file(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.33.0")
    edit(tree, MARLIN + HUMMING, f"        NvFp4MoeBackend.MARLIN,  # {rule.MARKER}\n" + HUMMING)
    result = only(tree, "0.33.0")
    assert result.status == "conflict"
    assert result.detail.startswith(
        f"{ORACLE}: carries sparkbuild's {NAME} marker but not its change (AVAILABLE_BACKENDS has no B12X before MARLIN)"
    )


def test_the_marked_line_moved_behind_marlin_is_an_error(tree_copy: TreeFactory) -> None:
    tree = tree_copy("0.33.0")
    patch.apply(patch.check(tree, patch.load(PATCHES, (NAME,)), "0.33.0"))
    text = (tree / ORACLE).read_text()
    (line,) = [ln for ln in text.splitlines(keepends=True) if rule.MARKER in ln]
    edit(tree, line + MARLIN + HUMMING, MARLIN + line + HUMMING)
    result = only(tree, "0.33.0")
    assert result.status == "conflict" and result.detail.startswith(f"{ORACLE}: carries sparkbuild's {NAME} marker")


def test_upstreams_fix_reads_upstream_in_either_form(tree_copy: TreeFactory, pristine: TreeFactory) -> None:
    """The open PRs' form (B12X on the line above MARLIN) is found by patch.yaml's detect; any other
    place ahead of Marlin (B12X first, as forks have it) by the rule reading the list."""
    tree = tree_copy("0.33.0")
    edit(tree, MARLIN + HUMMING, "        NvFp4MoeBackend.B12X,\n" + MARLIN + HUMMING)
    result = only(tree, "0.33.0")
    assert result.status == "upstream" and result.detail.startswith(f"{ORACLE} already has 'NvFp4MoeBackend.B12X,")
    reset(tree, pristine("0.33.0"))
    edit(tree, AVAILABLE, AVAILABLE.replace("[\n", "[\n        NvFp4MoeBackend.B12X,\n"))
    result = only(tree, "0.33.0")
    assert (result.status, result.detail) == (
        "upstream",
        f"{ORACLE}: select_nvfp4_moe_backend already walks B12X before MARLIN",
    )


def test_an_order_the_rule_does_not_know_is_a_conflict(tree_copy: TreeFactory, pristine: TreeFactory) -> None:
    """B12X behind Marlin (an upstream choice the rule would second-guess), and a list it cannot find."""
    tree = tree_copy("0.33.0")
    edit(tree, MARLIN + HUMMING, MARLIN + "        NvFp4MoeBackend.B12X,\n" + HUMMING)
    result = only(tree, "0.33.0")
    assert (result.status, result.detail) == (
        "conflict",
        f"{ORACLE}: AVAILABLE_BACKENDS has B12X after MARLIN; upstream chose that order, update the rule",
    )
    reset(tree, pristine("0.33.0"))
    edit(tree, AVAILABLE, AVAILABLE.replace("AVAILABLE_BACKENDS = [", "AVAILABLE_BACKENDS = list(NvFp4MoeBackend)\n    _OLD = ["))
    result = only(tree, "0.33.0")
    assert (
        result.status == "conflict" and "expected one AVAILABLE_BACKENDS = [...] in select_nvfp4_moe_backend()" in result.detail
    )


def test_a_release_without_b12x_has_nothing_to_change(pristine: TreeFactory) -> None:
    """Below its range by versions_why; and by content, had the range said otherwise."""
    assert only(pristine("0.28.0"), "0.28.0").status == "not-applicable"
    outcome = rule.run(Overlay(pristine("0.28.0")), PATCHES / NAME)
    assert outcome.status == "not-applicable" and "NvFp4MoeBackend has no B12X member" in outcome.detail
    outcome = rule.run(Overlay(pristine("0.13.0")), PATCHES / NAME)
    assert outcome.status == "not-applicable" and outcome.detail.startswith(f"no {ORACLE}")


def test_the_rule_writes_only_the_file_it_declares(sweep: dict[str, patch.Report]) -> None:
    """WRITES: one Python file, so a build with this patch compiles nothing new."""
    assert rule.WRITES == (ORACLE,) and all(f.endswith(".py") for f in rule.WRITES)
    for report in sweep.values():
        (result,) = [r for r in report.results if r.patch == NAME]
        assert set(result.files) <= set(rule.WRITES)


def test_the_selector_probe_is_a_script_for_an_image_with_vllm() -> None:
    """tests/data/select_moe_backend.py imports only the standard library, torch, vLLM and the product's
    fakes (sparkbuild/image/startup_probe.py, copied beside it), and says the GPU is faked."""
    script = ROOT / "tests" / "data" / "select_moe_backend.py"
    module = ast.parse(script.read_text())
    roots = {
        (a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
        for n in ast.walk(module)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert roots == {"json", "sys", "pathlib", "typing", "torch", "startup_probe", "vllm"}, roots
    assert "THE GPU IS FAKED" in (ast.get_docstring(module) or "")
