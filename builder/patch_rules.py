"""Patches that follow patterns rather than lines, and the overlay every patch works on.

A rule reads the tree through an ``Overlay`` (the source plus what earlier patches changed) and
returns an ``Outcome``: its status, a one-line detail, and the file edits. It never writes.
"""

from __future__ import annotations

import os
import re
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from builder.errors import ConfigError

Status = Literal["applies", "upstream", "not-applicable", "conflict"]


@dataclass(frozen=True)
class Edit:
    path: str
    before: str
    after: str


@dataclass(frozen=True)
class Outcome:
    status: Status
    detail: str
    edits: tuple[Edit, ...] = ()


class Overlay:
    """A source tree plus in-memory changes; ``commit`` writes the changes, each file atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.changed: dict[str, str] = {}

    def at(self, rel: str) -> Path:
        """``root / rel``, for a ``rel`` that stays inside the tree (a patch names what it touches)."""
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise ConfigError(f"a patch names '{rel}', a path that leaves the source tree; a patch changes files inside it")
        return self.root / rel

    def exists(self, rel: str) -> bool:
        return rel in self.changed or self.at(rel).is_file()

    def read(self, rel: str) -> str:
        if rel in self.changed:
            return self.changed[rel]
        # newline="" semantics: bytes decoded as they are, so CRLF files keep their line ends.
        return self.at(rel).read_bytes().decode("utf-8")

    def write(self, rel: str, text: str) -> None:
        self.at(rel)
        self.changed[rel] = text

    def find(self, pattern: str, under: str = ".") -> list[str]:
        """Files matching the glob ``pattern`` below ``under``, as sorted paths relative to the root."""
        base = self.root / under
        found = {p.relative_to(self.root).as_posix() for p in base.rglob(pattern) if p.is_file()} if base.is_dir() else set()
        found |= {rel for rel in self.changed if Path(rel).match(pattern) and rel.startswith(under.rstrip("/") + "/")}
        return sorted(found)

    def materialize(self, rel: str, dest_root: Path) -> None:
        dest = dest_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(self.read(rel).encode("utf-8"))

    def commit(self) -> tuple[str, ...]:
        for rel, text in sorted(self.changed.items()):
            target = self.at(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            mode = target.stat().st_mode if target.exists() else None
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".sparkbuild-")
            with os.fdopen(fd, "wb") as stream:
                stream.write(text.encode("utf-8"))
            if mode is not None:
                Path(tmp).chmod(mode)
            Path(tmp).replace(target)
        return tuple(sorted(self.changed))


Rule = Callable[[Overlay, Path], Outcome]


# --- CMake: a small reader for commands and the CUDA-version branches around them ------------


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    start: int  # offset of the "(" + 1
    end: int  # offset of the ")"
    line: int
    cuda_min: float | None  # lower bound on CMAKE_CUDA_COMPILER_VERSION in the branch, if any


_CMD_START = re.compile(r"(?m)^[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*\(")
_CUDA_GE = re.compile(r"CMAKE_CUDA_COMPILER_VERSION\}?\s+VERSION_GREATER_EQUAL\s+(\d+\.\d+)")


def cmake_commands(text: str) -> Iterator[Command]:
    """Top-of-line commands with their argument text and CUDA lower bound, skipping comments."""
    stack: list[float | None] = []  # bound of the current branch of each open if()
    pos = 0
    while m := _CMD_START.search(text, pos):
        if _in_comment(text, m.start(1)):
            pos = text.index("\n", m.end()) if "\n" in text[m.end() :] else len(text)
            continue
        end = _close_paren(text, m.end())
        name, args = m.group(1).lower(), text[m.end() : end]
        bound = _CUDA_GE.search(args)
        if name == "if":
            stack.append(float(bound.group(1)) if bound else None)
        elif name == "elseif" and stack:
            stack[-1] = float(bound.group(1)) if bound else None
        elif name == "else" and stack:
            stack[-1] = None
        elif name == "endif" and stack:
            stack.pop()
        bounds = [b for b in stack if b is not None]
        yield Command(name, args, m.end(), end, text.count("\n", 0, m.start(1)) + 1, max(bounds) if bounds else None)
        pos = end + 1


def _in_comment(text: str, offset: int) -> bool:
    line_start = text.rfind("\n", 0, offset) + 1
    return "#" in text[line_start:offset]


def _close_paren(text: str, pos: int, line_comment: str | None = "#") -> int:
    """Offset of the ")" that closes the "(" just before ``pos``, skipping strings and line comments.

    CMake comments start with "#"; C++ asm statements pass ``line_comment=None``.
    """
    depth, quoted = 1, False
    while pos < len(text):
        c = text[pos]
        if quoted:
            if c == "\\":
                pos += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == line_comment:
            pos = text.find("\n", pos)
            if pos < 0:
                break
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return pos
        pos += 1
    raise ValueError(f"unbalanced parentheses after offset {pos}")


_QUOTED = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)"')
_ARCH_COMMANDS = ("cuda_archs_loose_intersection", "list", "set")
# Family targets (12.0f) cover sm_121 from CUDA 13 on: vLLM's CUDA >= 13 branches leave 12.1 out on
# purpose, and adding it there would make pre-0.19 helpers drop the 12.0f kernels entirely.
FAMILY_CUDA = 13.0
UTILS_REGEXES = (
    ("\\([0-9]+\\)\\([0-9]\\)", "\\([0-9]+\\)\\([0-9][af]?\\)"),
    ("compute_\\([0-9]+a?\\)", "compute_\\([0-9]+[af]?\\)"),
    ("sm_\\([0-9]+a?\\)", "sm_\\([0-9]+[af]?\\)"),
)


def _list_var(c: Command) -> str:
    words = c.args.split()
    if c.name == "list" and len(words) > 1:
        return words[1]
    return words[0] if words else "?"


def _add_after(items: list[str], anchor: str, new: str) -> list[str]:
    i = items.index(anchor)
    return [*items[: i + 1], new, *items[i + 1 :]]


Change = tuple[int, int, str, str]  # start, end, new text, note


def _arch_edits(text: str, top_level: bool) -> tuple[str, list[str]]:
    """Return the new text and a note per change, applying edits from the end so offsets hold."""
    changes: list[Change] = []
    for c in cmake_commands(text):
        if c.name in ("if", "elseif") and "MATCHES" in c.args:
            changes += _quoted_edits(c, _widen_match, f"MATCHES 12.0a -> 12.[01][af] (line {c.line})")
            continue
        if c.name not in _ARCH_COMMANDS:
            continue
        var = _list_var(c)
        family_branch = c.cuda_min is not None and c.cuda_min >= FAMILY_CUDA
        if c.name == "set" and var == "CUDA_SUPPORTED_ARCHS":
            if top_level and not family_branch:
                bound = f"CUDA >= {c.cuda_min}" if c.cuda_min else "CUDA branch"
                changes += _quoted_edits(c, _beside("12.0", "12.1"), f"CUDA_SUPPORTED_ARCHS +12.1 ({bound}, line {c.line})")
            continue
        all_items = [i for q in _QUOTED.finditer(c.args) for i in q.group(1).split(";")]
        if "12.0a" not in all_items or "12.1a" in all_items:
            continue
        if family_branch:
            # CUDA >= 13 leaves 12.1 out of the supported list, so 12.1a would be dropped here: the
            # family target is what serves sm_121 (as upstream's lists do from 0.19 on).
            changes += _quoted_edits(c, _to_family, f"{var} 12.0a -> 12.0f (CUDA >= 13, line {c.line})")
        else:
            changes += _quoted_edits(c, _beside("12.0a", "12.1a"), f"{var} +12.1a (line {c.line})")
    for start, end, new, _ in sorted(changes, reverse=True):
        text = text[:start] + new + text[end:]
    return text, [note for *_, note in changes]


def _quoted_edits(c: Command, edit: Callable[[str], str], note: str) -> list[Change]:
    """One change per quoted argument of ``c`` that ``edit`` alters."""
    changes = []
    for q in _QUOTED.finditer(c.args):
        new = edit(q.group(1))
        if new != q.group(1):
            changes.append((c.start + q.start(1), c.start + q.end(1), new, note))
    return changes


def _beside(anchor: str, new: str) -> Callable[[str], str]:
    """Put ``new`` right after ``anchor`` in a ;-list that has the one and not the other."""

    def edit(quoted: str) -> str:
        items = quoted.split(";")
        return ";".join(_add_after(items, anchor, new)) if anchor in items and new not in items else quoted

    return edit


def _to_family(quoted: str) -> str:
    return ";".join("12.0f" if i == "12.0a" else i for i in quoted.split(";"))


# A branch that picks code by `if(X MATCHES "12\\.0a")` must also see the 12.1a and 12.0f the lists now
# hold: in 0.12-0.16 qutlass.cmake otherwise stops the configure ("internal error parsing CUDA_ARCHS").
_MATCH_120A = "12\\\\.0a"
_MATCH_12XA = "12\\\\.[01][af]"


def _widen_match(quoted: str) -> str:
    return quoted.replace(_MATCH_120A, _MATCH_12XA)


def cmake_arch_sm121(overlay: Overlay, folder: Path) -> Outcome:
    """12.1 wherever 12.0 is served: supported list (non-family branches), 12.1a beside 12.0a, regexes."""
    del folder  # the rule carries its whole change
    if not overlay.exists("CMakeLists.txt"):
        return Outcome("not-applicable", "no CMakeLists.txt at the top of the tree")
    edits: list[Edit] = []
    notes: list[str] = []
    for rel in ["CMakeLists.txt", *overlay.find("*.cmake", "cmake")]:
        before = overlay.read(rel)
        after, changes = _arch_edits(before, top_level=rel == "CMakeLists.txt")
        if rel == "cmake/utils.cmake":
            fixed = [old for old, new in UTILS_REGEXES if old in after]
            for old, new in UTILS_REGEXES:
                after = after.replace(old, new)
            changes += ["suffix-keeping regexes"] if fixed else []
        if after != before:
            edits.append(Edit(rel, before, after))
            notes.append(f"{rel}: {', '.join(changes)}")
    if not edits:
        return Outcome("upstream", "every arch list that serves 12.0 already serves 12.1")
    return Outcome("applies", "; ".join(notes), tuple(edits))


# --- E2M1: software conversion beside the hardware instruction --------------------------------

E2M1_HEADER = "nvfp4_utils.cuh"
E2M1_SNIPPET = "e2m1_software.cuh"
E2M1_MARKER = "fp32_to_e2m1_software"
_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")
_GUARD_WORDS = ("__CUDA_ARCH_FAMILY_SPECIFIC__", "__CUDA_ARCH_SPECIFIC__", "__CUDA_ARCH_FEAT_SM", "SPARKBUILD_E2M1_HW")


class RuleConflict(ValueError):
    """A change a rule cannot make on this tree (the code it expects changed); reported as a conflict."""


class AsmError(RuleConflict):
    """An e2m1 asm block this rule cannot translate."""


def e2m1_software(overlay: Overlay, folder: Path) -> Outcome:
    headers = overlay.find(E2M1_HEADER, "csrc")
    if not headers:
        return Outcome("not-applicable", f"no {E2M1_HEADER} under csrc/")
    snippet = (folder / E2M1_SNIPPET).read_text(encoding="utf-8")
    edits: list[Edit] = []
    notes: list[str] = []
    for rel in headers:
        before = overlay.read(rel)
        if E2M1_MARKER in before:
            notes.append(f"{rel}: already has {E2M1_MARKER}")
            continue
        blocks = [b for b in _asm_blocks(before) if "e2m1x2" in before[b[0] : b[1]]]
        open_blocks = [b for b in blocks if not _guarded(before, b[0])]
        if not blocks:
            return Outcome("conflict", f"{rel}: no cvt ... e2m1x2 asm found; the header changed, update the rule")
        if not open_blocks:
            notes.append(f"{rel}: every e2m1x2 asm is already guarded by an arch-specific #if")
            continue
        try:
            after = _insert_snippet(_guard_blocks(before, open_blocks), snippet, rel)
        except AsmError as exc:
            return Outcome("conflict", f"{rel}: {exc}")
        edits.append(Edit(rel, before, after))
        notes.append(f"{rel}: software fallback for {len(open_blocks)} e2m1x2 asm block(s)")
    status: Status = "applies" if edits else "upstream"
    return Outcome(status, "; ".join(notes), tuple(edits))


def _asm_blocks(text: str) -> list[tuple[int, int]]:
    """(start of line, offset after ';') of every asm statement."""
    blocks = []
    for m in _ASM.finditer(text):
        end = _close_c_paren(text, m.end())
        semi = text.index(";", end)
        blocks.append((text.rfind("\n", 0, m.start()) + 1, semi + 1))
    return blocks


def _close_c_paren(text: str, pos: int) -> int:
    try:
        return _close_paren(text, pos, line_comment=None)
    except ValueError:
        raise AsmError("unbalanced parentheses in an asm statement") from None


def _guarded(text: str, offset: int) -> bool:
    """Whether ``offset`` sits inside an #if/#elif that names an arch- or family-specific macro."""
    stack: list[str] = []
    for line in text[:offset].splitlines():
        s = line.strip()
        if re.match(r"#\s*if", s):
            stack.append(s)
        elif re.match(r"#\s*elif", s) and stack:
            stack[-1] = s
        elif re.match(r"#\s*else", s) and stack:
            stack[-1] = "#else"
        elif re.match(r"#\s*endif", s) and stack:
            stack.pop()
    return any(word in cond for cond in stack for word in _GUARD_WORDS)


