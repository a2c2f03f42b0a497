"""The kernel-path gate: which kernels vLLM chose, read from the server's startup log, against what
the check expects.

vLLM can pick a slower or a wrong kernel without an error (Marlin instead of CUTLASS for NVFP4
MoE, Triton attention instead of FlashInfer with sinks). Each choice is logged once at startup,
in words that change between releases, so the patterns are data (``kernel-paths.yaml`` beside
the defaults): per vLLM version range, per kind of kernel, regular expressions with a ``backend``
group, and the names a release logs mapped to the names a check uses. A check's ``kernels:``
names the backends it accepts per kind. A log with no line for an expected kind is an error (an
unknown log format, or a path that never ran), never a pass.

Each range ends at the newest release its patterns were read from (``<=X.Y.Z``), and
tests/upstream/test_kernel_logs.py holds every pattern to the log statements of every release's
sdist in its range. A newer vLLM has no range: the gate refuses it (its words are unread) unless
the check sets ``accept_unverified_kernel_patterns``, and then says so in every summary.

A fallback logged after the choice ("falling back to the cute-dsl backend") is what runs: a
kind's ``fallbacks`` patterns name the backend that replaces the choice logged before them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sparkbuild.errors import ConfigError, VerifyError
from sparkbuild.util import yamlsrc

DATA = "kernel-paths.yaml"
WHERE = f"sparkbuild/resources/{DATA}"
# The check key that lets a check use the newest range's patterns on a newer, unread vLLM.
ACCEPT_KEY = "accept_unverified_kernel_patterns"


@dataclass(frozen=True)
class Pattern:
    """One regular expression with a ``backend`` group; ``vllm`` narrows it to part of its range
    (where a release changed the words inside it)."""

    regex: re.Pattern[str]
    vllm: SpecifierSet | None = None

    def applies(self, version: Version) -> bool:
        return self.vllm is None or version in self.vllm


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One kind of kernel choice as one vLLM version range logs it."""

    name: str
    patterns: tuple[Pattern, ...]
    # Lines logged after a choice that name the backend replacing it.
    fallbacks: tuple[Pattern, ...] = ()
    # A logged name -> the name checks use (FLASHINFER for "FlashInfer"); unlisted names are kept.
    aliases: Mapping[str, str] = field(default_factory=dict)

    def canonical(self, logged: str) -> str:
        return self.aliases.get(logged, logged)

    def at(self, version: Version) -> Kind:
        """The patterns that apply to ``version``."""
        return Kind(
            name=self.name,
            patterns=tuple(p for p in self.patterns if p.applies(version)),
            fallbacks=tuple(p for p in self.fallbacks if p.applies(version)),
            aliases=self.aliases,
        )


@dataclass(frozen=True, kw_only=True)
class Range:
    vllm: SpecifierSet
    kinds: Mapping[str, Kind]
    # The oldest and the newest release the patterns were read from: the ``>=`` and ``<=`` bounds.
    first: Version
    read_from: Version
    where: str = ""  # "ranges[0]", for messages
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Chosen:
    """What the gate found for one kind: the backends that ran, each with the log line that says
    so (its first), and the ones chosen first and then fallen back from."""

    kind: str
    expected: tuple[str, ...]
    found: tuple[tuple[str, str], ...]
    fell_back: tuple[tuple[str, str], ...] = ()
    # Why the patterns are not verified for this vLLM (empty: they are).
    unverified: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.found) and all(backend in self.expected for backend, _ in self.found)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "expected": list(self.expected),
            "chosen": [{"backend": b, "line": line} for b, line in self.found],
            "fell_back": [{"backend": b, "line": line} for b, line in self.fell_back],
            "unverified": self.unverified or None,
            "ok": self.ok,
        }


@cache
def table() -> tuple[Range, ...]:
    """The shipped patterns (``sparkbuild/resources/kernel-paths.yaml``)."""
    return parse(yamlsrc.load_shipped(raw_text()), DATA)


def raw_text() -> str:
    return resources.files("sparkbuild.resources").joinpath(DATA).read_text()


def parse(data: Any, where: str) -> tuple[Range, ...]:
    if not isinstance(data, dict) or not isinstance(data.get("ranges"), list):
        raise ConfigError(f"{where}: expected a mapping with a 'ranges:' list")
    ranges = tuple(_range(item, where, i) for i, item in enumerate(data["ranges"]))
    for a, b in ((a, b) for i, a in enumerate(ranges) for b in ranges[i + 1 :]):
        if a.read_from in b.vllm or b.read_from in a.vllm:
            raise ConfigError(f"{where}: {a.where} ({a.vllm}) and {b.where} ({b.vllm}) overlap: a version has one range")
    return ranges


