"""Two builds of one target side by side: every path that differs and why, every wheel member and
ELF symbol table, every installed package, the image's configuration.

Pure: it reads two inventories (``inventory``) and, for a file whose content differs, its two copies
(``explain``), so it is tested without Docker. A difference of modification time alone is not one:
such paths are counted apart (``mtime_only``). Every other difference is named with its cause, the
first that fits of ``CAUSES``.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
import struct
import zipfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sparkbuild.build.inventory import (
    ELF_MAGIC,
    ZIP_MAGIC,
    Entry,
    Inventory,
    Member,
    Package,
    Symbols,
    Wheel,
    elf_sections,
    elf_symbols,
)

# Each cause, in the words the report uses. The order is the report's.
CAUSES: dict[str, str] = {
    "build-time": "holds the time of the build: a date or time that differs between the two builds",
    "random-id": "holds a name made at random during the build (a UUID, a temporary folder's name)",
    "pyc-mtime": "a .pyc whose header holds its source file's mtime (timestamp invalidation, pip's default); same code",
    "pyc-code": "a .pyc whose code differs",
    "record": "a RECORD of installed or packed files: it holds each file's hash, so it differs with the files it names",
    "log": "a log under /var/log: the time of each entry",
    "ldconfig-cache": "ldconfig's auxiliary cache, keyed by each library's inode and change time",
    "elf-symbols": "an ELF file whose defined dynamic symbols differ",
    "elf-sections": "an ELF file with the same defined dynamic symbols whose other bytes differ (the sections named)",
    "zip-times": "a zip (a wheel) whose members are the same but for the time the zip records for each",
    "zip-members": "a zip (a wheel) whose members differ",
    "only-first": "in the first build only",
    "only-second": "in the second build only",
    "kind": "another kind of file (file, folder, link)",
    "mode": "another mode",
    "owner": "another owner",
    "link": "a link to another target",
    "content": "other content (not explained: see the two copies)",
}
# Content causes ``explain`` refines by reading the two copies.
UNEXPLAINED = ("content",)
SHOWN = 5

_TIME = re.compile(
    rb"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}:\d{2}|(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d{4}|\b1[6-9]\d{8}\b"
)
_RANDOM = re.compile(
    rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|/tmp/[\w.-]*?[A-Za-z0-9_]{8}|\b[0-9a-f]{32}\b"
)
_STRING = re.compile(rb"[\x20-\x7e]{4,}")


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One path that differs: in what (``aspects``: content, kind, mode, owner, link), why
    (``cause``, a key of CAUSES), what each build has, and what explains it (``detail``)."""

    path: str
    cause: str
    aspects: tuple[str, ...] = ()
    first: Mapping[str, Any] | None = None
    second: Mapping[str, Any] | None = None
    detail: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        found = {
            "path": self.path,
            "cause": self.cause,
            "aspects": list(self.aspects),
            "first": self.first,
            "second": self.second,
        }
        if self.detail:
            found["detail"] = self.detail
        return {**found, **self.extra}

    def line(self) -> str:
        return f"{self.path}" + (f": {self.detail}" if self.detail else "")


def grouped(differences: Iterable[Difference]) -> dict[str, list[Difference]]:
    """Differences by cause, in CAUSES' order."""
    groups: dict[str, list[Difference]] = {}
    for d in differences:
        groups.setdefault(d.cause, []).append(d)
    return {cause: groups[cause] for cause in CAUSES if cause in groups}


def grouped_json(differences: Iterable[Difference]) -> dict[str, list[dict[str, Any]]]:
    """``grouped`` as the JSON report writes it."""
    return {cause: [d.to_json() for d in items] for cause, items in grouped(differences).items()}


def group_lines(differences: Iterable[Difference], shown: int = SHOWN) -> list[str]:
    """Each cause with its count and its first ``shown`` paths (the JSON has them all)."""
    lines = []
    for cause, items in grouped(differences).items():
        lines.append(f"{cause} ({len(items)}): {CAUSES[cause]}")
        lines += [f"  {d.line()}" for d in items[:shown]]
        if len(items) > shown:
            lines.append(f"  ... {len(items) - shown} more")
    return lines