def _guard_blocks(text: str, blocks: list[tuple[int, int]]) -> str:
    for start, end in sorted(blocks, reverse=True):
        statement = text[start:end]
        if text[start : text.index("asm", start)].strip():
            raise AsmError(f"asm at offset {start} does not start its line")
        indent = statement[: len(statement) - len(statement.lstrip())]
        software = _software_path(statement, indent)
        text = text[:start] + f"#if SPARKBUILD_E2M1_HW\n{statement}\n#else\n{software}\n#endif" + text[end:]
    return text


def _strings(template: str) -> str:
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', template)
    return "".join(parts).replace("\\n", "\n").replace("\\t", " ").replace('\\"', '"')


def _operands(section: str) -> list[tuple[str, str]]:
    found = []
    for m in re.finditer(r'"([=+&]*[a-z])"\s*\(', section):
        close = _close_c_paren(section, m.end())
        found.append((m.group(1), section[m.end() : close].strip()))
    return found


def _split_colons(body: str) -> list[str]:
    parts, depth, quoted, current = [], 0, False, ""
    i = 0
    while i < len(body):
        c = body[i]
        if quoted:
            current += c
            if c == "\\":
                current += body[i + 1]
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted, current = True, current + c
        elif c in "([{":
            depth, current = depth + 1, current + c
        elif c in ")]}":
            depth, current = depth - 1, current + c
        elif c == ":" and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += c
        i += 1
    return [*parts, current]


