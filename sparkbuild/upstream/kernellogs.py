"""The kernel choices a vLLM release can log, read from its source, and ``kernel-paths.yaml`` held
to them.

``kernel-paths.yaml``'s ``sources:`` says, per kind, which files of a vLLM sdist hold its choice
statements and which of their log statements are choices (a regular expression over the message,
holes filled with ``SENTINEL``), less the ones that are not, each with why. For every release of a
range, every pattern must match one of the kind's choice statements (a pattern that matches
nothing reads words the release never logs), and every choice statement must be matched by a
pattern or a fallback (a choice no pattern reads would leave the gate blind to it). Held on every
release's real sdist by tests/upstream/test_kernel_logs.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sparkbuild.errors import ConfigError
from sparkbuild.upstream import kernelpath, logcalls
from sparkbuild.util import fsutil, yamlsrc

# The statements of a release are cached beside its tree, for this version of the reader.
CACHE = ".sparkbuild-log-statements.json"
# What the cache holds: bump it when read_release changes what it stores.
_FORMAT = 5
# A file is parsed only if its text can hold a choice statement: a message starting "Using", or a fallback.
_PREFILTER = re.compile(r"[\"']Using |[Ff]all(?:ing|s)? ?back")
# The names a file can put into a message: identifiers, and the text of string literals.
_IDENTIFIER = re.compile(r"[A-Za-z_][\w-]*")
_LITERAL = re.compile(r"\"([^\"\\\n]{1,200})\"|'([^'\\\n]{1,200})'")


@dataclass(frozen=True)
class NotChoice:
    """Log statements of a kind's files that read like a choice but are not one, and why."""

    statement: re.Pattern[str]
    why: str
    vllm: SpecifierSet | None = None

    def covers(self, text: str, version: Version) -> bool:
        return (self.vllm is None or version in self.vllm) and self.statement.search(text) is not None


@dataclass(frozen=True)
class Source:
    kind: str
    files: tuple[str, ...]  # globs under the sdist's root
    statements: re.Pattern[str]
    not_choices: tuple[NotChoice, ...]

    def choices(self, statements: Iterable[logcalls.Statement], version: Version) -> list[logcalls.Statement]:
        """The kind's choice statements among a release's statements."""
        files = _files(self.files)
        found = []
        for s in statements:
            text = s.text()
            if files.fullmatch(s.file) and self.statements.search(text):
                found += [] if any(n.covers(text, version) for n in self.not_choices) else [s]
        return found


@cache
def _files(globs: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{fsutil.glob_regex(g)})" for g in globs))


@cache
def table_sources() -> dict[str, Source]:
    """The shipped ``sources:`` of ``kernel-paths.yaml``."""
    return parse_sources(yamlsrc.load_shipped(kernelpath.raw_text()), kernelpath.DATA)


def parse_sources(data: Any, where: str) -> dict[str, Source]:
    body = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: expected 'sources:', per kind the files and statements its patterns are read from")
    return {kind: _source(kind, item, f"{where}: sources.{kind}") for kind, item in body.items()}


def _source(kind: str, item: Any, where: str) -> Source:
    if not isinstance(item, dict) or not isinstance(item.get("files"), list) or "statements" not in item:
        raise ConfigError(f"{where}: expected 'files:' (globs in the sdist) and 'statements:' (a regular expression)")
    not_choices = []
    for i, entry in enumerate(item.get("not_choices") or []):
        if not isinstance(entry, dict) or "statement" not in entry or not entry.get("why"):
            raise ConfigError(f"{where}.not_choices[{i}]: expected 'statement:' (a regular expression) and 'why:'")
        spec = None if entry.get("vllm") is None else SpecifierSet(str(entry["vllm"]), prereleases=True)
        not_choices.append(NotChoice(_regex(entry["statement"], f"{where}.not_choices[{i}]"), str(entry["why"]), spec))
    return Source(kind, tuple(map(str, item["files"])), _regex(item["statements"], f"{where}.statements"), tuple(not_choices))