# --- file systems -----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Files:
    """Two file systems compared path by path."""

    compared: int
    identical: int
    # Paths that differ in their modification time alone: files and links first, then folders.
    mtime_only: list[str]
    mtime_folders: int
    differences: list[Difference]

    @property
    def matches(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "identical": self.identical,
            "mtime_only": {"count": len(self.mtime_only), "folders": self.mtime_folders, "paths": self.mtime_only},
            "differences": grouped_json(self.differences),
        }

    def lines(self) -> list[str]:
        head = f"{self.compared} path(s): {self.identical} identical, {len(self.mtime_only)} differ in mtime only"
        if self.mtime_only:
            head += f" ({self.mtime_folders} of them folders; e.g. {', '.join(self.mtime_only[:3])})"
        head += f", {len(self.differences)} differ" + (":" if self.differences else "")
        return [head, *("  " + line for line in group_lines(self.differences))]


def compare_files(first: Inventory, second: Inventory) -> Files:
    """Every path of either file system: identical, different in mtime alone, or a Difference whose
    cause is what the inventories tell (a .pyc's header, a log's path); ``explain`` refines the rest."""
    identical, differences = 0, []
    mtime_files: list[str] = []
    mtime_folders: list[str] = []
    paths = sorted(first.entries.keys() | second.entries.keys())
    for path in paths:
        a, b = first.entries.get(path), second.entries.get(path)
        if a is None or b is None:
            cause = "only-second" if a is None else "only-first"
            differences.append(
                Difference(path=path, cause=cause, first=a.to_json() if a else None, second=b.to_json() if b else None)
            )
            continue
        aspects = _aspects(a, b)
        if aspects:
            cause = _first_cause(a, b, aspects)
            detail = _pyc_times(a, b) if cause == "pyc-mtime" else ""
            differences.append(
                Difference(path=path, cause=cause, aspects=aspects, first=a.to_json(), second=b.to_json(), detail=detail)
            )
        elif a.mtime != b.mtime:
            (mtime_folders if a.kind == "dir" else mtime_files).append(path)
        else:
            identical += 1
    return Files(
        compared=len(paths),
        identical=identical,
        mtime_only=mtime_files + mtime_folders,
        mtime_folders=len(mtime_folders),
        differences=differences,
    )


def _aspects(a: Entry, b: Entry) -> tuple[str, ...]:
    found = []
    if a.compared_kind != b.compared_kind:
        found.append("kind")
    if a.mode != b.mode:
        found.append("mode")
    if (a.uid, a.gid) != (b.uid, b.gid):
        found.append("owner")
    if a.kind == "symlink" == b.kind and a.link != b.link:
        found.append("link")
    if (a.sha256, a.size) != (b.sha256, b.size) and a.compared_kind == b.compared_kind == "file":
        found.append("content")
    return tuple(found)


def _first_cause(a: Entry, b: Entry, aspects: tuple[str, ...]) -> str:
    """The cause the entries alone tell: the first metadata aspect, else what the path or a .pyc's
    header says, else ``content`` for ``explain`` to refine."""
    if "content" not in aspects:
        return aspects[0]
    if a.path.startswith("var/log/"):
        return "log"
    if a.path.endswith(".dist-info/RECORD"):
        return "record"
    if a.path == "var/cache/ldconfig/aux-cache":
        return "ldconfig-cache"
    if a.pyc is not None and b.pyc is not None:
        if a.pyc.code_sha256 == b.pyc.code_sha256 and a.pyc.timestamped and b.pyc.timestamped:
            return "pyc-mtime"
        return "pyc-code"
    return "content"


def _pyc_times(a: Entry, b: Entry) -> str:
    """The source mtimes two timestamped .pyc headers hold (seconds, UTC)."""
    assert a.pyc is not None and b.pyc is not None
    times = [dt.datetime.fromtimestamp(struct.unpack("<I", bytes.fromhex(e.stamp)[:4])[0], dt.UTC) for e in (a.pyc, b.pyc)]
    return f"source mtime {times[0]:%Y-%m-%d %H:%M:%S} in the first, {times[1]:%Y-%m-%d %H:%M:%S} in the second"


def needs_reading(d: Difference) -> bool:
    """A difference whose cause only the two copies tell."""
    return d.cause in UNEXPLAINED and "content" in d.aspects