def _software_path(statement: str, indent: str) -> str:
    """The C++ that computes what the asm's cvt/mov instructions compute, one assignment per output."""
    m = _ASM.search(statement)
    assert m is not None
    body = statement[m.end() : _close_c_paren(statement, m.end())]
    sections = _split_colons(body)
    if len(sections) < 3:
        raise AsmError("e2m1x2 asm without input operands")
    outputs, inputs = _operands(sections[1]), _operands(sections[2])
    operands = [expr for _, expr in outputs + inputs]
    pairs: dict[str, tuple[str, str]] = {}
    lines = []
    for raw in re.split(r"[;\n]", _strings(sections[0])):
        ins = raw.strip()
        if not ins or ins in "{}" or ins.startswith(".reg"):
            continue
        if cvt := re.fullmatch(r"cvt\.rn\.satfinite\.e2m1x2\.f32\s+(\w+)\s*,\s*%(\d+)\s*,\s*%(\d+)", ins):
            # cvt puts its first source in the high nibble and its second in the low one.
            pairs[cvt.group(1)] = (operands[int(cvt.group(2))], operands[int(cvt.group(3))])
        elif mov := re.fullmatch(r"mov\.b(16|32)\s+%(\d+)\s*,\s*\{([^}]*)\}", ins):
            bits, dest = int(mov.group(1)), int(mov.group(2))
            regs = [r.strip() for r in mov.group(3).split(",")]
            if dest >= len(outputs) or any(r not in pairs for r in regs) or len(regs) * 8 != bits:
                raise AsmError(f"cannot translate '{ins}'")
            cast = f"uint{bits}_t"
            terms = [f"(({cast})fp32x2_to_e2m1x2_software({pairs[r][0]}, {pairs[r][1]}) << {8 * i})" for i, r in enumerate(regs)]
            lines.append(f"{indent}{outputs[dest][1]} = ({cast})(" + (f"\n{indent}    | ").join(terms) + ");")
        else:
            raise AsmError(f"cannot translate '{ins}' in an e2m1x2 asm block")
    if not lines:
        raise AsmError("e2m1x2 asm whose result is not moved to an output operand")
    return "\n".join(lines)


