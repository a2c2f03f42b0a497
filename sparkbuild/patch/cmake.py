"""A small CMake reader: top-of-line commands with their arguments, line, and the lower bound the
``if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL X)`` branches around them put on CUDA."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from sparkbuild.patch.source import close_paren


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    start: int  # offset of the "(" + 1
    end: int  # offset of the ")"
    line: int
    cuda_min: float | None  # lower bound on CMAKE_CUDA_COMPILER_VERSION in the branch, if any

    def quoted(self) -> list[str]:
        """The items of every quoted argument (``"a;b" "c"`` gives a, b, c)."""
        return [i for q in QUOTED.finditer(self.args) for i in q.group(1).split(";")]


QUOTED = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)"')
_CMD_START = re.compile(r"(?m)^[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*\(")
_CUDA_GE = re.compile(r"CMAKE_CUDA_COMPILER_VERSION\}?\s+VERSION_GREATER_EQUAL\s+(\d+\.\d+)")


def commands(text: str) -> Iterator[Command]:
    """Top-of-line commands with their argument text and CUDA lower bound, skipping comments."""
    stack: list[float | None] = []  # bound of the current branch of each open if()
    pos = line = counted = 0
    while m := _CMD_START.search(text, pos):
        if _in_comment(text, m.start(1)):
            pos = text.index("\n", m.end()) if "\n" in text[m.end() :] else len(text)
            continue
        end = close_paren(text, m.end())
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
        line += text.count("\n", counted, m.start(1))  # lines counted once, as the scan moves on
        counted = m.start(1)
        yield Command(name, args, m.end(), end, line + 1, max(bounds) if bounds else None)
        pos = end + 1


def _in_comment(text: str, offset: int) -> bool:
    line_start = text.rfind("\n", 0, offset) + 1
    return "#" in text[line_start:offset]


def line_start(text: str, offset: int) -> int:
    """Offset of the start of the line that holds ``offset``."""
    return text.rfind("\n", 0, offset) + 1


def comment_before(text: str, offset: int, comment: str) -> tuple[int, str]:
    """An insertion (offset, text) putting ``# comment`` on its own line above the line of ``offset``,
    indented like it: CMake allows a comment line between any two commands."""
    start = line_start(text, offset)
    indent = re.match(r"[ \t]*", text[start:]).group(0)  # type: ignore[union-attr]
    return start, f"{indent}# {comment}\n"
