"""flashinfer-sinks-sm12x on every release it applies to, checked against the real FlashInfer each pins.

No SM12x GPU runs here, so the proof is what can be read. For every distinct pair of (patched
backend, pinned FlashInfer), found by content hash across every release: the patched backend
compiles, keeps every non-SM12x path as it was (in an ``else``), and every FlashInfer call it adds or
changes matches the signature in the FlashInfer release that version's ``requirements/cuda.txt``
pins (its wheel from PyPI, parsed, not imported): the sink wrapper's constructor, its
AttentionSink extra arguments (one tensor ``sink``, one scalar ``sm_scale``), and
``trtllm_batch_decode_with_kv_cache`` with ``sinks`` and ``kv_layout``, whose XQA kernel serves SM12x.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.patch.rules import flashinfer_sinks_sm12x as rule
from sparkbuild.upstream import sources
from tests.support.trees import PATCHES, TreeFactory

BACKEND = rule.BACKEND


@dataclass(frozen=True)
class Case:
    version: str  # the newest release with this pair
    backend: str  # sha256 of the patched backend, 12 hex digits
    flashinfer: str  # the pinned FlashInfer version


@pytest.fixture(scope="module")
def cases(sweep: dict[str, patch.Report]) -> list[Case]:
    """One per distinct (patched backend, FlashInfer pin), oldest first."""
    found: dict[tuple[str, str], str] = {}
    for version, report in sweep.items():
        text = report.overlay.changed.get(BACKEND)
        if text is not None:
            key = (hashlib.sha256(text.encode()).hexdigest()[:12], flashinfer_pin(report.source))
            found[key] = version
    return [Case(version, backend, fi) for (backend, fi), version in found.items()]


def flashinfer_pin(tree: Path) -> str:
    found = re.search(r"(?m)^flashinfer-python==(\S+)", (tree / "requirements/cuda.txt").read_text())
    assert found, "requirements/cuda.txt pins no flashinfer-python"
    return found.group(1)


def flashinfer_source(version: str, cache: Path) -> Path:
    """FlashInfer's Python sources from its wheel on PyPI (only the .py files are unpacked)."""
    wheel = f"flashinfer_python-{version}-py3-none-any.whl"
    return sources.wheel_tree("flashinfer-python", wheel, cache, only="flashinfer/", suffix=".py") / "flashinfer"


def params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def find_def(module: ast.Module, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope: list[ast.stmt] = module.body
    if cls is not None:
        (klass,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls]
        scope = klass.body
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls or ''}.{name} not found"
    return found[0]


