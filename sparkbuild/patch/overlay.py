"""What every patch works on and what it says: the overlay of a tree, an edit, a status.

A patch reads the tree through an ``Overlay`` (the source plus what earlier patches changed) and
returns an ``Outcome``: its status, a one-line detail, and the file edits. It never writes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sparkbuild.errors import ConfigError

# applies: the change is needed and can be made. applied: sparkbuild's own change is already in
# the tree (an earlier apply). upstream: vLLM itself has the fix. not-applicable: outside the
# patch's versions, another component, or nothing in this layout to change. conflict: the code
# the patch expects changed; the detail names the file and what is missing.
Status = Literal["applies", "applied", "upstream", "not-applicable", "conflict"]
STATUSES: tuple[Status, ...] = ("applies", "applied", "upstream", "not-applicable", "conflict")


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
    # Where the change already is (``applied``): the files a build compiles with the patch in them.
    files: tuple[str, ...] = ()


class RuleConflict(ValueError):
    """A change a rule cannot make on this tree (the code it expects changed); reported as a conflict."""


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
        # Bytes decoded as they are (newline="" semantics), so CRLF files keep their line ends.
        return self.at(rel).read_bytes().decode("utf-8")

    def write(self, rel: str, text: str) -> None:
        self.at(rel)
        self.changed[rel] = text

    def find(self, name: str, under: str = ".") -> list[str]:
        """Files called ``name`` (a glob) below ``under``, as sorted paths relative to the root."""
        base = self.root / under
        found = {p.relative_to(self.root).as_posix() for p in base.rglob(name) if p.is_file()} if base.is_dir() else set()
        found |= {rel for rel in self.changed if Path(rel).match(name) and rel.startswith(under.rstrip("/") + "/")}
        return sorted(found)

    def materialize(self, rel: str, dest_root: Path) -> None:
        dest = dest_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(self.read(rel).encode("utf-8"))

    def commit(self) -> tuple[str, ...]:
        """Write every changed file (each through a temporary file and a rename); returns their paths."""
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


# A rule: the overlay, and the patch's folder (its fragments) -> what it would do.
Rule = Callable[[Overlay, Path], Outcome]


def settle(name: str, edits: list[Edit], notes: list[str], marker_files: list[str], nothing_to_do: str) -> Outcome:
    """The outcome of a rule that looked at every file it changes, judged by content.

    The rule computes its edits from what the tree holds, so an edit left to make is a part of the
    change that is missing. In a file that carries the rule's own marker, that is an error (the
    file says the change is there and it is not: a hand edit, a half copy, a marker pasted in):
    ``conflict``, naming the file. Edits left elsewhere: ``applies``. None, and some file carries
    the marker: ``applied``, with those files. None and no marker: upstream has the fix.
    """
    for edit in edits:
        if edit.path in marker_files:
            said = [n.removeprefix(f"{edit.path}: ") for n in notes if n.startswith(f"{edit.path}: ")]
            return Outcome("conflict", marker_without_change(edit.path, name, "; ".join(said) or "an edit left to make"))
    if edits:
        return Outcome("applies", "; ".join(notes), tuple(edits))
    if marker_files:
        return Outcome("applied", f"sparkbuild's {name} is in {', '.join(marker_files)}", files=tuple(marker_files))
    return Outcome("upstream", nothing_to_do)


def judged(path: str, judge: Callable[[], Outcome]) -> Outcome:
    """``judge()``, with the two ways a rule finds a Python file it cannot change (it does not parse,
    or the rule raised ``RuleConflict``) reported as a conflict naming ``path``."""
    try:
        return judge()
    except SyntaxError as exc:
        return Outcome("conflict", f"{path}: does not parse as Python (line {exc.lineno})")
    except RuleConflict as exc:
        return Outcome("conflict", f"{path}: {exc}")


def marker_without_change(path: str, name: str, missing: str) -> str:
    """The detail of a file that carries a patch's marker but not (all of) its change."""
    return (
        f"{path}: carries sparkbuild's {name} marker but not its change ({missing}); the file was edited "
        "after the patch, or the marker was copied into it: check the tree out again"
    )
