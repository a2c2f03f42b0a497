"""mxfp4-cutlass-sm12x: vLLM's CUTLASS MXFP4 x MXFP4 MoE on SM12x, with a GEMM built for SM12x.

Four changes, found by name and pattern in every layout that has the kernel (0.20.0 - 0.31.0 under
``csrc/libtorch_stable/quantization/fp4/``, 0.32.0 on under ``csrc/quantization/fp4/``):
the SM120 grouped GEMM beside the SM100 one, with its dispatch for capability 120-129; the gate
that lets vLLM pick the kernel (the C++ ``mxfp4_experts_quant_sm_supported`` from 0.24.0, the
Python ``CutlassExpertsMxfp4._supports_current_device`` before); and both sources in the SM12x
FP4 source list (the one that builds ``nvfp4_scaled_mm_sm120_kernels.cu``).
"""

from __future__ import annotations

import re
from pathlib import Path

from sparkbuild.patch import cmake, fragments
from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, settle
from sparkbuild.patch.rules import _mxfp4_oracle as mxfp4
from sparkbuild.patch.source import Region, apply_regions

NAME = "mxfp4-cutlass-sm12x"
MARKER = f"sparkbuild {NAME}"
GEMM = "mxfp4_blockwise_moe_kernel.cu"
QUANT = "mxfp4_experts_quant.cu"
# The SM12x FP4 sources: the list that builds this kernel is the one the MXFP4 sources join.
SM120_ANCHOR = "nvfp4_scaled_mm_sm120_kernels.cu"
PY_GATE = "vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py"
FRAGMENTS = ("sm120_group_mm.cuh", "cutlass_moe.py")
READS = (f"csrc/**/{GEMM}", f"csrc/**/{QUANT}", "CMakeLists.txt", PY_GATE)
# The kernels, their CMake sources and their Python gate: only a source build takes it.
WRITES = READS
SM120_FN = "run_mxfp4_blockwise_scaled_group_mm_sm120"

_DISPATCH = re.compile(r"template <typename OutType>\s*\nvoid run_mxfp4_blockwise_scaled_group_mm\(")
_PROBE = "int32_t version_num = get_sm_version_num();\n"
_SM100_GUARD = "#if defined ENABLE_NVFP4_SM100 && ENABLE_NVFP4_SM100\n"
# From 0.24.0 the C++ kernel file says which capabilities it serves; before, Python decides.
_CPP_GATE_FN = "mxfp4_experts_quant_sm_supported"
_CPP_GATE = "  return cuda_device_capability >= 100 && cuda_device_capability < 120;\n"
_CPP_GATE_SM12X = "cuda_device_capability >= 100 && cuda_device_capability < 130"
_PY_GATE = "        return p.is_cuda() and p.is_device_capability_family(100)\n"
_PY_GATE_CLASS = "class CutlassExpertsMxfp4("


def run(overlay: Overlay, folder: Path) -> Outcome:
    gemms = overlay.find(GEMM, "csrc")
    if not gemms:
        return Outcome("not-applicable", f"no {GEMM} under csrc/: this version has no CUTLASS MXFP4 MoE")
    if len(gemms) > 1:
        return Outcome("conflict", f"{len(gemms)} copies of {GEMM} ({', '.join(gemms)}); update the rule for this layout")
    gemm = gemms[0]
    quant = f"{gemm.rsplit('/', 1)[0]}/{QUANT}"
    code = {name: text for f in FRAGMENTS for name, text in fragments.read(folder / f).items()}
    edits: list[Edit] = []
    notes: list[str] = []
    marked: list[str] = []
    for rel, step in ((gemm, _gemm), (quant, _gate), ("CMakeLists.txt", _cmake)):
        if not overlay.exists(rel):
            return Outcome("conflict", f"{rel} is missing beside {gemm}; the layout changed, update the rule")
        before = overlay.read(rel)
        if MARKER in before:
            marked.append(rel)
        try:
            after, note = step(before, code, overlay, gemm, quant)
        except RuleConflict as exc:
            return Outcome("conflict", f"{rel}: {exc}")
        if after != before:
            edits.append(Edit(rel, before, after))
            notes.append(f"{rel}: {note}")
    if _CPP_GATE_FN not in overlay.read(quant):
        # The kernel file has no C++ gate (0.20.0 - 0.23.0): vLLM gates the kernel in Python.
        py = overlay.read(PY_GATE) if overlay.exists(PY_GATE) else ""
        marked += [PY_GATE] if MARKER in py else []
        try:
            after = _python_gate(py, code)
        except RuleConflict as exc:
            return Outcome("conflict", f"{PY_GATE}: {exc}")
        if after != py:
            edits.append(Edit(PY_GATE, py, after))
            notes.append(f"{PY_GATE}: CutlassExpertsMxfp4 admits capability family 120")
    return settle(NAME, edits, notes, sorted(set(marked)), "the SM12x MXFP4 kernel, its dispatch, gate and sources are there")