def explain(d: Difference, first: Path, second: Path) -> Difference:
    """``d`` with its cause found in the two copies of the file: an ELF file's symbols or sections, a
    zip's members, the strings that differ (a date or time, a random name), else what differs."""
    with first.open("rb") as a, second.open("rb") as b:
        head_a, head_b = a.read(4), b.read(4)
    if head_a == ELF_MAGIC == head_b:
        return _explain_elf(d, first, second)
    if head_a == ZIP_MAGIC == head_b:
        return _explain_zip(d, first, second)
    return _explain_strings(d, first.read_bytes(), second.read_bytes())


# Sections made from the others (a hash of the file), which differ whenever any other does.
DERIVED_SECTIONS = (".note.gnu.build-id", ".gnu_debuglink")


def _explain_elf(d: Difference, first: Path, second: Path) -> Difference:
    """An ELF file: its defined dynamic symbols, else the sections that differ and the strings that
    differ in them (a ``__DATE__``/``__TIME__`` in ``.rodata``)."""
    with first.open("rb") as a, second.open("rb") as b:
        sym_a, sym_b = elf_symbols(a), elf_symbols(b)
    if sym_a is not None and sym_b is not None and sym_a.names != sym_b.names:
        return symbols_differ(d, sym_a, sym_b)
    with first.open("rb") as a, second.open("rb") as b:
        sec_a, sec_b = elf_sections(a), elf_sections(b)
    differing = sorted(n for n in sec_a.keys() | sec_b.keys() if sec_a.get(n) != sec_b.get(n))
    own = [n for n in differing if n not in DERIVED_SECTIONS]
    count = len(sym_a.names) if sym_a is not None else 0
    where = f"the same {count} defined symbols; sections that differ: {', '.join(differing) or 'none (headers)'}"
    found = _explain_strings(d, b"\0".join(sec_a.get(n, b"") for n in own), b"\0".join(sec_b.get(n, b"") for n in own))
    if found.cause in ("build-time", "random-id"):
        return replace(found, detail=f"{found.detail} ({where})")
    return replace(d, cause="elf-sections", detail=where)


def symbols_differ(d: Difference, a: Symbols, b: Symbols) -> Difference:
    """``d`` as an ELF file whose defined dynamic symbols differ: every symbol only one build has."""
    only_a, only_b = sorted(set(a.names) - set(b.names)), sorted(set(b.names) - set(a.names))
    detail = (
        f"{len(only_a)} defined symbol(s) only in the first ({_few(only_a)}), {len(only_b)} only in the second ({_few(only_b)})"
    )
    symbols = {"first_sha256": a.sha256, "second_sha256": b.sha256, "only_in_first": only_a, "only_in_second": only_b}
    return replace(d, cause="elf-symbols", detail=detail, extra={"symbols": symbols})


def _explain_zip(d: Difference, first: Path, second: Path) -> Difference:
    try:
        with zipfile.ZipFile(first) as a, zipfile.ZipFile(second) as b:
            ma = {i.filename: (i.CRC, i.file_size, i.date_time) for i in a.infolist()}
            mb = {i.filename: (i.CRC, i.file_size, i.date_time) for i in b.infolist()}
    except zipfile.BadZipFile:
        return _explain_strings(d, first.read_bytes(), second.read_bytes())
    content = sorted(n for n in ma.keys() | mb.keys() if (ma.get(n) or ())[:2] != (mb.get(n) or ())[:2])
    if content:
        return replace(
            d, cause="zip-members", detail=f"{len(content)} member(s) differ: {_few(content)}", extra={"members": content}
        )
    times = sorted(n for n in ma if ma[n][2] != mb[n][2])
    return replace(
        d, cause="zip-times", detail=f"the same {len(ma)} members; {len(times)} with other times, e.g. {_few(times, 2)}"
    )


