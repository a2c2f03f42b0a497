"""flashinfer-sinks-sm12x: attention sinks (gpt-oss) through vLLM's FlashInfer backend on SM12x.

Upstream's SM12x sink path, backported: supports_sink() admits SM12x, decodes go to FlashInfer's
XQA kernel, prefills to ``BatchAttentionWithAttentionSinkWrapper``; bf16/fp16 KV only. Every other
GPU keeps its code: each statement the rule changes stays, as it was, in an ``else``.

The statements are found with Python's own parser (``ast``), by what they are, not by their text:
the ``self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(...)`` of ``_get_prefill_wrapper``,
the non-DCP ``prefill_wrapper.run(..., k_scale=...)`` of ``forward``, and so on. Two layouts:
up to 0.24 the builder decides ``can_use_trtllm`` and FlashInfer picks XQA off SM10x by itself;
0.25 - 0.27 choose the decode kernel in the builder (``FlashInferDecodeKernel.XQA`` on SM90),
where SM12x is given XQA the same way. The wrapped statements and the arguments the sink call
reuses (query, cache, ``out=``, the scales) are read from the tree, so their changes across
releases (``backend=`` from 0.21, ``q_scale=`` from 0.25) need no new rule text.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkbuild.patch import fragments
from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, judged, marker_without_change

NAME = "flashinfer-sinks-sm12x"
BACKEND = "vllm/v1/attention/backends/flashinfer.py"
MARKER = f"sparkbuild {NAME}"
FRAGMENTS = "sm12x_sinks.py"
READS = (BACKEND,)
# Python only: a build from upstream's wheel can take it (sparkbuild.patch.scope).
WRITES = (BACKEND,)
SINK_WRAPPER = "BatchAttentionWithAttentionSinkWrapper"


@dataclass(frozen=True)
class Splice:
    """Lines ``first`` to ``last`` (1-based, inclusive) become ``text``; ``last == first - 1`` inserts
    before ``first``."""

    name: str
    first: int
    last: int
    text: str


def run(overlay: Overlay, folder: Path) -> Outcome:
    if not overlay.exists(BACKEND):
        return Outcome("not-applicable", f"no {BACKEND} in this layout")
    before = overlay.read(BACKEND)
    code = fragments.read(folder / FRAGMENTS)
    if MARKER in before:
        missing = missing_parts(before, code)
        if missing:
            return Outcome("conflict", marker_without_change(BACKEND, NAME, f"missing: {', '.join(missing)}"))
        return Outcome("applied", f"sparkbuild's {NAME} is in {BACKEND}: every part of it", files=(BACKEND,))
    return judged(BACKEND, lambda: _applies(before, plan(before, code)))


def _applies(before: str, splices: list[Splice]) -> Outcome:
    after = splice(before, splices)
    return Outcome("applies", f"{BACKEND}: {', '.join(s.name for s in splices)}", (Edit(BACKEND, before, after),))


def plan(text: str, code: dict[str, str]) -> list[Splice]:
    """Every change, in file order, each found on the original text."""
    module = ast.parse(text)
    backend = _class_with(module, "supports_sink")
    builder = _class_with(module, "_get_prefill_wrapper")
    impl = _class_with(module, "forward", lambda c: any(_is_method_call(n, "prefill_wrapper", "run") for n in ast.walk(c)))
    # 0.25 on: the builder picks the decode kernel (XQA or trtllm-gen) itself.
    picks_kernel = any(_assigns_self(n, "flashinfer_trtllm_api_decode_kernel") for n in ast.walk(builder))
    lines = text.splitlines(keepends=True)
    splices = [
        _import(module),
        _helper(module, code),
        _supports_sink(_method(backend, "supports_sink"), code, lines),
        _builder_check(_method(builder, "__init__"), code, lines, picks_kernel),
        _build_check(_method(builder, "build"), code, lines),
        _prefill_wrapper(builder, code, lines),
        _prefill_run(_method(impl, "forward"), code, lines),
    ]
    if not picks_kernel:
        splices += _decode(_method(impl, "forward"), code, lines)
    return sorted(splices, key=lambda s: s.first)


def missing_parts(text: str, code: dict[str, str]) -> list[str]:
    """The parts of the change a file that carries the marker lacks, each looked for as the rule
    writes it (``fragments.pattern``); empty when the whole change is there."""
    try:
        module = ast.parse(text)
        builder = _class_with(module, "_get_prefill_wrapper")
        impl = _class_with(module, "forward", lambda c: any(_is_method_call(n, "prefill_wrapper", "run") for n in ast.walk(c)))
    except SyntaxError as exc:
        return [f"the file does not parse as Python (line {exc.lineno})"]
    except RuleConflict as exc:
        return [str(exc)]
    picks_kernel = any(_assigns_self(n, "flashinfer_trtllm_api_decode_kernel") for n in ast.walk(builder))
    wanted = {
        "helper": ("helper",),
        "supports_sink": ("supports-sink", "supports-sink-family"),
        "builder": ("builder-xqa",) if picks_kernel else ("builder",),
        "build": ("build-check",),
        "prefill wrapper": ("prefill-wrapper",),
        "prefill run": ("prefill-run",),
    }
    if not picks_kernel:
        wanted["decode layout"] = ("decode-layout",)
    missing = [part for part, sections in wanted.items() if not any(fragments.pattern(code[s]).search(text) for s in sections)]
    imported = {a.name for n in module.body if isinstance(n, ast.ImportFrom) and n.module == "flashinfer" for a in n.names}
    if SINK_WRAPPER not in imported:
        missing.insert(0, "import")
    decode = [n for n in ast.walk(_method(impl, "forward")) if _is_call_to(n, "trtllm_batch_decode_with_kv_cache")]
    if not picks_kernel and not any(isinstance(c, ast.Call) and "kv_layout" in _keywords(c) for c in decode):
        missing.append("decode call")
    return missing


def splice(text: str, splices: list[Splice]) -> str:
    lines = text.splitlines(keepends=True)
    for s in sorted(splices, key=lambda s: s.first, reverse=True):
        lines[s.first - 1 : s.last] = [s.text]
    return "".join(lines)


# --- the changes -------------------------------------------------------------------------------


def _import(module: ast.Module) -> Splice:
    found = [n for n in module.body if isinstance(n, ast.ImportFrom) and n.module == "flashinfer" and n.level == 0]
    multi = [n for n in found if (n.end_lineno or n.lineno) > n.lineno]
    if not multi:
        raise RuleConflict("no parenthesized 'from flashinfer import (...)'; update the rule")
    return Splice("import", multi[0].lineno + 1, multi[0].lineno, f"    {SINK_WRAPPER},\n")


def _helper(module: ast.Module, code: dict[str, str]) -> Splice:
    found = [n for n in module.body if isinstance(n, ast.Assign) and any(_is_name(t, "logger") for t in n.targets)]
    if len(found) != 1:
        raise RuleConflict(f"expected one module-level 'logger = ...', found {len(found)}")
    end = _end(found[0])
    return Splice("helper", end + 1, end, "\n\n" + code["helper"] + "\n")


def _supports_sink(fn: ast.FunctionDef, code: dict[str, str], lines: list[str]) -> Splice:
    for node in ast.walk(fn):
        # Up to 0.24: `return supports_trtllm_attention()`.
        if (
            isinstance(node, ast.Return)
            and isinstance(node.value, ast.Call)
            and _is_call_to(node.value, "supports_trtllm_attention")
            and not node.value.args
        ):
            return _replace("supports_sink", node, fragments.fill(code["supports-sink"], _indent(lines, node)))
        # 0.25 on: `if not current_platform.is_device_capability_family(100): return False`.
        if isinstance(node, ast.If) and _tests_family_100(node.test) and len(node.body) == 1:
            ret = node.body[0]
            if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Constant) and ret.value.value is False:
                return _replace("supports_sink", ret, fragments.fill(code["supports-sink-family"], _indent(lines, ret)))
    raise RuleConflict("supports_sink: neither 'return supports_trtllm_attention()' nor an SM10x-only check; update the rule")


def _builder_check(fn: ast.FunctionDef, code: dict[str, str], lines: list[str], picks_kernel: bool) -> Splice:
    """The builder's early `if self.has_sinks and not ...: raise` gets the SM12x path before it."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and _is_self_and_not(node.test, "has_sinks"):
            section = "builder-xqa" if picks_kernel else "builder"
            return _replace_header("builder", node, fragments.fill(code[section], _indent(lines, node)))
    raise RuleConflict("__init__: no 'if self.has_sinks and not ...:' check in the metadata builder; update the rule")