def _insert_snippet(text: str, snippet: str, rel: str) -> str:
    """After the last #include that precedes the first namespace, so the snippet sees those headers."""
    first_namespace = text.find("namespace ")
    head = text[: first_namespace if first_namespace >= 0 else len(text)]
    includes = list(re.finditer(r"(?m)^#\s*include[^\n]*\n", head))
    if not includes:
        raise AsmError(f"{rel}: no #include before the first namespace to anchor the software conversion")
    at = includes[-1].end()
    return text[:at] + "\n" + snippet.rstrip("\n") + "\n" + text[at:]


# --- MXFP4 CUTLASS MoE on SM12x -----------------------------------------------------------------

MXFP4_GEMM = "csrc/quantization/fp4/mxfp4_blockwise_moe_kernel.cu"
MXFP4_QUANT = "csrc/quantization/fp4/mxfp4_experts_quant.cu"
MXFP4_SNIPPET = "sm120_group_mm.cuh"
MXFP4_SM120_FN = "run_mxfp4_blockwise_scaled_group_mm_sm120"
_MXFP4_DISPATCH = re.compile(r"template <typename OutType>\s*\nvoid run_mxfp4_blockwise_scaled_group_mm\(")
_SM100_GUARD = "#if defined ENABLE_NVFP4_SM100 && ENABLE_NVFP4_SM100"
_EITHER_GUARD = (
    "#if (defined ENABLE_NVFP4_SM100 && ENABLE_NVFP4_SM100) || \\\n    (defined ENABLE_NVFP4_SM120 && ENABLE_NVFP4_SM120)"
)
_SM120_BRANCH = """#if defined ENABLE_NVFP4_SM120 && ENABLE_NVFP4_SM120
  if (version_num >= 120 && version_num < 130) {
    STD_TORCH_CHECK_NOT_IMPLEMENTED(
        (cute::is_same_v<OutType, cutlass::bfloat16_t>),
        "SM12x cutlass_mxfp4_group_mm supports bfloat16 output only");
    run_mxfp4_blockwise_scaled_group_mm_sm120(
        output, a, b, a_blockscale, b_blockscales, problem_sizes,
        expert_offsets, sf_offsets, M, N, K);
    return;
  }
#endif
"""
_QUANT_GATE = "cuda_device_capability >= 100 && cuda_device_capability < 120"
_QUANT_GATE_SM12X = "cuda_device_capability >= 100 && cuda_device_capability < 130"