def _explain_strings(d: Difference, a: bytes, b: bytes) -> Difference:
    """The strings (runs of 4 or more printable characters) one copy has more often than the other:
    all dates or times is ``build-time``, all random names ``random-id``; else ``content`` with them."""
    only_a, only_b = _changed_strings(a, b), _changed_strings(b, a)
    changed = only_a + only_b
    sample = f"{_quote(only_a)} in the first, {_quote(only_b)} in the second"
    if changed and all(_TIME.search(s) or _RANDOM.search(s) for s in changed):
        cause = "build-time" if any(_TIME.search(s) for s in changed) else "random-id"
        return replace(d, cause=cause, detail=sample)
    if changed:
        return replace(d, cause="content", detail=sample)
    differing = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return replace(
        d, cause="content", detail=f"{differing} byte(s) differ, the first at offset {first}; no printable string differs"
    )


def _changed_strings(a: bytes, b: bytes) -> list[bytes]:
    """The strings of ``a`` that ``b`` has fewer of, in ``a``'s order."""
    extra = Counter(_STRING.findall(a))
    extra.subtract(Counter(_STRING.findall(b)))
    return [s for s, n in extra.items() if n > 0]


def _quote(strings: list[bytes], shown: int = 2) -> str:
    if not strings:
        return "nothing"
    quoted = ", ".join(repr(s.decode("ascii")[:80]) for s in strings[:shown])
    return quoted + (f" and {len(strings) - shown} more" if len(strings) > shown else "")


