"""Validators for YAML documents: each takes (doc, path, value) and returns the typed value.

Shared by the matrix and the patch metadata, so both word their errors the same way: the file,
the line, the key, and the nearest known name.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sparkbuild.util.yamlsrc import DocPath, Located


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Perhaps you meant '{close[0]}'?" if close else ""


Validator = Callable[[Located, DocPath, Any], Any]


def type_name(value: Any) -> str:
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
    if not isinstance(value, str):
        return f"a {type(value).__name__} ({value}); quote it to make it a string"
    return f"a string ({value[:60]!r})"


# Never wanted in a configuration value: they end lines in Dockerfiles, labels and logs.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_LINE_BREAK = re.compile(r"[\n\t]")


def text(doc: Located, path: DocPath, value: Any) -> str:
    """A non-empty string; new lines and tabs are allowed (prose), other control characters are not."""
    if isinstance(value, str) and value:
        if _CONTROL.search(value):
            raise doc.fail(path, f"{value[:60]!r} has a control character; remove it")
        return value
    hint = f'; quote it: "{value}"' if isinstance(value, int | float) and not isinstance(value, bool) else ""
    raise doc.fail(path, f"expected a non-empty string, got {type_name(value)}{hint}")


def line(doc: Located, path: DocPath, value: Any) -> str:
    """A non-empty string on one line: what lands in a Dockerfile, a label, a tag or a command."""
    word = text(doc, path, value)
    if _LINE_BREAK.search(word):
        raise doc.fail(path, f"{word[:60]!r} spans lines or has a tab; write it on one line")
    return word


def pattern(regex: str, what: str, example: str) -> Validator:
    """A one-line string matching ``regex`` entirely (ASCII), described as ``what``."""
    compiled = re.compile(regex, re.ASCII)

    def check(doc: Located, path: DocPath, value: Any) -> str:
        word = line(doc, path, value)
        if compiled.fullmatch(word) is None:
            raise doc.fail(path, f"{word[:80]!r} is not {what} (for example {example})")
        return word

    return check


def opt(check: Validator) -> Validator:
    """``check``, or None for a null value."""

    def optional(doc: Located, path: DocPath, value: Any) -> Any:
        return None if value is None else check(doc, path, value)

    return optional


def opt_text(doc: Located, path: DocPath, value: Any) -> str | None:
    return None if value is None else text(doc, path, value)


def positive_int(doc: Located, path: DocPath, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise doc.fail(path, f"expected a positive whole number, got {type_name(value)}")


def boolean(doc: Located, path: DocPath, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise doc.fail(path, f"expected true or false, got {type_name(value)}")


def list_of(item: Validator) -> Validator:
    def check(doc: Located, path: DocPath, value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise doc.fail(path, f"expected a list, got {type_name(value)}")
        return tuple(item(doc, (*path, i), v) for i, v in enumerate(value))

    return check


def choice(choices: tuple[str, ...]) -> Validator:
    def check(doc: Located, path: DocPath, value: Any) -> str:
        word = text(doc, path, value)
        if word not in choices:
            raise doc.fail(path, f"'{word}' is not one of {', '.join(choices)}.{suggest(word, choices)}")
        return word

    return check


def mapping(doc: Located, path: DocPath, value: Any, keys: Iterable[str]) -> dict[str, Any]:
    """Check ``value`` is a mapping with only ``keys``; an unknown key suggests the near one."""
    if not isinstance(value, dict):
        raise doc.fail(path, f"expected a mapping, got {type_name(value)}")
    known = tuple(keys)
    for key in value:
        if key not in known:
            raise doc.fail((*path, key), f"unknown key '{key}'.{suggest(key, known)} Known keys: {', '.join(known)}")
    return value


def require(doc: Located, path: DocPath, value: Mapping[str, Any], key: str) -> Any:
    if key not in value:
        raise doc.fail(path, f"missing required key '{key}'")
    return value[key]


def list_of_maps(doc: Located, path: DocPath, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise doc.fail(path, f"expected a list of mappings, got {type_name(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise doc.fail((*path, i), f"expected a mapping, got {type_name(item)}")
    return value


def any_key(value: Any) -> tuple[str, ...]:
    """Names of a user-named mapping (checks, bases): every key is allowed."""
    return tuple(value) if isinstance(value, dict) else ()