def mxfp4_cutlass_sm12x(overlay: Overlay, folder: Path) -> Outcome:
    """An SM120 kernel beside vLLM's SM100-only MXFP4 grouped GEMM, its dispatch, gate and arch list."""
    if not overlay.exists(MXFP4_GEMM):
        return Outcome("not-applicable", f"no {MXFP4_GEMM}: this version has no CUTLASS MXFP4 MoE")
    steps = (
        (MXFP4_GEMM, lambda text: _mxfp4_gemm(text, (folder / MXFP4_SNIPPET).read_text(encoding="utf-8"))),
        (MXFP4_QUANT, _mxfp4_quant_gate),
        ("CMakeLists.txt", _mxfp4_cmake),
    )
    edits: list[Edit] = []
    notes: list[str] = []
    for rel, step in steps:
        if not overlay.exists(rel):
            return Outcome("conflict", f"{rel} is missing beside {MXFP4_GEMM}; the layout changed, update the rule")
        before = overlay.read(rel)
        try:
            after, note = step(before)
        except RuleConflict as exc:
            return Outcome("conflict", f"{rel}: {exc}")
        notes.append(f"{rel}: {note}")
        if after != before:
            edits.append(Edit(rel, before, after))
    status: Status = "applies" if edits else "upstream"
    return Outcome(status, "; ".join(notes), tuple(edits))