def defining(folder: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    """``cls.name`` (or the function ``name``) from whichever FlashInfer module defines it."""
    needle = f"class {cls}(" if cls else f"def {name}("
    (module,) = [ast.parse(p.read_text()) for p in sorted(folder.rglob("*.py")) if needle in p.read_text()]
    return find_def(module, name, cls)


def calls(module: ast.Module, name: str) -> list[ast.Call]:
    def called(c: ast.Call) -> str:
        return c.func.id if isinstance(c.func, ast.Name) else c.func.attr if isinstance(c.func, ast.Attribute) else ""

    return [n for n in ast.walk(module) if isinstance(n, ast.Call) and called(n) == name]


def test_every_release_in_range_has_a_case(cases: list[Case], sweep: dict[str, patch.Report]) -> None:
    applies = {v for v, r in sweep.items() if any(x.patch == rule.NAME and x.status == "applies" for x in r.results)}
    assert applies == {v for v, r in sweep.items() if BACKEND in r.overlay.changed}
    assert {c.flashinfer for c in cases} >= {"0.5.2", "0.6.8.post1", "0.6.16.post3"}


def test_every_flashinfer_call_matches_the_pinned_flashinfer(cases: list[Case], patched: TreeFactory, source_cache: Path) -> None:
    for case in cases:
        module = ast.parse((patched(case.version) / BACKEND).read_text())
        fi = flashinfer_source(case.flashinfer, source_cache)

        init = defining(fi, "__init__", rule.SINK_WRAPPER)
        (wrapper,) = calls(module, rule.SINK_WRAPPER)
        assert {k.arg for k in wrapper.keywords} <= params(init), case
        assert len(wrapper.args) == 2, case  # workspace buffer, kv layout
        # The JIT variant's extra run() arguments, read from FlashInfer: one tensor "sink", one scalar "sm_scale".
        names = [n.value for n in ast.walk(init) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert "sink" in names and "sm_scale" in names and "AttentionSink" in names, case
        sink_runs = [c for c in calls(module, "run") if any(isinstance(a, ast.Attribute) and a.attr == "sinks" for a in c.args)]
        assert len(sink_runs) == 1 and len(sink_runs[0].args) == 4, case  # q, kv cache, sink, sm_scale

        trtllm = defining(fi, "trtllm_batch_decode_with_kv_cache")
        (decode_call,) = calls(module, "trtllm_batch_decode_with_kv_cache")
        used = {k.arg for k in decode_call.keywords}
        assert {"sinks", "kv_layout"} <= used <= params(trtllm), case
        # Off SM10x FlashInfer's decode runs XQA, which takes the sinks in either layout: chosen by
        # "auto" up to 0.24, named by the builder's FlashInferDecodeKernel.XQA ("xqa") from 0.25.
        decode = ast.unparse(trtllm)
        assert '"xqa"' in decode or "'xqa'" in decode, case


def native_prefill_run(text: str) -> str:
    """The lines of the unpatched prefill call other GPUs make: prefill_wrapper.run(..., k_scale=...)."""
    blocks = [m.group(0) for m in re.finditer(r"(?m)^( +)prefill_wrapper\.run\(\n(?:.*\n)*?\1\)\n", text)]
    (found,) = [b for b in blocks if "k_scale=" in b]
    return found


def native_prefill_wrapper(text: str) -> str:
    """The unpatched ``self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(...)`` lines."""
    pattern = r"(?m)^( +)self\._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper\(\n(?:.*\n)*?\1\)\n"
    (found,) = [m.group(0) for m in re.finditer(pattern, text)]
    return found


def test_patched_backend_compiles_and_changes_only_sm12x(cases: list[Case], patched: TreeFactory, pristine: TreeFactory) -> None:
    for case in cases:
        text = (patched(case.version) / BACKEND).read_text()
        compile(text, BACKEND, "exec")
        module = ast.parse(text)
        assert "capability.major == 12" in ast.unparse(find_def(module, "sparkbuild_sm12x_sinks")), case
        supports = ast.unparse(find_def(module, "supports_sink", "FlashInferBackend"))
        assert "sparkbuild_sm12x_sinks()" in supports, case
        unparsed = ast.unparse(module)
        assert "self.sinks_on_sm12x = self.has_sinks and" in unparsed, case
        assert "self.kv_cache_dtype in (torch.float16, torch.bfloat16)" in unparsed, case
        # The paths other GPUs take are the original text, only moved into an else branch.
        old = (pristine(case.version) / BACKEND).read_text()
        for original in (native_prefill_run(old), native_prefill_wrapper(old)):
            indent = re.match(r" *", original).group(0)  # type: ignore[union-attr]
            moved = "".join(f"    {line}" for line in original.splitlines(keepends=True))
            assert text.count(f"{indent}else:\n{moved}") == 1, (case, original)
        assert text.count("raise NotImplementedError(\n") == old.count("raise NotImplementedError(\n"), case


def test_decodes_go_to_xqa_in_both_layouts(cases: list[Case], patched: TreeFactory) -> None:
    """Up to 0.24 the HND-only assert admits SM12x and the cache's layout is passed; from 0.25 the
    builder gives SM12x sinks FlashInfer's XQA kernel, as it gives SM90."""
    layouts = set()
    for case in cases:
        text = (patched(case.version) / BACKEND).read_text()
        if "FlashInferDecodeKernel.XQA" in text:
            layouts.add("builder picks XQA")
            assert "self.flashinfer_trtllm_api_decode_kernel = FlashInferDecodeKernel.XQA" in text, case
        else:
            layouts.add("FlashInfer picks XQA")
            assert 'assert get_kv_cache_layout() == "HND" or sparkbuild_sm12x_sinks()' in text, case
    assert layouts == {"builder picks XQA", "FlashInfer picks XQA"}


def test_0_11_0_and_0_28_0(pristine: TreeFactory) -> None:
    report = patch.check(pristine("0.11.0"), patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.11.0")
    [result] = report.results
    assert (result.status, result.detail.split(":")[0]) == ("not-applicable", "0.11.0 is outside >=0.11.1")
    assert "FlashInfer 0.3.1" in result.detail and "no BatchAttentionWithAttentionSinkWrapper" in result.detail
    report = patch.check(pristine("0.28.0"), patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.28.0")
    (result,) = report.results
    assert result.status == "upstream" and "is_device_capability_family(120)" in result.detail


def test_a_decode_call_gone_elsewhere_is_a_conflict_naming_it(tree_copy: TreeFactory) -> None:
    """The rule finds statements by what they are, so reformatting does not break it; a decode that
    no longer goes through trtllm_batch_decode_with_kv_cache does, and says where."""
    tree = tree_copy("0.19.0")
    backend = tree / BACKEND
    text = backend.read_text().replace("trtllm_batch_decode_with_kv_cache(\n", "xqa_batch_decode_with_kv_cache(\n")
    backend.write_text(text)
    report = patch.check(tree, patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.19.0")
    (result,) = report.results
    assert (result.status, result.detail) == (
        "conflict",
        f"{BACKEND}: forward: expected one trtllm_batch_decode_with_kv_cache(...), found 0",
    )


def test_reformatted_calls_still_apply(tree_copy: TreeFactory) -> None:
    """A call whose keyword arguments changed (as between releases) is found all the same."""
    tree = tree_copy("0.19.0")
    backend = tree / BACKEND
    backend.write_text(backend.read_text().replace("q_len_per_req=q_len_per_req,\n", "q_len_per_req=q_len,\n"))
    (result,) = patch.check(tree, patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.19.0").results
    assert result.status == "applies"
