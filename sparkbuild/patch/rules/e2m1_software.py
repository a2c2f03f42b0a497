"""e2m1-software: a software E2M1 (FP4) conversion beside every ``cvt.rn.satfinite.e2m1x2.f32`` asm
that no arch-specific ``#if`` guards, so plain sm_121, compute_12x PTX and other GPUs compile.

The conversion lives in ``nvfp4_utils.cuh`` (found by name: it moved to ``csrc/libtorch_stable/``
in 0.20 and back in 0.32; patch.yaml says why releases before it are left alone). Each asm block
becomes ``#if SPARKBUILD_E2M1_HW`` (the instruction) / ``#else`` (the same codes computed by
``fp32x2_to_e2m1x2_software``, translated from the asm's own operands).
"""

from __future__ import annotations

import re
from pathlib import Path

from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, marker_without_change, settle
from sparkbuild.patch.source import close_paren

NAME = "e2m1-software"
HEADER = "nvfp4_utils.cuh"
SNIPPET = "e2m1_software.cuh"
MARKER = "sparkbuild e2m1-software"
READS = (f"csrc/**/{HEADER}",)
WRITES = READS
HW_GUARD = "SPARKBUILD_E2M1_HW"

_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")
_GUARD_WORDS = ("__CUDA_ARCH_FAMILY_SPECIFIC__", "__CUDA_ARCH_SPECIFIC__", "__CUDA_ARCH_FEAT_SM", HW_GUARD)
# A block as _guard_blocks writes it: the asm statement (group 1), then its software path.
_GUARDED = re.compile(rf"#if {HW_GUARD}\n(.*?)\n#else\n.*?\n#endif", re.DOTALL)


class AsmError(RuleConflict):
    """An e2m1 asm block this rule cannot translate."""


def run(overlay: Overlay, folder: Path) -> Outcome:
    targets = overlay.find(HEADER, "csrc")
    if not targets:
        return Outcome("not-applicable", f"no {HEADER} under csrc/")
    snippet = (folder / SNIPPET).read_text(encoding="utf-8")
    edits: list[Edit] = []
    notes: list[str] = []
    marked: list[str] = []
    for rel in targets:
        before = overlay.read(rel)
        if MARKER in before or HW_GUARD in before:
            # Judged by content: the file must be exactly what this rule makes of the file it came from.
            problem = _differs(before, snippet, rel)
            if problem is not None:
                return Outcome("conflict", marker_without_change(rel, NAME, problem))
            marked.append(rel)
            continue
        blocks = [b for b in asm_blocks(before) if "e2m1x2" in before[b[0] : b[1]]]
        open_blocks = [b for b in blocks if not _guarded(before, b[0])]
        if not blocks:
            return Outcome("conflict", f"{rel}: no cvt ... e2m1x2 asm found; the header changed, update the rule")
        if not open_blocks:
            notes.append(f"{rel}: every e2m1x2 asm is already guarded by an arch-specific #if")
            continue
        try:
            after = patched(before, open_blocks, snippet, rel)
        except AsmError as exc:
            return Outcome("conflict", f"{rel}: {exc}")
        edits.append(Edit(rel, before, after))
        notes.append(f"{rel}: software fallback for {len(open_blocks)} e2m1x2 asm block(s)")
    return settle(NAME, edits, notes, marked, "; ".join(notes))


def needed(tree: Path, cuda: str, arch_list: str) -> tuple[bool, str]:
    """Needed only where a Blackwell target in the arch list is plain (``12.1``) or PTX (``+PTX``):
    ptxas has ``cvt.rn.satfinite.e2m1x2.f32`` for arch- and family-specific targets alone. With an
    ``a``/``f`` target the FP4 units get sm_121a / sm_120f code (vLLM keeps the suffix from 0.19.0,
    PR #37725; cmake-arch-sm121 before), where the hardware conversion assembles and this rule
    would keep it. The tree does not change that."""
    del tree, cuda
    plain = [
        e
        for e in arch_list.replace(";", " ").split()
        if e.endswith("+PTX") or (not e.endswith(("a", "f")) and float(e.removesuffix("+PTX")) >= 10.0)
    ]
    if plain:
        return True, f"the arch list has {', '.join(plain)}: plain or PTX targets, where ptxas has no cvt ... e2m1x2"
    return False, (
        f"the arch list {arch_list} is arch-specific: the FP4 units get sm_121a / sm_120f code, where the hardware "
        "conversion assembles (the arch suffix kept: PR #37725, or cmake-arch-sm121)"
    )


def patched(text: str, open_blocks: list[tuple[int, int]], snippet: str, rel: str) -> str:
    """``text`` with each open e2m1x2 asm block under ``#if SPARKBUILD_E2M1_HW`` and the software
    conversion inserted after the includes."""
    return _insert_snippet(_guard_blocks(text, open_blocks), snippet, rel)


def _differs(text: str, snippet: str, rel: str) -> str | None:
    """What keeps ``text`` (a file with the rule's marker or guard) from being this rule's own
    output; None when it is. The file it came from is recovered by undoing the change (the
    snippet taken out, each guarded block back to its asm), patched again, and compared."""
    inserted = "\n" + snippet.rstrip("\n") + "\n"
    if inserted not in text:
        return f"the software conversion of patches/e2m1-software/{SNIPPET} is not in it"
    original = _GUARDED.sub(r"\1", text.replace(inserted, "", 1))
    blocks = [b for b in asm_blocks(original) if "e2m1x2" in original[b[0] : b[1]]]
    open_blocks = [b for b in blocks if not _guarded(original, b[0])]
    guarded = text.count(f"#if {HW_GUARD}\n")
    if len(open_blocks) != guarded:
        return f"{guarded} of {len(open_blocks)} e2m1x2 asm block(s) have the software fallback"
    try:
        expected = patched(original, open_blocks, snippet, rel)
    except AsmError as exc:
        return str(exc)
    if expected != text:
        pairs = zip([*expected.splitlines(), ""], [*text.splitlines(), ""], strict=False)
        line = next(i for i, (a, b) in enumerate(pairs, 1) if a != b)
        return f"line {line} is not what the patch writes"
    return None


def asm_blocks(text: str) -> list[tuple[int, int]]:
    """(start of line, offset after ';') of every asm statement."""
    blocks = []
    for m in _ASM.finditer(text):
        end = _close_c_paren(text, m.end())
        semi = text.index(";", end)
        blocks.append((text.rfind("\n", 0, m.start()) + 1, semi + 1))
    return blocks


def _close_c_paren(text: str, pos: int) -> int:
    try:
        return close_paren(text, pos, line_comment=None)
    except RuleConflict:
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
        text = text[:start] + f"#if {HW_GUARD}\n{statement}\n#else\n{software}\n#endif" + text[end:]
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
    """The sections of an asm statement (template, outputs, inputs, clobbers), split at top-level colons."""
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
            # Qualified, so the call resolves wherever the converting function sits.
            terms = [
                f"(({cast})vllm::fp32x2_to_e2m1x2_software({pairs[r][0]}, {pairs[r][1]}) << {8 * i})" for i, r in enumerate(regs)
            ]
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
