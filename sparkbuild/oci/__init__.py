"""Names as the distribution spec (and Docker) accept them: repositories, tags, image references.

From distribution's reference grammar: a path component is lowercase alphanumerics joined by ``.``,
``_``, ``__`` or dashes; a tag is ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``; a name is at most 255
characters. sparkbuild also uses a target id as a folder name and in a tag, so an id is a tag
short enough to carry ``-<hash12>``.
"""

from __future__ import annotations

import re

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"(?:(?:localhost|{_DOMAIN_PART}(?:\.{_DOMAIN_PART})+|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?|{_DOMAIN_PART}:[0-9]+)"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"sha256:[0-9a-f]{64}"

REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*", re.ASCII)
TAG = re.compile(_TAG, re.ASCII)
# [domain/]path[:tag][@digest]; a first part with a dot, a colon or "localhost" is the domain.
REFERENCE = re.compile(rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
MAX_NAME = 255
MAX_TAG = 128
# An id names a folder and starts the content tag "<id>-<12 hex>".
MAX_ID = MAX_TAG - 13


def is_repository(name: str) -> bool:
    return len(name) <= MAX_NAME and REPOSITORY.fullmatch(name) is not None


def is_tag(tag: str) -> bool:
    return TAG.fullmatch(tag) is not None


def is_id(text: str) -> bool:
    return len(text) <= MAX_ID and TAG.fullmatch(text) is not None


def is_reference(image: str) -> bool:
    return len(image.split("@")[0].rsplit(":", 1)[0]) <= MAX_NAME and REFERENCE.fullmatch(image) is not None