def _build_check(fn: ast.FunctionDef, code: dict[str, str], lines: list[str]) -> Splice:
    """In build(), `if not <all trtllm>: if self.has_sinks: raise` lets SM12x sink batches through."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.If) or not node.body:
            continue
        inner = node.body[0]
        if isinstance(inner, ast.If) and _is_self_attr(inner.test, "has_sinks"):
            decode = _decode_flag(fn, node.test)
            text = fragments.fill(code["build-check"], _indent(lines, inner), decode=decode)
            return _replace_header("build", inner, text)
    raise RuleConflict("build: no 'if self.has_sinks:' under the not-all-trtllm branch; update the rule")


def _decode_flag(fn: ast.FunctionDef, test: ast.expr) -> str:
    """The local that says decodes go to the TRTLLM API kernels (decode_use_trtllm, ...)."""
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            names |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    flags = sorted(n for n in names if n.startswith("decode_"))
    if len(flags) != 1:
        raise RuleConflict(f"build: expected one decode_* flag in the all-trtllm test, found {flags or 'none'}")
    return flags[0]


def _prefill_wrapper(builder: ast.ClassDef, code: dict[str, str], lines: list[str]) -> Splice:
    fn = _method(builder, "_get_prefill_wrapper")
    found = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        and any(_is_self_attr(t, "_prefill_wrapper") for t in n.targets)
        and _is_call_to(n.value, "BatchPrefillWithPagedKVCacheWrapper")
    ]
    if len(found) != 1:
        raise RuleConflict(
            f"_get_prefill_wrapper: expected one self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(...), "
            f"found {len(found)}"
        )
    node = found[0]
    # 0.25 on keeps one query dtype per phase.
    q_dtype = (
        "self.q_data_type_prefill"
        if any(_assigns_self(n, "q_data_type_prefill") for n in ast.walk(builder))
        else "self.q_data_type"
    )
    text = fragments.fill(code["prefill-wrapper"], _indent(lines, node), q_dtype=q_dtype, original=_source(lines, node))
    return _replace("prefill wrapper", node, text)


def _prefill_run(fn: ast.FunctionDef, code: dict[str, str], lines: list[str]) -> Splice:
    """The native (non-DCP) prefill run: the one that passes k_scale=; the sink variant beside it."""
    found = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Expr)
        and isinstance(n.value, ast.Call)
        and _is_method_call(n.value, "prefill_wrapper", "run")
        and "k_scale" in _keywords(n.value)
    ]
    if len(found) != 1:
        raise RuleConflict(f"forward: expected one prefill_wrapper.run(..., k_scale=...), found {len(found)}")
    node = found[0]
    call = node.value
    assert isinstance(call, ast.Call)
    kw = _keywords(call)
    if len(call.args) != 2 or not {"v_scale", "out"} <= kw.keys():
        raise RuleConflict("forward: the prefill run no longer takes (query, kv cache, ..., v_scale=, out=); update the rule")
    scales = [kw[k] for k in ("q_scale", "k_scale") if k in kw]
    values = {
        "query": _segment(lines, call.args[0]),
        "kv_cache": _segment(lines, call.args[1]),
        # The sink variant folds the dequantization scales into its softmax scale.
        "sm_scale": " * ".join(["self.scale", *(_segment(lines, s) for s in scales)]),
        "v_scale": _segment(lines, kw["v_scale"]),
        "out": _segment(lines, kw["out"]),
        "original": _source(lines, node),
    }
    return _replace("prefill run", node, fragments.fill(code["prefill-run"], _indent(lines, node), **values))


def _decode(fn: ast.FunctionDef, code: dict[str, str], lines: list[str]) -> list[Splice]:
    """Up to 0.24: XQA takes the cache in its own layout (the HND assert admits SM12x, kv_layout= passed)."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _is_call_to(n, "trtllm_batch_decode_with_kv_cache")]
    if len(calls) != 1:
        raise RuleConflict(f"forward: expected one trtllm_batch_decode_with_kv_cache(...), found {len(calls)}")
    call = calls[0]
    asserts = [n for n in ast.walk(fn) if isinstance(n, ast.Assert) and _is_hnd_check(n.test) and n.lineno < call.lineno]
    if not asserts:
        raise RuleConflict("forward: no 'assert get_kv_cache_layout() == \"HND\"' before the decode call; update the rule")
    check = max(asserts, key=lambda n: n.lineno)
    splices = [_replace("decode layout", check, fragments.fill(code["decode-layout"], _indent(lines, check)))]
    if "kv_layout" not in _keywords(call):
        # A keyword line of its own, before the line that closes the call.
        close = _end(call)
        if lines[close - 1].strip() != ")" or not call.keywords:
            raise RuleConflict("forward: the decode call does not end with keyword lines and a ')' line; update the rule")
        indent = _indent_of(lines[call.keywords[-1].lineno - 1])
        splices.append(Splice("decode call", close, close - 1, fragments.fill(code["decode-kv-layout"], indent)))
    return splices