def _mxfp4_gemm(text: str, snippet: str) -> tuple[str, str]:
    if MXFP4_SM120_FN in text or "cutlass::arch::Sm120" in text:
        return text, "already has an SM120 kernel"
    found = list(_MXFP4_DISPATCH.finditer(text))
    if len(found) != 1:
        raise RuleConflict(f"expected one run_mxfp4_blockwise_scaled_group_mm dispatch, found {len(found)}")
    at = found[0].start()
    probe = "int32_t version_num = get_sm_version_num();\n"
    branch = text.find(probe, at)
    if branch < 0:
        raise RuleConflict("the dispatch no longer reads get_sm_version_num(); update the rule")
    branch += len(probe)
    tail = text[branch:].replace('"Required capability: 100")', '"Required capability: 100 or 120")', 1)
    # Past the dispatch, the SM100-only guards hide the op itself; the one inside it stays.
    guards = [m.start() for m in re.finditer(re.escape(_SM100_GUARD), tail)]
    outer = [g for g in guards if not tail[g + len(_SM100_GUARD) :].startswith("\n  if (version_num")]
    if not outer:
        raise RuleConflict(f"no '{_SM100_GUARD}' around cutlass_mxfp4_group_mm; update the rule")
    for g in reversed(outer):
        tail = tail[:g] + _EITHER_GUARD + tail[g + len(_SM100_GUARD) :]
    head = text[:at] + snippet + text[at:branch]
    return head + _SM120_BRANCH + tail, f"SM120 grouped GEMM, dispatch for 120-129, {len(outer)} guard(s) widened"


def _mxfp4_quant_gate(text: str) -> tuple[str, str]:
    if _QUANT_GATE_SM12X in text:
        return text, "quant gate already admits SM12x"
    if text.count(_QUANT_GATE) != 1:
        raise RuleConflict(f"expected the gate '{_QUANT_GATE}' once, found it {text.count(_QUANT_GATE)} times")
    return text.replace(_QUANT_GATE, _QUANT_GATE_SM12X), "quant gate admits 120-129"


