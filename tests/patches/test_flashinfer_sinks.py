"""flashinfer-sinks-sm12x on real sources, checked against the real FlashInfer each version pins.

No SM12x GPU runs here, so the proof is what can be read: the patched backend compiles, keeps every
non-SM12x path as it was, and every FlashInfer call it adds or changes matches the signature in the
FlashInfer release that version's ``requirements/cuda.txt`` pins (its wheel from PyPI, parsed, not
imported): the sink wrapper's constructor, its AttentionSink extra arguments (one tensor ``sink``,
one scalar ``sm_scale``), and ``trtllm_batch_decode_with_kv_cache`` with ``sinks`` and ``kv_layout``.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from builder import patch, sources
from builder.patch.rules import flashinfer_sinks_sm12x as rule
from builder.options import Options
from tests.patches.conftest import PATCHES, TreeFactory

BACKEND = rule.BACKEND
BACKPORTED = ("0.12.0", "0.16.0", "0.19.0")


def tree_module(tree: Path) -> ast.Module:
    return ast.parse((tree / BACKEND).read_text())


def flashinfer_pin(tree: Path) -> str:
    found = re.search(r"(?m)^flashinfer-python==(\S+)", (tree / "requirements/cuda.txt").read_text())
    assert found, "requirements/cuda.txt pins no flashinfer-python"
    return found.group(1)


def flashinfer_source(version: str) -> Path:
    wheel = f"flashinfer_python-{version}-py3-none-any.whl"
    return sources.wheel_tree("flashinfer-python", wheel, Options.from_env().cache, only="flashinfer/") / "flashinfer"


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


def calls(module: ast.Module, name: str) -> list[ast.Call]:
    def called(c: ast.Call) -> str:
        return c.func.id if isinstance(c.func, ast.Name) else c.func.attr if isinstance(c.func, ast.Attribute) else ""

    return [n for n in ast.walk(module) if isinstance(n, ast.Call) and called(n) == name]


@pytest.mark.parametrize("version", BACKPORTED)
def test_every_flashinfer_call_matches_the_pinned_flashinfer(version: str, patched: TreeFactory) -> None:
    tree = patched(version)
    module = tree_module(tree)
    fi = flashinfer_source(flashinfer_pin(tree))
    attention = ast.parse((fi / "attention.py").read_text())
    decode = ast.parse((fi / "decode.py").read_text())

    init = find_def(attention, "__init__", "BatchAttentionWithAttentionSinkWrapper")
    (wrapper,) = calls(module, "BatchAttentionWithAttentionSinkWrapper")
    assert {k.arg for k in wrapper.keywords} <= params(init)
    assert len(wrapper.args) == 2  # workspace buffer, kv layout
    # The JIT variant's extra run() arguments, read from FlashInfer: one tensor "sink", one scalar "sm_scale".
    names = [n.value for n in ast.walk(init) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert "sink" in names and "sm_scale" in names and "AttentionSink" in names
    sink_runs = [c for c in calls(module, "run") if any(isinstance(a, ast.Attribute) and a.attr == "sinks" for a in c.args)]
    assert len(sink_runs) == 1 and len(sink_runs[0].args) == 4  # q, kv cache, sink, sm_scale

    trtllm = find_def(decode, "trtllm_batch_decode_with_kv_cache")
    (decode_call,) = calls(module, "trtllm_batch_decode_with_kv_cache")
    used = {k.arg for k in decode_call.keywords}
    assert {"sinks", "kv_layout"} <= used <= params(trtllm)
    # Off SM10x, auto picks XQA, which takes the sinks in either layout.
    assert '"trtllm-gen" if get_compute_capability(query.device)[0] == 10 else "xqa"' in (fi / "decode.py").read_text()


@pytest.mark.parametrize("version", BACKPORTED)
def test_patched_backend_compiles_and_gates_on_sm12x(version: str, patched: TreeFactory, pristine: TreeFactory) -> None:
    text = (patched(version) / BACKEND).read_text()
    compile(text, BACKEND, "exec")
    module = ast.parse(text)
    helper = ast.unparse(find_def(module, "sparkbuild_sm12x_sinks"))
    assert "capability.major == 12" in helper
    supports = ast.unparse(find_def(module, "supports_sink", "FlashInferBackend"))
    assert "return supports_trtllm_attention() or sparkbuild_sm12x_sinks()" in supports
    assert "self.sinks_on_sm12x = self.has_sinks and (not can_use_trtllm) and sparkbuild_sm12x_sinks()" in ast.unparse(module)
    # The paths other GPUs take are the original text, only moved into an else branch.
    old = (pristine(version) / BACKEND).read_text()
    run = native_prefill_run(old)
    assert text.count("                    else:\n" + textwrap.indent(run, "    ")) == 1
    assert 'assert get_kv_cache_layout() == "HND" or sparkbuild_sm12x_sinks()' in text
    assert text.count("raise NotImplementedError(\n") == old.count("raise NotImplementedError(\n")


def native_prefill_run(text: str) -> str:
    """The lines of the unpatched prefill call other GPUs make: prefill_wrapper.run(..., k_scale=...)."""
    blocks = [m.group(0) for m in re.finditer(r"(?m)^( +)prefill_wrapper\.run\(\n(?:.*\n)*?\1\)\n", text)]
    (found,) = [b for b in blocks if "k_scale=" in b]
    return found


def test_0_11_0_and_0_33_0(pristine: TreeFactory) -> None:
    report = patch.check(pristine("0.11.0"), patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.11.0")
    [result] = report.results
    assert (result.status, result.detail.split(":")[0]) == ("not-applicable", "0.11.0 is outside >=0.11.1")
    assert "FlashInfer 0.3.1" in result.detail and "no BatchAttentionWithAttentionSinkWrapper" in result.detail
    report = patch.check(pristine("0.33.0"), patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.33.0")
    (result,) = report.results
    assert result.status == "upstream" and "is_device_capability_family(120)" in result.detail


def test_a_decode_call_gone_elsewhere_is_a_conflict_naming_it(tree_copy: TreeFactory) -> None:
    """The rule finds statements by what they are, so reformatting does not break it; a decode that
    no longer goes through trtllm_batch_decode_with_kv_cache does, and says where."""
    tree = tree_copy("0.19.0")
    backend = tree / BACKEND
    text = backend.read_text().replace("trtllm_batch_decode_with_kv_cache(\n", "xqa_batch_decode_with_kv_cache(\n")
    backend.write_text(text.replace("q_len_per_req=q_len_per_req,\n", "q_len_per_req=q_len_per_req\n"))
    report = patch.check(tree, patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.19.0")
    (result,) = report.results
    assert (result.status, result.detail) == (
        "conflict",
        f"{BACKEND}: forward: expected one trtllm_batch_decode_with_kv_cache(...), found 0",
    )


def test_reformatted_calls_still_apply(tree_copy: TreeFactory, pristine: TreeFactory) -> None:
    """A call whose keyword arguments moved (as between releases) is found all the same."""
    tree = tree_copy("0.19.0")
    backend = tree / BACKEND
    backend.write_text(backend.read_text().replace("q_len_per_req=q_len_per_req,\n", "q_len_per_req=q_len,\n"))
    (result,) = patch.check(tree, patch.load(PATCHES, ("flashinfer-sinks-sm12x",)), "0.19.0").results
    assert result.status == "applies"
