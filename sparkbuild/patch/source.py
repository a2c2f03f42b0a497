"""Reading and changing source text the same way in every rule: balanced parentheses, and anchored
regions that must be found exactly where the rule expects them (else: a conflict naming them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sparkbuild.patch.overlay import RuleConflict

_SIGNIFICANT = {"#": re.compile(r'[()"\\#\n]'), None: re.compile(r'[()"\\]')}


def close_paren(text: str, pos: int, line_comment: str | None = "#") -> int:
    """Offset of the ")" that closes the "(" just before ``pos``, skipping strings and line comments.

    CMake and Python comments start with "#"; C++ asm statements pass ``line_comment=None``.
    Jumps from one character that matters to the next (a regex scan), not character by character.
    """
    significant = _SIGNIFICANT[line_comment]
    depth, quoted, in_comment = 1, False, False
    skip_to = pos
    for m in significant.finditer(text, pos):
        at, c = m.start(), m.group()
        if at < skip_to:
            continue  # the character after a backslash
        if in_comment:
            in_comment = c != "\n"
        elif quoted:
            if c == "\\":
                skip_to = at + 2
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == line_comment:
            in_comment = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return at
    raise RuleConflict(f"unbalanced parentheses after offset {pos}")


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


def line_layout(line: str) -> tuple[str, str]:
    """A line's leading indent and its line ending (``\n``, ``\r\n`` or none): what a rule's new
    lines copy so they sit in the file as its own do."""
    return line[: len(line) - len(line.lstrip())], line[len(line.rstrip("\r\n")) :]