def _gemm(text: str, code: dict[str, str], overlay: Overlay, gemm: str, quant: str) -> tuple[str, str]:
    del overlay, gemm, quant
    if SM120_FN in text or "cutlass::arch::Sm120" in text:
        return text, "already has an SM120 kernel"
    found = list(_DISPATCH.finditer(text))
    if len(found) != 1:
        raise RuleConflict(f"expected one run_mxfp4_blockwise_scaled_group_mm dispatch, found {len(found)}")
    at = found[0].start()
    branch = text.find(_PROBE, at)
    if branch < 0:
        raise RuleConflict("the dispatch no longer reads get_sm_version_num(); update the rule")
    branch += len(_PROBE)
    tail = text[branch:].replace('"Required capability: 100")', '"Required capability: 100 or 120")', 1)
    # Past the dispatch, the SM100-only guards hide the op itself; the one inside it stays.
    guards = [m.start() for m in re.finditer(re.escape(_SM100_GUARD), tail)]
    outer = [g for g in guards if not tail[g + len(_SM100_GUARD) :].startswith("  if (version_num")]
    if not outer:
        raise RuleConflict(f"no '{_SM100_GUARD.strip()}' around cutlass_mxfp4_group_mm; update the rule")
    for g in reversed(outer):
        tail = tail[:g] + code["either-guard"] + tail[g + len(_SM100_GUARD) :]
    head = text[:at] + code["sm120-group-mm"] + "\n" + text[at:branch]
    return head + code["sm120-dispatch"] + tail, f"SM120 grouped GEMM, dispatch for 120-129, {len(outer)} guard(s) widened"


def _gate(text: str, code: dict[str, str], overlay: Overlay, gemm: str, quant: str) -> tuple[str, str]:
    del overlay, gemm, quant
    if _CPP_GATE_FN not in text or _CPP_GATE_SM12X in text:
        return text, ""  # the gate is in Python (see run), or it admits SM12x already
    if text.count(_CPP_GATE) != 1:
        raise RuleConflict(
            f"expected the gate {_CPP_GATE.strip()!r} once in {_CPP_GATE_FN}(), found it {text.count(_CPP_GATE)} times"
        )
    return apply_regions(text, (Region("quant gate", _CPP_GATE, code["quant-gate"]),)), "quant gate admits 120-129"


def _cmake(text: str, code: dict[str, str], overlay: Overlay, gemm: str, quant: str) -> tuple[str, str]:
    del code, overlay
    lists = [c for c in cmake.commands(text) if c.name == "set" and any(i.endswith(SM120_ANCHOR) for i in c.quoted())]
    if len(lists) != 1:
        raise RuleConflict(f"expected one set(...) of SM12x FP4 sources (with {SM120_ANCHOR}), found {len(lists)}")
    c = lists[0]
    missing = [f for f in (quant, gemm) if f not in c.quoted()]
    if not missing:
        return text, ""
    last = list(cmake.QUOTED.finditer(c.args))[-1]
    indent = c.args[: last.start()].rsplit("\n", 1)[-1]
    added = f"\n{indent}# {MARKER}: the MXFP4 MoE for SM12x" + "".join(f'\n{indent}"{f}"' for f in missing)
    at = c.start + last.end()
    var = c.args.split()[0]
    return text[:at] + added + text[at:], f"{var} +{len(missing)} MXFP4 source(s) (line {c.line})"


def _python_gate(text: str, code: dict[str, str]) -> str:
    if _PY_GATE_CLASS not in text:
        raise RuleConflict(f"no {_PY_GATE_CLASS.rstrip('(')} and no C++ gate in {QUANT}; update the rule")
    # By content: the gate admits family 120 (the marker alone is not the change; settle() says so).
    if "is_device_capability_family(120)" in text[text.index(_PY_GATE_CLASS) :]:
        return text
    replace = fragments.fill(code["supports-current-device"], indent="        ")
    return apply_regions(text, (Region("CutlassExpertsMxfp4 gate", _PY_GATE, replace),))


def needed(tree: Path, cuda: str, arch_list: str) -> tuple[bool, str]:
    """Whether a build needs the patch follows what vLLM's selector does for gpt-oss's MoE layers (the
    MXFP4 model Spark owners serve), not what another backend does for other checkpoints. Not needed
    where the selector's automatic walk filters by the requested activation format (0.22.0 on):
    gpt-oss's layers declare none, so only BF16-activation backends are tried for them and
    CUTLASS_MXFP4_MXFP4 (MXFP4 activations) never is; nor does its experts class apply the expert
    biases gpt-oss has. Needed elsewhere (the kernel gated to SM10x, no filter)."""
    del cuda, arch_list
    oracle = tree / mxfp4.ORACLE
    found = mxfp4.selectors(oracle.read_text(encoding="utf-8")) if oracle.is_file() else []
    walks = mxfp4.filtered_walks(found[0]) if len(found) == 1 else []
    if len(walks) != 1:
        return True, "its change is not in this release"
    return False, (
        f"{mxfp4.SELECTOR}() offers a layer that declares no activation format (gpt-oss) the BF16-activation backends "
        f"only ({mxfp4.FILTER}, {mxfp4.ORACLE}:{walks[0].lineno}): CUTLASS_MXFP4_MXFP4 (MXFP4 activations) is never "
        "tried for gpt-oss's MoE, and CutlassExpertsMxfp4 applies no expert biases; gpt-oss on SM12x is "
        "mxfp4-moe-flashinfer-sm12x's. A checkpoint that declares MXFP4 activations would take it (or upstream's b12x: "
        "--moe-backend b12x)"
    )