# --- reading the tree -----------------------------------------------------------------------------


def _class_with(module: ast.Module, method: str, also: Callable[[ast.ClassDef], bool] | None = None) -> ast.ClassDef:
    found = [
        c
        for c in module.body
        if isinstance(c, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and f.name == method for f in c.body)
        and (also is None or also(c))
    ]
    if len(found) != 1:
        raise RuleConflict(f"expected one class with a {method}() method, found {len(found)}")
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for f in cls.body:
        if isinstance(f, ast.FunctionDef) and f.name == name:
            return f
    raise RuleConflict(f"{cls.name} has no {name}(); update the rule")


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and _is_name(node.value, "self")


def _assigns_self(node: ast.AST, attr: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(_is_self_attr(t, attr) for t in targets)


def _is_call_to(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Call) and (
        _is_name(node.func, name) or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
    )


def _is_method_call(node: ast.AST, owner: str, method: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
        and _is_name(node.func.value, owner)
    )


def _keywords(call: ast.Call) -> dict[str, ast.expr]:
    return {k.arg: k.value for k in call.keywords if k.arg is not None}


def _tests_family_100(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and _is_call_to(test.operand, "is_device_capability_family")
        and isinstance(test.operand, ast.Call)
        and [ast.literal_eval(a) for a in test.operand.args] == [100]
    )


def _is_self_and_not(test: ast.expr, attr: str) -> bool:
    """``self.<attr> and not <something>``."""
    return (
        isinstance(test, ast.BoolOp)
        and isinstance(test.op, ast.And)
        and len(test.values) == 2
        and _is_self_attr(test.values[0], attr)
        and isinstance(test.values[1], ast.UnaryOp)
        and isinstance(test.values[1].op, ast.Not)
    )


def _is_hnd_check(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and _is_call_to(test.left, "get_kv_cache_layout")
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "HND"
    )


def _end(node: ast.AST) -> int:
    end = getattr(node, "end_lineno", None)
    assert isinstance(end, int)
    return end


def _indent(lines: list[str], node: ast.stmt) -> str:
    return _indent_of(lines[node.lineno - 1])


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _source(lines: list[str], node: ast.stmt) -> str:
    """The statement's whole lines, at column 0."""
    return textwrap.dedent("".join(lines[node.lineno - 1 : _end(node)]))


def _segment(lines: list[str], node: ast.expr) -> str:
    """The source of a one-line expression (ast's offsets count UTF-8 bytes)."""
    if node.end_lineno != node.lineno or node.end_col_offset is None:
        raise RuleConflict(f"an argument spanning lines ({ast.unparse(node)[:40]}...); update the rule")
    return lines[node.lineno - 1].encode()[node.col_offset : node.end_col_offset].decode()


def _replace(name: str, node: ast.stmt, text: str) -> Splice:
    return Splice(name, node.lineno, _end(node), text)


def _replace_header(name: str, node: ast.If, text: str) -> Splice:
    """Only the ``if ...:`` line(s) of ``node``; its body stays."""
    return Splice(name, node.lineno, _end(node.test), text)