def _regex(text: Any, where: str) -> re.Pattern[str]:
    try:
        return re.compile(str(text))
    except re.error as exc:
        raise ConfigError(f"{where}: {text!r} is not a regular expression: {exc}") from None


def globs(found: Mapping[str, Source] | None = None) -> tuple[str, ...]:
    """What a release's tree needs: every kind's files, and PKG-INFO (its version)."""
    found = table_sources() if found is None else found
    return tuple(sorted({"PKG-INFO", *(g for s in found.values() for g in s.files)}))


# --- a release's statements ----------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    version: str
    statements: tuple[logcalls.Statement, ...]
    # Per file that logs a choice-like message (relative path), the names it can put into one.
    names: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def all_names(self) -> set[str]:
        return set().union(*self.names.values())


def read_release(version: str, tree: Path, patterns: Sequence[str]) -> Release:
    """The log statements and per-file names of the files of ``tree`` that ``patterns`` name; cached
    in the tree, keyed by the reader's source and ``_FORMAT`` (a changed reader reads again)."""
    key = hashlib.sha256(Path(logcalls.__file__).read_bytes() + f"{_FORMAT}\0{chr(0).join(patterns)}".encode()).hexdigest()
    cached = tree / CACHE
    if cached.is_file():
        data = json.loads(cached.read_text(encoding="utf-8"))
        if data.get("key") == key:
            names = {file: frozenset(found) for file, found in data["names"].items()}
            return Release(version, tuple(map(_statement, data["statements"])), names)
    wanted = re.compile("|".join(f"(?:{fsutil.glob_regex(p)})" for p in patterns))
    files = [p for p in tree.rglob("*.py") if wanted.fullmatch(p.relative_to(tree).as_posix())]
    # Only a file whose text can hold a choice statement is parsed for statements (most cannot).
    texts = {p: p.read_text(encoding="utf-8", errors="replace") for p in files}
    spoken = [p for p, text in texts.items() if _PREFILTER.search(text)]
    names = {p.relative_to(tree).as_posix(): frozenset(_names(texts[p])) for p in spoken}
    found = Release(version, tuple(logcalls.tree_statements(tree, spoken)), names)
    data = {"key": key, "statements": [asdict(s) for s in found.statements], "names": {f: sorted(n) for f, n in names.items()}}
    cached.write_text(json.dumps(data) + "\n", encoding="utf-8")
    return found


def _names(text: str) -> set[str]:
    """What a file can put into a message: its identifiers (classes, enum members) and the text
    of its string literals (enum values such as "FlashInfer CUTLASS")."""
    return set(_IDENTIFIER.findall(text)) | {a or b for a, b in _LITERAL.findall(text)}


def _statement(data: dict[str, Any]) -> logcalls.Statement:
    parts = tuple(p if isinstance(p, str) else logcalls.Hole(**p) for p in data["parts"])
    return logcalls.Statement(data["file"], data["line"], data["level"], parts)


# --- the table held to the statements ------------------------------------------------------------


def check(ranges: Sequence[kernelpath.Range], found: Mapping[str, Source], releases: Sequence[Release], newest: str) -> list[str]:
    """Every way the table disagrees with the releases' source: a release no range covers (or two
    do), a newest range that does not end at ``newest``, a pattern that matches no choice statement
    of a release it applies to, a choice statement no pattern reads, a kind a range lacks though its
    releases log it, an alias that names nothing the range's source has."""
    problems = _coverage(ranges, releases, newest)
    for r in ranges:
        inside = [rel for rel in releases if Version(rel.version) in r.vllm]
        for name, source in found.items():
            choices = {rel.version: source.choices(rel.statements, Version(rel.version)) for rel in inside}
            kind = r.kinds.get(name)
            if kind is None:
                problems += [f"vLLM {v} {c[0]}: a {name} choice, and {r.where} has no '{name}'" for v, c in choices.items() if c]
                continue
            problems += _live(r, kind, inside, choices)
            problems += _covered(r, kind, inside, choices)
            problems += _aliases(r, kind, inside)
        problems += [
            f"{kernelpath.DATA} {r.where}.kinds.{name}: no 'sources: {name}' says what it is read from"
            for name in r.kinds
            if name not in found
        ]
    return problems