def _mxfp4_cmake(text: str) -> tuple[str, str]:
    lists = [c for c in cmake_commands(text) if c.name == "set" and c.args.split()[:1] == ["FP4_SM120_SRCS"]]
    if len(lists) != 1:
        raise RuleConflict(f"expected one set(FP4_SM120_SRCS ...), found {len(lists)}")
    c = lists[0]
    missing = [f for f in (MXFP4_QUANT, MXFP4_GEMM) if f'"{f}"' not in c.args]
    if not missing:
        return text, "FP4_SM120_SRCS already builds the MXFP4 sources"
    last = list(_QUOTED.finditer(c.args))[-1]
    indent = c.args[: last.start()].rsplit("\n", 1)[-1]
    added = "".join(f'\n{indent}"{f}"' for f in missing)
    at = c.start + last.end()
    return text[:at] + added + text[at:], f"FP4_SM120_SRCS +{len(missing)} MXFP4 source(s) (line {c.line})"


# --- FlashInfer attention sinks on SM12x -------------------------------------------------------

FI_BACKEND = "vllm/v1/attention/backends/flashinfer.py"
SINKS_MARKER = "sparkbuild flashinfer-sinks-sm12x"


@dataclass(frozen=True)
class Region:
    """One anchored change of ``find`` into ``replace``. ``find`` must occur exactly once; with ``before``,
    the last occurrence ahead of the first ``before`` is the one changed (a text that repeats)."""

    name: str
    find: str
    replace: str
    before: str | None = None


def apply_regions(text: str, regions: tuple[Region, ...]) -> str:
    for r in regions:
        end = len(text) if r.before is None else text.find(r.before)
        if r.before is not None and end < 0:
            raise RuleConflict(f"region '{r.name}': {r.before.strip()!r} not found; update the rule")
        head = text[:end]
        count = head.count(r.find)
        if r.before is None and count != 1:
            raise RuleConflict(f"region '{r.name}': expected {r.find.strip().splitlines()[0]!r} once, found it {count} times")
        if count == 0:
            raise RuleConflict(f"region '{r.name}': {r.find.strip().splitlines()[0]!r} not found; update the rule")
        at = head.rfind(r.find)
        text = text[:at] + r.replace + text[at + len(r.find) :]
    return text


def flashinfer_sinks_sm12x(overlay: Overlay, folder: Path) -> Outcome:
    """Upstream's SM12x sink path, backported: XQA decode takes the sinks, the sink wrapper prefills."""
    if not overlay.exists(FI_BACKEND):
        return Outcome("not-applicable", f"no {FI_BACKEND} in this layout")
    before = overlay.read(FI_BACKEND)
    if SINKS_MARKER in before:
        return Outcome("upstream", f"{FI_BACKEND} already has the SM12x sink path")
    regions = _sink_regions((folder / SINKS_HELPER).read_text(encoding="utf-8"))
    try:
        after = apply_regions(before, regions)
    except RuleConflict as exc:
        return Outcome("conflict", f"{FI_BACKEND}: {exc}")
    names = ", ".join(r.name for r in regions)
    return Outcome("applies", f"{FI_BACKEND}: {names}", (Edit(FI_BACKEND, before, after),))


SINKS_HELPER = "sm12x_sinks.py"
_PLAIN_PREFILL = """                self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(
                    self._get_workspace_buffer(), get_kv_cache_layout()
                )
"""
_RUN = """                    prefill_wrapper.run(
                        prefill_query,
                        kv_cache_permute,
                        k_scale=layer._k_scale_float,
                        v_scale=layer._v_scale_float,
                        out=output[num_decode_tokens:],
                    )
"""
_HND = """                # This path needs to be enabled with VLLM_KV_CACHE_LAYOUT = HND
                assert get_kv_cache_layout() == "HND"
"""
_DECODE_END = """                    q_len_per_req=q_len_per_req,
                )
"""