def _range(item: Any, file: str, index: int) -> Range:
    where = f"{file}: ranges[{index}]"
    if not isinstance(item, dict) or not isinstance(item.get("kinds"), dict):
        raise ConfigError(f"{where}: expected 'vllm:' (a version specifier) and 'kinds:'")
    spec = _specifier(item.get("vllm"), f"{where}.vllm")
    uppers = [s.version for s in spec if s.operator == "<="]
    lowers = [s.version for s in spec if s.operator == ">="]
    if len(uppers) != 1 or len(lowers) != 1:
        raise ConfigError(
            f"{where}.vllm: '{spec}' needs '>=FIRST' and '<=LAST', LAST the newest release whose source its patterns "
            "were read from (tests/upstream/test_kernel_logs.py checks them on every release between)"
        )
    kinds = {name: _kind(name, body, f"{where}.kinds.{name}", spec) for name, body in item["kinds"].items()}
    return Range(
        vllm=spec,
        kinds=kinds,
        first=Version(lowers[0]),
        read_from=Version(uppers[0]),
        where=f"ranges[{index}]",
        note=str(item.get("note", "")),
    )


def _specifier(text: Any, where: str) -> SpecifierSet:
    try:
        return SpecifierSet(str(text), prereleases=True)
    except InvalidSpecifier:
        raise ConfigError(f"{where}: {text!r} must be a version specifier such as '>=0.12.0,<=0.18.1'") from None


def _kind(name: str, item: Any, where: str, outer: SpecifierSet) -> Kind:
    patterns = item.get("patterns") if isinstance(item, dict) else None
    if not isinstance(patterns, list) or not patterns:
        raise ConfigError(f"{where}: expected 'patterns:', a list of regular expressions with a (?P<backend>...) group")
    assert isinstance(item, dict)
    fallbacks = item.get("fallbacks") or []
    aliases = item.get("aliases") or {}
    return Kind(
        name=name,
        patterns=tuple(_pattern(p, f"{where}.patterns[{i}]", outer) for i, p in enumerate(patterns)),
        fallbacks=tuple(_pattern(p, f"{where}.fallbacks[{i}]", outer) for i, p in enumerate(fallbacks)),
        aliases={str(k): str(v) for k, v in aliases.items()},
    )


def _pattern(item: Any, where: str, outer: SpecifierSet) -> Pattern:
    """``'Using (?P<backend>...) ...'``, or ``{pattern: '...', vllm: '>=0.28.0'}`` for part of the range."""
    text, vllm = (item.get("pattern"), item.get("vllm")) if isinstance(item, dict) else (item, None)
    try:
        regex = re.compile(str(text))
    except re.error as exc:
        raise ConfigError(f"{where}: pattern {text!r} is not a regular expression: {exc}") from None
    if "backend" not in regex.groupindex:
        raise ConfigError(f"{where}: pattern {text!r} has no (?P<backend>...) group")
    return Pattern(regex, None if vllm is None else _specifier(vllm, f"{where}.vllm") & outer)


def kinds() -> frozenset[str]:
    """Every kind some range knows: what a check's ``kernels:`` may name."""
    return frozenset(k for r in table() for k in r.kinds)


@dataclass(frozen=True)
class Match:
    """The range whose patterns read a version's log; ``unverified`` says why they may not fit."""

    range: Range
    unverified: str = ""


