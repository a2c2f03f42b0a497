"""cmake-arch-sm121: 12.1 wherever vLLM's CMake serves 12.0, so the SM12x kernels get code that runs
on sm_121. Patterns, not lines: the supported list (on branches family targets do not cover),
12.1a beside every 12.0a, suffix-keeping regexes in cmake/utils.cmake, widened arch MATCHES.

Each changed command gets a ``# sparkbuild cmake-arch-sm121: ...`` comment line above it: it tells
a reader why, and tells a later check that the change is sparkbuild's own (``applied``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sparkbuild.patch import cmake
from sparkbuild.patch.overlay import Edit, Outcome, Overlay, RuleConflict, settle

NAME = "cmake-arch-sm121"
MARKER = f"# sparkbuild {NAME}"
# What the rule reads: the top CMakeLists.txt and every .cmake file under cmake/.
READS = ("CMakeLists.txt", "cmake/**/*.cmake")
WRITES = READS

_ARCH_COMMANDS = ("cuda_archs_loose_intersection", "list", "set")
# Family targets (12.0f) cover sm_121 from CUDA 13 on: vLLM's CUDA >= 13 branches leave 12.1 out on
# purpose, and adding it there would make pre-0.19 helpers drop the 12.0f kernels entirely.
FAMILY_CUDA = 13.0
UTILS = "cmake/utils.cmake"
UTILS_REGEXES = (
    ("\\([0-9]+\\)\\([0-9]\\)", "\\([0-9]+\\)\\([0-9][af]?\\)"),
    ("compute_\\([0-9]+a?\\)", "compute_\\([0-9]+[af]?\\)"),
    ("sm_\\([0-9]+a?\\)", "sm_\\([0-9]+[af]?\\)"),
)
# A branch that picks code by `if(X MATCHES "12\\.0a")` must also see the 12.1a and 12.0f the lists now
# hold: in 0.12-0.16 qutlass.cmake otherwise stops the configure ("internal error parsing CUDA_ARCHS").
_MATCH_120A = "12\\\\.0a"
_MATCH_12XA = "12\\\\.[01][af]"

# (start, end, new text) of one replacement; an insertion has start == end.
Change = tuple[int, int, str]


def run(overlay: Overlay, folder: Path) -> Outcome:
    del folder  # the rule carries its whole change
    if not overlay.exists("CMakeLists.txt"):
        return Outcome("not-applicable", "no CMakeLists.txt at the top of the tree")
    edits: list[Edit] = []
    notes: list[str] = []
    marked: list[str] = []
    for rel in ["CMakeLists.txt", *overlay.find("*.cmake", "cmake")]:
        before = overlay.read(rel)
        if MARKER in before:
            marked.append(rel)
        try:
            after, changes = edit_file(before, top_level=rel == "CMakeLists.txt", utils=rel == UTILS)
        except RuleConflict as exc:
            return Outcome("conflict", f"{rel}: {exc}")
        if after != before:
            edits.append(Edit(rel, before, after))
            notes.append(f"{rel}: {', '.join(changes)}")
    return settle(NAME, edits, notes, marked, "every arch list that serves 12.0 already serves 12.1")


def needed(tree: Path, cuda: str, arch_list: str) -> tuple[bool, str]:
    """Needed where, unpatched, vLLM's own CMake helpers leave a kernel list that serves SM12x
    without code that runs on sm_121 for this CUDA version and arch list (run with cmake)."""
    from sparkbuild.patch import archs  # needs cmake: the table's, never the container's

    bad = archs.unrunnable(tree, float(cuda), arch_list)
    if not bad:
        return False, f"vLLM's own arch helpers give every SM12x kernel list code that runs on sm_121 with CUDA {cuda}"
    said = ", ".join(f"{key} gives {'/'.join(got) or 'nothing'}" for key, got in bad.items())
    return True, f"unpatched, with CUDA {cuda}: {said}"


def edit_file(text: str, top_level: bool, utils: bool) -> tuple[str, list[str]]:
    """The new text and a note per changed command; edits go from the end so offsets hold."""
    changes: list[Change] = []
    notes: list[str] = []
    for c in cmake.commands(text):
        found, note = _command_changes(c, top_level, utils)
        if found:
            at, comment = cmake.comment_before(text, c.start, f"{MARKER[2:]}: {note}")
            changes += [*found, (at, at, comment)]
            notes.append(f"{note} (line {c.line})")
    for start, end, new in sorted(changes, reverse=True):
        text = text[:start] + new + text[end:]
    return text, notes


def _command_changes(c: cmake.Command, top_level: bool, utils: bool) -> tuple[list[Change], str]:
    if c.name in ("if", "elseif") and "MATCHES" in c.args:
        return _quoted_edits(c, lambda q: q.replace(_MATCH_120A, _MATCH_12XA)), "MATCHES 12.0a -> 12.[01][af]"
    if utils and c.name == "string":
        return _regex_edits(c), "suffix-keeping regex"
    if c.name not in _ARCH_COMMANDS:
        return [], ""
    var = _list_var(c)
    family_branch = c.cuda_min is not None and c.cuda_min >= FAMILY_CUDA
    if c.name == "set" and var == "CUDA_SUPPORTED_ARCHS":
        if top_level and not family_branch:
            bound = f"CUDA >= {c.cuda_min}" if c.cuda_min else "CUDA branch"
            return _quoted_edits(c, _beside("12.0", "12.1")), f"CUDA_SUPPORTED_ARCHS +12.1 ({bound})"
        return [], ""
    items = c.quoted()
    if "12.0a" not in items or "12.1a" in items:
        return [], ""
    if family_branch:
        # CUDA >= 13 leaves 12.1 out of the supported list, so 12.1a would be dropped here: the
        # family target is what serves sm_121 (as upstream's lists do from 0.19 on).
        return _quoted_edits(c, _to_family), f"{var} 12.0a -> 12.0f (CUDA >= 13)"
    return _quoted_edits(c, _beside("12.0a", "12.1a")), f"{var} +12.1a"


def _list_var(c: cmake.Command) -> str:
    words = c.args.split()
    if c.name == "list" and len(words) > 1:
        return words[1]
    return words[0] if words else "?"


def _quoted_edits(c: cmake.Command, edit: Callable[[str], str]) -> list[Change]:
    """One change per quoted argument of ``c`` that ``edit`` alters."""
    changes = []
    for q in cmake.QUOTED.finditer(c.args):
        new = edit(q.group(1))
        if new != q.group(1):
            changes.append((c.start + q.start(1), c.start + q.end(1), new))
    return changes


def _regex_edits(c: cmake.Command) -> list[Change]:
    def edit(quoted: str) -> str:
        for old, new in UTILS_REGEXES:
            quoted = quoted.replace(old, new)
        return quoted

    return _quoted_edits(c, edit)


def _beside(anchor: str, new: str) -> Callable[[str], str]:
    """Put ``new`` right after ``anchor`` in a ;-list that has the one and not the other."""

    def edit(quoted: str) -> str:
        items = quoted.split(";")
        if anchor not in items or new in items:
            return quoted
        at = items.index(anchor) + 1
        return ";".join([*items[:at], new, *items[at:]])

    return edit


def _to_family(quoted: str) -> str:
    return ";".join("12.0f" if i == "12.0a" else i for i in quoted.split(";"))
