"""``patches/<name>/patch.yaml``: what a patch fixes and why, for which component and versions, how
to tell upstream has it, and its change (a diff, or a rule of ``sparkbuild.patch.rules``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from sparkbuild.errors import ConfigError
from sparkbuild.patch import rules
from sparkbuild.patch.pullrequest import PullRequest
from sparkbuild.resources import packaged
from sparkbuild.util import fsutil, validate, yamlsrc

COMPONENTS = ("vllm", "flashinfer", "triton")
META = "patch.yaml"
META_KEYS = ("summary", "why", "component", "versions", "versions_why", "upstream", "change")
UPSTREAM_KEYS = ("fixed_in", "links", "detect", "alternatives")
DETECT_KEYS = ("file", "contains")
ALTERNATIVE_KEYS = ("file", "contains", "why")
CHANGE_KEYS = ("diff", "rule", "pr")
PR_KEYS = ("repo", "number", "base", "head", "sha256", "paths")


@dataclass(frozen=True)
class Detect:
    """The fix is upstream when ``file`` contains ``contains``."""

    file: str
    contains: str


@dataclass(frozen=True)
class Alternative:
    """Upstream serves the patch's purpose another way (a backend of its own) where ``file`` contains
    ``contains``: the patch still applies there, but is not needed (the support table says why)."""

    file: str
    contains: str
    why: str


@dataclass(frozen=True)
class Patch:
    name: str
    folder: Path
    summary: str
    why: str
    component: str
    versions: SpecifierSet
    # Why the range stops where it does; said with every not-applicable outside it.
    range_why: str | None
    fixed_in: str | None
    links: tuple[str, ...]
    detect: tuple[Detect, ...]
    diff: Path | None
    rule: str | None
    alternatives: tuple[Alternative, ...] = ()
    pr: PullRequest | None = None


def default_dirs() -> tuple[Path, ...]:
    """Where the patch commands look without ``--patches``: SPARKBUILD_PATCHES; else ``./patches`` where
    it exists (a team's repository), then the packaged set, a name found in both being the local one."""
    if os.environ.get("SPARKBUILD_PATCHES"):
        return (Path(os.environ["SPARKBUILD_PATCHES"]),)
    local = Path.cwd() / "patches"
    return unique((local, packaged.folder("patches")) if local.is_dir() else (packaged.folder("patches"),))


def unique(dirs: tuple[Path, ...]) -> tuple[Path, ...]:
    """``dirs`` without a folder already named (in a checkout ``./patches`` is the packaged set)."""
    seen: set[Path] = set()
    kept = []
    for d in dirs:
        if d.resolve() not in seen:
            seen.add(d.resolve())
            kept.append(d)
    return tuple(kept)


def folders(dirs: tuple[Path, ...]) -> dict[str, Path]:
    """Every patch of ``dirs`` by name; where two folders hold one name, the earlier folder's patch."""
    found: dict[str, Path] = {}
    for folder in dirs:
        for name in available(folder):
            found.setdefault(name, folder / name)
    return dict(sorted(found.items()))


def available(patches_dir: Path) -> list[str]:
    """Every folder of the patches folder: each one is a patch (one without a ``patch.yaml`` is an
    error when loaded, not a patch silently left out)."""
    if not patches_dir.is_dir():
        raise ConfigError(f"{patches_dir}: no patches folder; pass --patches DIR")
    return sorted(p.name for p in patches_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def load(where: Path | Mapping[str, Path], names: tuple[str, ...] | None = None) -> tuple[Patch, ...]:
    """Every patch of a patches folder or of ``folders``' answer, or only ``names``, in name order."""
    found = folders((where,)) if isinstance(where, Path) else where
    known = sorted(found)
    for name in names or ():
        if name not in found:
            searched = ", ".join(sorted({str(f.parent) for f in found.values()})) or "no patch folder"
            raise ConfigError(f"unknown patch '{name}' in {searched}.{suggest(name, known)} Patches: {', '.join(known)}")
    return tuple(load_one(found[name]) for name in known if not names or name in names)


def suggest(word: str, choices: list[str]) -> str:
    """The near name: a close spelling, else the one name that starts with or contains ``word``."""
    close = validate.suggest(word, choices)
    if close:
        return close
    holding = [c for c in choices if c.startswith(word)] or [c for c in choices if word in c]
    return f" Perhaps you meant '{holding[0]}'?" if len(holding) == 1 else ""


def load_one(folder: Path) -> Patch:
    if folder.is_symlink():
        raise ConfigError(f"{folder}: a symlink; a patch is a folder of its patches folder")
    if not (folder / META).is_file():
        problem = "is not a file" if (folder / META).exists() else "is missing"
        raise ConfigError(f"{folder}: its {META} {problem}; every folder of the patches folder is a patch (see README)")
    fsutil.files(folder)  # refuses symlinks out of the folder
    doc = yamlsrc.load(folder / META, META)
    data = validate.mapping(doc, (), doc.data, META_KEYS)
    for key in ("summary", "why", "component", "versions", "upstream", "change"):
        validate.require(doc, (), data, key)
    component = validate.choice(COMPONENTS)(doc, ("component",), data["component"])
    try:
        versions = SpecifierSet(validate.text(doc, ("versions",), data["versions"]))
    except InvalidSpecifier:
        raise doc.fail(("versions",), f"{data['versions']!r} is not a version specifier (for example '>=0.11,<0.19')") from None
    upstream = validate.mapping(doc, ("upstream",), data["upstream"], UPSTREAM_KEYS)
    links = validate.list_of(validate.text)(doc, ("upstream", "links"), validate.require(doc, ("upstream",), upstream, "links"))
    detects = validate.list_of_maps(doc, ("upstream", "detect"), upstream.get("detect") or [])
    detect = tuple(_detect(doc, ("upstream", "detect", i), d) for i, d in enumerate(detects))
    others = validate.list_of_maps(doc, ("upstream", "alternatives"), upstream.get("alternatives") or [])
    alternatives = tuple(_alternative(doc, ("upstream", "alternatives", i), a) for i, a in enumerate(others))
    change = validate.mapping(doc, ("change",), data["change"], CHANGE_KEYS)
    if len(change) != 1:
        raise doc.fail(("change",), "give exactly one of 'diff: FILE', 'rule: NAME' or 'pr: {repo, number, base, sha256}'")
    diff = rule = pr = None
    if "pr" in change:
        pr = _pull_request(doc, ("change", "pr"), change["pr"])
    elif "diff" in change:
        diff = folder / validate.line(doc, ("change", "diff"), change["diff"])
        if not diff.resolve().is_relative_to(folder.resolve()):
            raise doc.fail(("change", "diff"), f"{diff} is outside the patch folder {folder}")
        if not diff.is_file():
            raise doc.fail(("change", "diff"), f"{diff} does not exist")
    else:
        rule = validate.text(doc, ("change", "rule"), change["rule"])
        known = rules.names()
        if rule not in known:
            raise doc.fail(("change", "rule"), f"unknown rule '{rule}'.{validate.suggest(rule, known)}")
    fixed_in = upstream.get("fixed_in")
    return Patch(
        name=folder.name,
        folder=folder,
        summary=validate.text(doc, ("summary",), data["summary"]),
        why=validate.text(doc, ("why",), data["why"]).strip(),
        component=component,
        versions=versions,
        range_why=validate.text(doc, ("versions_why",), data["versions_why"]).strip() if "versions_why" in data else None,
        fixed_in=None if fixed_in is None else validate.text(doc, ("upstream", "fixed_in"), fixed_in),
        links=links,
        detect=detect,
        diff=diff,
        rule=rule,
        alternatives=alternatives,
        pr=pr,
    )


_inside_tree = validate.pattern(r"(?!/)(?!.*(?:^|/)\.\.(?:/|$))[^\x00]+", "a path inside the source tree", "CMakeLists.txt")


def _detect(doc: yamlsrc.Located, path: yamlsrc.DocPath, value: Any) -> Detect:
    d = validate.mapping(doc, path, value, DETECT_KEYS)
    return Detect(
        file=_inside_tree(doc, (*path, "file"), validate.require(doc, path, d, "file")),
        contains=validate.text(doc, (*path, "contains"), validate.require(doc, path, d, "contains")),
    )


_commit = validate.pattern(r"[0-9a-f]{40}", "a full commit id (40 hex digits)", "2a69949bdadf0e8942b7a1619b229cb475beef20")
_sha256 = validate.pattern(r"[0-9a-f]{64}", "a sha256 (64 hex digits)", "`sparkbuild patch pr` prints it")


def _pull_request(doc: yamlsrc.Located, path: yamlsrc.DocPath, value: Any) -> PullRequest:
    spec = validate.mapping(doc, path, value, PR_KEYS)
    for key in ("repo", "number", "base", "sha256"):
        validate.require(doc, path, spec, key)
    listed = validate.list_of(validate.text)(doc, (*path, "paths"), spec.get("paths") or [])
    return PullRequest(
        repo=validate.line(doc, (*path, "repo"), spec["repo"]),
        number=validate.positive_int(doc, (*path, "number"), spec["number"]),
        base=_commit(doc, (*path, "base"), spec["base"]),
        head=_commit(doc, (*path, "head"), spec["head"]) if spec.get("head") is not None else None,
        sha256=_sha256(doc, (*path, "sha256"), spec["sha256"]),
        paths=tuple(_inside_tree(doc, (*path, "paths", i), p) for i, p in enumerate(listed)),
    )


def _alternative(doc: yamlsrc.Located, path: yamlsrc.DocPath, value: Any) -> Alternative:
    a = validate.mapping(doc, path, value, ALTERNATIVE_KEYS)
    return Alternative(
        file=_inside_tree(doc, (*path, "file"), validate.require(doc, path, a, "file")),
        contains=validate.text(doc, (*path, "contains"), validate.require(doc, path, a, "contains")),
        why=validate.text(doc, (*path, "why"), validate.require(doc, path, a, "why")).strip(),
    )


def digest(folder: Path) -> str:
    """sha256 over the patch: every file of its folder (relative path and content, sorted), and the
    source of its rule module, which is as much a part of the change as the folder."""
    h = hashlib.sha256()
    for path in fsutil.files(folder):
        h.update(f"\0{path.relative_to(folder).as_posix()}\0".encode())
        h.update(path.read_bytes())
    rule = _rule_named(folder / META)
    if rule in rules.names():
        h.update(f"\0rule {rule}\0".encode())
        h.update(rules.source(rule))
    return h.hexdigest()


def _rule_named(path: Path) -> str | None:
    """The ``change.rule`` of a patch.yaml, read without validating it (``load`` does that, and
    says what is wrong, when the patch is used)."""
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    change = data.get("change") if isinstance(data, dict) else None
    rule = change.get("rule") if isinstance(change, dict) else None
    return rule if isinstance(rule, str) else None