def for_version(version: str, ranges: Sequence[Range] | None = None, *, accept_unverified: bool = False) -> Match:
    """The range that covers ``version``. For a version no range covers, an error naming the range
    to extend; or (``accept_unverified``) the range whose span leaves it out (0.15.x, wheels only),
    else the newest range older than it, marked unverified."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise VerifyError(f"the server reported vLLM version {version!r}, which is not a version") from None
    ranges = table() if ranges is None else ranges
    for candidate in ranges:
        if parsed in candidate.vllm:
            return Match(candidate)
    spanning = [r for r in ranges if r.first <= parsed <= r.read_from]
    older = sorted((r for r in ranges if r.read_from < parsed), key=lambda r: r.read_from)
    nearest = spanning[0] if spanning else older[-1] if older else None
    if nearest is None:
        raise VerifyError(
            f"{WHERE} has no kernel-path patterns for vLLM {version}, older than every range: the check declares "
            f"kernels, so it cannot pass unchecked. Add a range for it (the lines vLLM logs are in its startup log)"
        )
    if accept_unverified:
        why = f"vLLM {version}'s log words are unread: patterns of {DATA} {nearest.where}, read from {nearest.read_from}"
        return Match(nearest, why)
    if spanning:
        todo = f"Read its source and widen {nearest.where}.vllm (its span leaves {version} out: no sdist was read)"
    elif nearest is older[-1] and nearest.read_from == max(r.read_from for r in ranges):
        todo = f"Extend {nearest.where}.vllm to '<={version}' (or add a range)"
    else:
        todo = f"Widen the range beside it (or add one) for {version}"
    raise VerifyError(
        f"no range of {WHERE} covers vLLM {version}: the nearest, {nearest.where} (vllm: '{nearest.vllm}'), was read "
        f"from vLLM {nearest.read_from}'s source, and {version}'s log words are unread, so the check cannot pass "
        f"unchecked. {todo} once tests/upstream/test_kernel_logs.py passes with {version} among its releases "
        f"(docs/kernel-paths.md), or set '{ACCEPT_KEY}: true' on the check to read it with {nearest.where}'s patterns, "
        "unverified (every summary says so)"
    )


def gate(
    expected: Mapping[str, tuple[str, ...]],
    log: str,
    version: str,
    ranges: Sequence[Range] | None = None,
    *,
    accept_unverified: bool = False,
) -> list[Chosen]:
    """What vLLM chose for each expected kind (its first log line per backend, after fallbacks).
    Raises only for a version or kind the table cannot read; a kind with no line is
    ``Chosen(found=())``, for the caller to judge."""
    if not expected:
        return []
    match = for_version(version, ranges, accept_unverified=accept_unverified)
    known, parsed = match.range, Version(version)
    result = []
    for name, accepted in expected.items():
        kind = known.kinds.get(name)
        if kind is None:
            raise VerifyError(
                f"vLLM {version} ({known.vllm}) logs no '{name}' choice that {DATA} knows (it knows "
                f"{', '.join(sorted(known.kinds)) or 'none'}); remove '{name}' from the check's kernels or add its pattern"
            )
        ran, fell = _found(kind.at(parsed), log)
        result.append(Chosen(kind=name, expected=accepted, found=ran, fell_back=fell, unverified=match.unverified))
    return result


def _found(kind: Kind, log: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The backends that ran, each with its first line, and those a later fallback replaced."""
    ran: dict[str, str] = {}
    fell: dict[str, str] = {}
    last: str | None = None
    for line in log.splitlines():
        fallback = _first(kind.fallbacks, line)
        backend = fallback if fallback is not None else _first(kind.patterns, line)
        if backend is None:
            continue
        backend = kind.canonical(backend)
        if fallback is not None and last is not None and last != backend and last in ran:
            fell.setdefault(last, ran.pop(last))
        ran.setdefault(backend, line.strip())
        last = backend
    return tuple(ran.items()), tuple(fell.items())


def _first(patterns: Sequence[Pattern], line: str) -> str | None:
    for pattern in patterns:
        match = pattern.regex.search(line)
        if match:
            return match.group("backend").strip()
    return None


def failures(chosen: Sequence[Chosen], version: str) -> list[str]:
    """One line per kind logged with a backend the check does not accept, or not logged at all."""
    lines = []
    for c in chosen:
        if not c.found:
            lines.append(
                f"  {c.kind}: expected {' or '.join(c.expected)}, but no line of the log matches {DATA}'s {c.kind} "
                f"patterns for vLLM {version}: an unknown log format, or the model never took that path"
            )
        for backend, line in c.found:
            if backend not in c.expected:
                lines.append(f"  {c.kind}: expected {' or '.join(c.expected)}, vLLM chose {backend}: {line}")
        lines += [f"    ({c.kind} {backend} was chosen first, then fell back: {line})" for backend, line in c.fell_back]
    if chosen and chosen[0].unverified and lines:
        lines.append(f"  ({chosen[0].unverified})")
    return lines


def text(chosen: Sequence[Chosen]) -> str:
    """``moe CPU, attention not logged (UNEXPECTED)``: one entry per kind, and what made it
    unverified (``accept_unverified_kernel_patterns``)."""
    shown = ", ".join(
        f"{c.kind} {'/'.join(b for b, _ in c.found) or 'not logged'}"
        + (f" (fell back from {'/'.join(b for b, _ in c.fell_back)})" if c.fell_back else "")
        + ("" if c.ok else " (UNEXPECTED)")
        for c in chosen
    )
    unverified = next((c.unverified for c in chosen if c.unverified), "")
    return f"{shown} [UNVERIFIED: {unverified}]" if unverified else shown
