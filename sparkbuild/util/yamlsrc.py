"""Load YAML keeping the line of every value, so errors can name file, line and key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sparkbuild.errors import ConfigError

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


# Bounds on any YAML sparkbuild reads (matrix, patch.yaml): a document is configuration, so these
# are far above real use and far below what takes memory or minutes.
MAX_BYTES = 256 * 1024
MAX_DEPTH = 32
# Values after expanding aliases: a few "billion laughs" lines stop here, not at gigabytes.
MAX_NODES = 20_000
MAX_SCALAR_CHARS = 16 * 1024


try:
    from yaml import CSafeLoader as _ShippedLoader
except ImportError:  # PyYAML built without libyaml: its own parser, the same values
    from yaml import SafeLoader as _ShippedLoader  # type: ignore[assignment]


class _Refused(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, composing only: no tags (``!!int``, ``!custom``), bounded depth and size."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        line = event.start_mark.line + 1
        tag = getattr(event, "tag", None)
        if tag is not None:
            shown = tag.replace("tag:yaml.org,2002:", "!!")
            raise _Refused(line, f"YAML tag '{shown}' is not allowed here; write the plain value")
        self._depth += 1
        self._nodes += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(line, f"nested deeper than {MAX_DEPTH} levels")
        if self._nodes > MAX_NODES:
            raise _Refused(line, f"more than {MAX_NODES} values")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_shipped(text: str) -> Any:
    """A YAML file sparkbuild ships (its defaults, kernel paths, CPU rules): not the user's, so no
    bounds or lines. Parsed by libyaml, which PyYAML's wheels carry: the same values as PyYAML's
    own parser gives, in a tenth of the time (every run reads two of these)."""
    return yaml.load(text, Loader=_ShippedLoader)


def read_text(file: Path, what: str, limit: int = MAX_BYTES) -> str:
    """A regular file's text, at most ``limit`` bytes of UTF-8; anything else is a ConfigError."""
    hint = f"pass the path of a {what}"
    try:
        if not file.is_file():
            problem = "no such file" if not file.exists() else "not a regular file"
            raise ConfigError(f"{file or '(empty path)'}: {problem}; {hint}")
        with file.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read it ({exc.strerror}); {hint}") from None
    if len(data) > limit:
        raise ConfigError(f"{file}: larger than {limit // 1024} KiB, the limit for a {what}; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{file}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x}); save the file as UTF-8") from None


def load(file: Path, what: str = "YAML file") -> Located:
    """Parse ``file`` (a ``what``, for messages) within the bounds above; every problem names file and line."""
    text = read_text(file, what)
    try:
        node = _Loader(text).get_single_node()
    except _Refused as exc:
        raise ConfigError(f"{file}:{exc.line}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(f"{file}:{line}: YAML syntax error: {exc.problem}") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{file}:{line}: control character U+{exc.character:04X} is not allowed; remove it") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: YAML error: {exc}") from None
    lines: dict[DocPath, int] = {}
    budget = [MAX_NODES]
    data = _convert(node, (), lines, file, budget) if node is not None else {}
    return Located(file=file, data=data, lines=lines)


def _convert(node: yaml.Node, path: DocPath, lines: dict[DocPath, int], file: Path, budget: list[int]) -> Any:
    line = node.start_mark.line + 1
    lines[path] = line
    # Aliases share nodes, so the composer's bounds do not hold after expansion: count again.
    budget[0] -= 1
    if budget[0] < 0 or len(path) > MAX_DEPTH:
        problem = f"more than {MAX_NODES} values" if budget[0] < 0 else f"nested deeper than {MAX_DEPTH} levels"
        raise ConfigError(f"{file}:{line}: {problem} once aliases are expanded")
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
            result[key] = _convert(value_node, (*path, key), lines, file, budget)
            lines[(*path, key)] = key_node.start_mark.line + 1
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), lines, file, budget) for i, item in enumerate(node.value)]
    return _scalar(node, file, line)


def _scalar(node: yaml.Node, file: Path, line: int) -> Any:
    if len(node.value) > MAX_SCALAR_CHARS:
        raise ConfigError(f"{file}:{line}: a value of {len(node.value)} characters; the limit is {MAX_SCALAR_CHARS}")
    # Scalars go through PyYAML's own resolver, so `12.9` is a float here and the schema can
    # ask for quotes instead of silently turning `12.10` into 12.1.
    try:
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
    except (ValueError, OverflowError, yaml.YAMLError) as exc:
        raise ConfigError(f"{file}:{line}: '{node.value[:40]}' cannot be read as a value ({exc}); quote it") from None
