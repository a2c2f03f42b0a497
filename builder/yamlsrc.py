"""Load YAML keeping the line of every value, so errors can name file, line and key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from builder.errors import ConfigError

DocPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Located:
    """A YAML document as plain Python values plus the line (1-based) of each path."""

    file: Path
    data: Any
    lines: dict[DocPath, int]

    def line(self, path: DocPath) -> int:
        """The line of ``path``, or of its nearest ancestor that has one."""
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path, 1)

    def fail(self, path: DocPath, message: str) -> ConfigError:
        return ConfigError(f"{self.file}:{self.line(path)}: {format_path(path)}: {message}")


def format_path(path: DocPath) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "(top level)"


def load(file: Path) -> Located:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file; pass --matrix with the path of a matrix file") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(f"{file}:{line}: YAML syntax error: {exc.problem}") from None
    lines: dict[DocPath, int] = {}
    data = _convert(node, (), lines, file) if node is not None else {}
    return Located(file=file, data=data, lines=lines)


def _convert(node: yaml.Node, path: DocPath, lines: dict[DocPath, int], file: Path) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(f"{file}:{key_node.start_mark.line + 1}: mapping keys must be plain strings")
            if key in result:
                raise ConfigError(
                    f"{file}:{key_node.start_mark.line + 1}: {format_path((*path, key))}: "
                    f"duplicate key '{key}' (first at line {lines[(*path, key)]}); remove one"
                )
            lines[(*path, key)] = key_node.start_mark.line + 1
            result[key] = _convert(value_node, (*path, key), lines, file)
            lines[(*path, key)] = key_node.start_mark.line + 1
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), lines, file) for i, item in enumerate(node.value)]
    # Scalars go through PyYAML's own resolver, so `12.9` is a float here and the schema can
    # ask for quotes instead of silently turning `12.10` into 12.1.
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
