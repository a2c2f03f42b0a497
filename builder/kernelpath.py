"""The kernel-path gate: which kernels vLLM chose, read from the server's startup log, against what
the check expects.

vLLM can pick a slower or a wrong kernel without an error (Marlin instead of CUTLASS for NVFP4
MoE, Triton attention instead of FlashInfer with sinks). Each choice is logged once at startup,
in words that change between releases, so the patterns are data (``kernel-paths.yaml`` beside
the defaults): per vLLM version range, per kind of kernel, regular expressions with a ``backend``
group, and the names a release logs mapped to the names a check uses. A check's ``kernels:``
names the backends it accepts per kind. A log with no line for an expected kind is an error (an
unknown log format, or a path that never ran), never a pass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from builder.errors import ConfigError, VerifyError

DATA = "kernel-paths.yaml"


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One kind of kernel choice as one vLLM version range logs it."""

    name: str
    patterns: tuple[re.Pattern[str], ...]
    # A logged name -> the name checks use (FLASHINFER for "FlashInfer"); unlisted names are kept.
    aliases: Mapping[str, str]

    def canonical(self, logged: str) -> str:
        return self.aliases.get(logged, logged)


@dataclass(frozen=True, kw_only=True)
class Range:
    vllm: SpecifierSet
    kinds: Mapping[str, Kind]
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Chosen:
    """What the gate found for one kind: the backends vLLM logged, each with its first log line."""

    kind: str
    expected: tuple[str, ...]
    found: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return bool(self.found) and all(backend in self.expected for backend, _ in self.found)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "expected": list(self.expected),
            "chosen": [{"backend": b, "line": line} for b, line in self.found],
            "ok": self.ok,
        }


@cache
def table() -> tuple[Range, ...]:
    """The shipped patterns (``builder/resources/kernel-paths.yaml``)."""
    text = resources.files("builder.resources").joinpath(DATA).read_text()
    return parse(yaml.safe_load(text), DATA)


def parse(data: Any, where: str) -> tuple[Range, ...]:
    if not isinstance(data, dict) or not isinstance(data.get("ranges"), list):
        raise ConfigError(f"{where}: expected a mapping with a 'ranges:' list")
    return tuple(_range(item, f"{where}: ranges[{i}]") for i, item in enumerate(data["ranges"]))


def _range(item: Any, where: str) -> Range:
    if not isinstance(item, dict) or not isinstance(item.get("kinds"), dict):
        raise ConfigError(f"{where}: expected 'vllm:' (a version specifier) and 'kinds:'")
    try:
        spec = SpecifierSet(str(item["vllm"]), prereleases=True)
    except (KeyError, InvalidSpecifier):
        raise ConfigError(f"{where}: 'vllm:' must be a version specifier such as '>=0.12,<0.16'") from None
    kinds = {name: _kind(name, spec_, f"{where}.kinds.{name}") for name, spec_ in item["kinds"].items()}
    return Range(vllm=spec, kinds=kinds, note=str(item.get("note", "")))


def _kind(name: str, item: Any, where: str) -> Kind:
    patterns = item.get("patterns") if isinstance(item, dict) else None
    if not isinstance(patterns, list) or not patterns:
        raise ConfigError(f"{where}: expected 'patterns:', a list of regular expressions with a (?P<backend>...) group")
    compiled = []
    for text in patterns:
        try:
            pattern = re.compile(str(text))
        except re.error as exc:
            raise ConfigError(f"{where}: pattern {text!r} is not a regular expression: {exc}") from None
        if "backend" not in pattern.groupindex:
            raise ConfigError(f"{where}: pattern {text!r} has no (?P<backend>...) group")
        compiled.append(pattern)
    aliases = item.get("aliases") or {}
    return Kind(name=name, patterns=tuple(compiled), aliases={str(k): str(v) for k, v in aliases.items()})


def kinds() -> frozenset[str]:
    """Every kind some range knows: what a check's ``kernels:`` may name."""
    return frozenset(k for r in table() for k in r.kinds)


def for_version(version: str, ranges: Sequence[Range] | None = None) -> Range:
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise VerifyError(f"the server reported vLLM version {version!r}, which is not a version") from None
    for candidate in ranges if ranges is not None else table():
        if parsed in candidate.vllm:
            return candidate
    raise VerifyError(
        f"{DATA} has no kernel-path patterns for vLLM {version}: the check declares kernels, so it cannot pass "
        f"unchecked. Add a range for it to builder/resources/{DATA} (the lines vLLM logs are in its startup log)"
    )


def gate(expected: Mapping[str, tuple[str, ...]], log: str, version: str, ranges: Sequence[Range] | None = None) -> list[Chosen]:
    """What vLLM chose for each expected kind (its first log line per backend). Raises nothing: the
    caller decides; a kind with no line is ``Chosen(found=())``."""
    if not expected:
        return []
    known = for_version(version, ranges)
    result = []
    for name, accepted in expected.items():
        kind = known.kinds.get(name)
        if kind is None:
            raise VerifyError(
                f"vLLM {version} ({known.vllm}) logs no '{name}' choice that {DATA} knows (it knows "
                f"{', '.join(sorted(known.kinds)) or 'none'}); remove '{name}' from the check's kernels or add its pattern"
            )
        result.append(Chosen(kind=name, expected=accepted, found=_found(kind, log)))
    return result


def _found(kind: Kind, log: str) -> tuple[tuple[str, str], ...]:
    found: dict[str, str] = {}
    for line in log.splitlines():
        for pattern in kind.patterns:
            match = pattern.search(line)
            if match:
                found.setdefault(kind.canonical(match.group("backend").strip()), line.strip())
    return tuple(found.items())


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
    return lines


def text(chosen: Sequence[Chosen]) -> str:
    """``moe CPU, attention not logged (UNEXPECTED)``: one entry per kind."""
    shown = (f"{c.kind} {'/'.join(b for b, _ in c.found) or 'not logged'}{'' if c.ok else ' (UNEXPECTED)'}" for c in chosen)
    return ", ".join(shown)