def _few(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... {len(names) - shown} more" if len(names) > shown else "") if names else "none"


# --- wheels -----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Wheels:
    """The wheels of two builds (those under /wheels), member by member, ELF members by their symbols."""

    wheels: list[dict[str, Any]]
    differences: list[Difference]

    @property
    def matches(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "wheels": self.wheels,
            "differences": grouped_json(self.differences),
        }

    def lines(self) -> list[str]:
        lines = []
        for w in self.wheels:
            same = "the same bytes" if w["first_sha256"] == w["second_sha256"] else "other bytes"
            elf = f", {len(w['elf'])} ELF member(s), symbol tables {'the same' if all(e['same'] for e in w['elf']) else 'DIFFER'}"
            times = f", {len(w['times_only'])} member(s) differ in their zip time only" if w["times_only"] else ""
            lines.append(f"{w['wheel']}: {w['members']} member(s), {same}{elf if w['elf'] else ''}{times}")
        return lines + group_lines(self.differences)


def compare_wheels(first: Mapping[str, Wheel], second: Mapping[str, Wheel]) -> Wheels:
    """The wheels of both builds by file name: each member's size and sha256, each ELF member's symbols."""
    wheels, differences = [], []
    for path in sorted(first.keys() | second.keys()):
        a, b = first.get(path), second.get(path)
        if a is None or b is None:
            cause = "only-second" if a is None else "only-first"
            differences.append(
                Difference(
                    path=path, cause=cause, first={"sha256": a.sha256} if a else None, second={"sha256": b.sha256} if b else None
                )
            )
            continue
        summary, found = _compare_wheel(a, b)
        wheels.append(summary)
        differences += found
    return Wheels(wheels=wheels, differences=differences)


def _compare_wheel(a: Wheel, b: Wheel) -> tuple[dict[str, Any], list[Difference]]:
    differences, times_only, elf = [], [], []
    for name in sorted(a.members.keys() | b.members.keys()):
        x, y = a.members.get(name), b.members.get(name)
        where = f"{a.path}!{name}"
        if x is None or y is None:
            cause = "only-second" if x is None else "only-first"
            differences.append(
                Difference(path=where, cause=cause, first=x.to_json() if x else None, second=y.to_json() if y else None)
            )
            continue
        if x.symbols is not None or y.symbols is not None:
            elf.append(_elf_member(name, x, y))
        if (x.sha256, x.size) != (y.sha256, y.size):
            differences.append(_member_difference(where, x, y))
        elif x.date_time != y.date_time:
            times_only.append(name)
    summary = {
        "wheel": a.path,
        "first_sha256": a.sha256,
        "second_sha256": b.sha256,
        "members": len(a.members.keys() | b.members.keys()),
        "times_only": times_only,
        "elf": elf,
    }
    return summary, differences


def _elf_member(name: str, x: Member, y: Member) -> dict[str, Any]:
    sx, sy = x.symbols, y.symbols
    return {
        "member": name,
        "symbols": len(sx.names) if sx else None,
        "first_sha256": sx.sha256 if sx else None,
        "second_sha256": sy.sha256 if sy else None,
        "same": sx is not None and sy is not None and sx.names == sy.names,
    }


def _member_difference(where: str, x: Member, y: Member) -> Difference:
    cause = "record" if where.endswith(".dist-info/RECORD") else "content"
    d = Difference(path=where, cause=cause, aspects=("content",), first=x.to_json(), second=y.to_json())
    if x.symbols is not None and y.symbols is not None and x.symbols.names != y.symbols.names:
        return symbols_differ(d, x.symbols, y.symbols)
    return d


def explain_members(wheel: str, differences: list[Difference], first: Path, second: Path, scratch: Path) -> list[Difference]:
    """The differences of ``wheel``'s members (``first`` and ``second``: the wheel's two copies) with
    their causes, found in each member's two copies as ``explain`` finds a file's."""
    better = {}
    with zipfile.ZipFile(first) as a, zipfile.ZipFile(second) as b:
        for d in differences:
            member = d.path.removeprefix(f"{wheel}!")
            if d.cause not in UNEXPLAINED or member == d.path:
                continue
            copies = []
            for n, archive in enumerate((a, b), 1):
                copies.append(scratch / f"member-{n}")
                with archive.open(member) as source, copies[-1].open("wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 20)
            better[d.path] = explain(d, *copies)
    return [better.get(d.path, d) for d in differences]


# --- installed packages -----------------------------------------------------------------------------


@dataclass(kw_only=True)
class Packages:
    """The installed packages of two builds: added, removed, another version, another RECORD."""

    compared: int
    added: list[dict[str, Any]]
    removed: list[dict[str, Any]]
    changed: list[dict[str, Any]]
    records: list[dict[str, Any]]

    @property
    def matches(self) -> bool:
        return not (self.added or self.removed or self.changed or self.records)

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "added": self.added,
            "removed": self.removed,
            "changed": self.changed,
            "records": self.records,
        }

    def lines(self) -> list[str]:
        if self.compared == 0:
            return ["none installed"]
        if self.matches:
            return [f"{self.compared} package(s), the same names, versions and RECORD hashes"]
        lines = [f"{self.compared} package(s):"]
        for what, items in (("only in the second", self.added), ("only in the first", self.removed)):
            if items:
                named = [f"{p['name']} {p['version']}" for p in items]
                lines.append(f"  {what}: {_few(named, SHOWN)}")
        for c in self.changed[:SHOWN]:
            lines.append(f"  {c['name']}: {c['first']} -> {c['second']}")
        for r in self.records[:SHOWN]:
            lines.append(f"  {r['name']} ({r['where']}): RECORD differs for {_few(r['files'])}")
        return lines


def compare_packages(first: Mapping[str, Package], second: Mapping[str, Package]) -> Packages:
    added = [second[k].to_json() for k in sorted(second.keys() - first.keys())]
    removed = [first[k].to_json() for k in sorted(first.keys() - second.keys())]
    changed, records = [], []
    for key in sorted(first.keys() & second.keys()):
        a, b = first[key], second[key]
        if a.version != b.version:
            changed.append({"name": a.name, "where": a.where, "first": a.version, "second": b.version})
        files = sorted(f for f in a.record.keys() | b.record.keys() if a.record.get(f) != b.record.get(f))
        if files:
            records.append({"name": a.name, "where": a.where, "files": files})
    return Packages(compared=len(first.keys() | second.keys()), added=added, removed=removed, changed=changed, records=records)


# --- the image's configuration ----------------------------------------------------------------------

# What a container gets from the image's configuration; the time it was made and its layers' digests
# are left out (the layers are the file systems above, compared path by path).
CONFIG_KEYS = ("Env", "Entrypoint", "Cmd", "Labels", "WorkingDir", "User", "ExposedPorts", "Volumes", "StopSignal")


def compare_config(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The configuration keys (of ``docker image inspect``) whose values differ, with both values."""

    def pick(attrs: Mapping[str, Any]) -> dict[str, Any]:
        config = attrs.get("Config") or {}
        return {**{k: config.get(k) for k in CONFIG_KEYS}, **{k: attrs.get(k) for k in ("Architecture", "Os", "Variant")}}

    a, b = pick(first), pick(second)
    return {k: {"first": a[k], "second": b[k]} for k in a if a[k] != b[k]}