def _coverage(ranges: Sequence[kernelpath.Range], releases: Sequence[Release], newest: str) -> list[str]:
    problems = []
    for rel in releases:
        covering = [r.where for r in ranges if Version(rel.version) in r.vllm]
        if len(covering) != 1:
            where = ", ".join(covering) or "none"
            problems.append(f"vLLM {rel.version} is in {len(covering)} ranges of {kernelpath.DATA} ({where})")
    read = {rel.version for rel in releases}
    for r in ranges:
        if str(r.read_from) not in read:
            problems.append(f"{kernelpath.DATA} {r.where}: ends at {r.read_from}, a release this check did not read")
    top = max((r.read_from for r in ranges), default=None)
    if top != Version(newest):
        problems.append(f"{kernelpath.DATA}: the newest range ends at {top}, not at the newest release read ({newest})")
    return problems


def _texts(statement: logcalls.Statement, kind: kernelpath.Kind, rel: Release) -> list[str]:
    """The statement as logged with its holes filled by the sentinel, or by each name the kind's
    aliases know that the statement's own file has (a pattern may name its backends: the CPU
    experts classes unquantized.py imports)."""
    if not statement.holes:
        return [statement.text()]
    names = rel.names.get(statement.file, frozenset())
    return [statement.text(default=value) for value in (logcalls.SENTINEL, *(a for a in kind.aliases if a in names))]


def _live(
    r: kernelpath.Range, kind: kernelpath.Kind, inside: Sequence[Release], choices: Mapping[str, list[logcalls.Statement]]
) -> list[str]:
    problems = []
    for rel in inside:
        texts = [t for s in choices[rel.version] for t in _texts(s, kind, rel)]
        for label, patterns in (("patterns", kind.patterns), ("fallbacks", kind.fallbacks)):
            for i, pattern in enumerate(patterns):
                if pattern.applies(Version(rel.version)) and not any(pattern.regex.search(t) for t in texts):
                    problems.append(
                        f"{r.where}.kinds.{kind.name}.{label}[{i}] {pattern.regex.pattern!r} matches no {kind.name} choice "
                        f"vLLM {rel.version} logs"
                    )
    return problems


def _covered(
    r: kernelpath.Range, kind: kernelpath.Kind, inside: Sequence[Release], choices: Mapping[str, list[logcalls.Statement]]
) -> list[str]:
    problems = []
    for rel in inside:
        here = kind.at(Version(rel.version))
        regexes = [p.regex for p in (*here.patterns, *here.fallbacks)]
        for s in choices[rel.version]:
            if not any(rx.search(t) for t in _texts(s, here, rel) for rx in regexes):
                problems.append(f"vLLM {rel.version} {s}: a {kind.name} choice no pattern of {r.where} reads")
    return problems


def _aliases(r: kernelpath.Range, kind: kernelpath.Kind, inside: Sequence[Release]) -> list[str]:
    """Each logged name an alias maps must come from the range's source: a name of one of its
    releases, text of one of its messages, or words that are (``FlashInfer {backend.value}``)."""
    names: set[str] = set().union(*(rel.all_names() for rel in inside))
    literal = " ".join(s.text() for rel in inside for s in rel.statements)
    words = names | set(literal.split())
    return [
        f"{r.where}.kinds.{kind.name}.aliases: {logged!r} is in no source of vLLM {r.vllm}"
        for logged in kind.aliases
        if logged not in names and logged not in literal and not set(logged.split()) <= words
    ]
