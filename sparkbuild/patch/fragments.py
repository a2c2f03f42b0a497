"""Upstream code a rule splices into a tree, kept as files in the patch's folder, not as strings.

A fragment file holds named sections: a line ``# === name ===`` (``// === name ===`` in C++)
starts one, and it runs to the next such line. Sections are written at column 0; the rule indents
them where they go. ``$word`` (``string.Template``) marks what the rule fills in from the tree;
a ``$word`` alone on its line takes a block of lines (such as the statement a fragment wraps),
each indented as far as the ``$word`` is.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from string import Template

from sparkbuild.errors import PatchError

_SECTION = re.compile(r"^(?:#|//) === ([A-Za-z0-9_.-]+) ===[ \t]*$", re.MULTILINE)


def read(path: Path) -> dict[str, str]:
    """Every section of ``path``, by name; text before the first section is the file's own comment."""
    text = path.read_text(encoding="utf-8")
    marks = list(_SECTION.finditer(text))
    if not marks:
        raise PatchError(f"{path}: no '# === name ===' section; a fragment file names each piece of code it holds")
    sections: dict[str, str] = {}
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        body = text[mark.end() + 1 : following.start() if following else len(text)]
        if mark.group(1) in sections:
            raise PatchError(f"{path}: section '{mark.group(1)}' appears twice")
        sections[mark.group(1)] = body.rstrip("\n") + "\n"
    return sections


_BLOCK = re.compile(r"^([ \t]*)\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?[ \t]*$", re.MULTILINE)


def fill(section: str, indent: str = "", **values: str) -> str:
    """``section`` with its ``$words`` replaced and every non-empty line indented by ``indent``.

    Values are given at column 0 (``textwrap.dedent``-ed); a block value takes its placeholder's indent.
    """

    def block(m: re.Match[str]) -> str:
        return textwrap.indent(values[m.group(2)].rstrip("\n"), m.group(1), _non_empty)

    # Blocks first, escaped so the inline pass leaves their own "$" alone.
    text = _BLOCK.sub(lambda m: block(m).replace("$", "$$"), section)
    return textwrap.indent(Template(text).substitute(values), indent, _non_empty)


def _non_empty(line: str) -> bool:
    return bool(line.strip())


_WORD = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*)|(\$))")


def pattern(section: str) -> re.Pattern[str]:
    """A regex that finds ``section`` as ``fill`` writes it, at any indentation, each ``$word``
    standing for whatever the tree gave it: a block ``$word`` for one or more lines indented at
    least as far, an inline one for any text on its line. How a rule tells its change is there."""
    parts: list[str] = []
    for number, line in enumerate(section.rstrip("\n").split("\n")):
        lead = "^(?P<indent>[ \t]*)" if number == 0 else "^(?P=indent)"
        if not line.strip():
            parts.append(r"[ \t]*\n")
        elif block := _BLOCK.fullmatch(line):
            inner = lead + re.escape(block.group(1))
            parts.append(rf"{inner}\S.*\n(?:{inner}.*\n)*")
        else:
            indent = line[: len(line) - len(line.lstrip())]
            pieces = _WORD.split(line.strip())
            # split gives: text, then the three groups of each $word (a name, or "$" for "$$"), text, ...
            body = ""
            for i in range(0, len(pieces), 4):
                body += re.escape(pieces[i])
                if i + 3 < len(pieces):
                    body += re.escape("$") if pieces[i + 3] else ".+?"
            parts.append(rf"{lead}{re.escape(indent)}{body}[ \t]*\n")
    return re.compile("".join(parts), re.MULTILINE)