def _sink_regions(helper: str) -> tuple[Region, ...]:
    tag = f"# {SINKS_MARKER}"
    return (
        Region("import", "from flashinfer import (\n", "from flashinfer import (\n    BatchAttentionWithAttentionSinkWrapper,\n"),
        Region(
            "helper", "logger = init_logger(__name__)\n", "logger = init_logger(__name__)\n\n\n" + helper.rstrip("\n") + "\n\n"
        ),
        Region(
            "supports_sink",
            "        return supports_trtllm_attention()\n",
            f"        {tag}: XQA decode and the sink prefill wrapper serve SM12x.\n"
            "        return supports_trtllm_attention() or sparkbuild_sm12x_sinks()\n",
        ),
        Region(
            "builder",
            "        if self.has_sinks and not can_use_trtllm:\n",
            f"        {tag}: on SM12x, decode through FlashInfer's XQA kernel and\n"
            "        # prefill through BatchAttentionWithAttentionSinkWrapper (bf16/fp16 KV only).\n"
            "        self.sinks_on_sm12x = (\n"
            "            self.has_sinks\n"
            "            and not can_use_trtllm\n"
            "            and sparkbuild_sm12x_sinks()\n"
            "            and self.num_qo_heads % self.num_kv_heads == 0\n"
            '            and not self.cache_dtype.startswith("fp8")\n'
            "        )\n"
            "        if self.sinks_on_sm12x:\n"
            "            self.use_trtllm_decode_attention = True\n"
            "        if self.has_sinks and not can_use_trtllm and not self.sinks_on_sm12x:\n",
        ),
        Region(
            "build",
            "            if self.has_sinks:\n",
            f"            {tag}: the sink wrapper prefills; decodes must be XQA.\n"
            "            if self.has_sinks and not (self.sinks_on_sm12x and decode_use_trtllm):\n",
        ),
        Region(
            "prefill wrapper",
            _PLAIN_PREFILL,
            f"                if self.sinks_on_sm12x:  {tag}\n"
            "                    self._prefill_wrapper = BatchAttentionWithAttentionSinkWrapper(\n"
            "                        self._get_workspace_buffer(),\n"
            "                        get_kv_cache_layout(),\n"
            '                        backend="fa2",\n'
            "                        q_data_type=self.q_data_type,\n"
            "                        kv_data_type=self.kv_cache_dtype,\n"
            "                        head_dim_qk=self.head_dim,\n"
            "                        head_dim_vo=self.head_dim,\n"
            "                        window_left=self.window_left,\n"
            "                    )\n"
            "                else:\n" + textwrap.indent(_PLAIN_PREFILL, "    "),
        ),
        Region(
            "prefill run",
            _RUN,
            "                    if isinstance(prefill_wrapper, BatchAttentionWithAttentionSinkWrapper):\n"
            f"                        {tag}: the AttentionSink variant takes the\n"
            "                        # sinks and its softmax scale as extra arguments.\n"
            "                        prefill_wrapper.run(\n"
            "                            prefill_query,\n"
            "                            kv_cache_permute,\n"
            "                            self.sinks,\n"
            "                            self.scale * layer._k_scale_float,\n"
            "                            v_scale=layer._v_scale_float,\n"
            "                            out=output[num_decode_tokens:],\n"
            "                        )\n"
            "                    else:\n" + textwrap.indent(_RUN, "    "),
        ),
        Region(
            "decode layout",
            _HND,
            f"                {tag}: XQA reads the cache in the layout given below.\n"
            '                assert get_kv_cache_layout() == "HND" or sparkbuild_sm12x_sinks()\n',
            _DECODE_END,
        ),
        Region(
            "decode call",
            _DECODE_END,
            _DECODE_END.replace(
                "\n                )", "\n                    kv_layout=get_kv_cache_layout(),\n                )"
            ),
        ),
    )


RULES: dict[str, Rule] = {
    "cmake-arch-sm121": cmake_arch_sm121,
    "e2m1-software": e2m1_software,
    "mxfp4-cutlass-sm12x": mxfp4_cutlass_sm12x,
    "flashinfer-sinks-sm12x": flashinfer_sinks_sm12x,
}
