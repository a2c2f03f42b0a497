"""The lock file: what ``sparkbuild resolve`` pinned, read back by every later command.

Pure data. The matrix names refs (``v0.33.0``, ``main``) and image tags; the lock maps each to the
commit or digest it had when resolved, so a nightly builds exactly what it resolved, and rerunning
with the same lock rebuilds the same thing. A commit written in the matrix itself wins over the lock.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.externals import External, ScanError

LOCK_FORMAT = 1
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Lock:
    # repository URL -> ref -> commit
    git: dict[str, dict[str, str]] = field(default_factory=dict)
    # image name with its tag (no digest) -> manifest digest
    images: dict[str, str] = field(default_factory=dict)
    resolved_at: str = ""
    file: Path | None = None
    # "<vLLM repository>@<commit>" -> the external projects its CMake files clone, pinned
    externals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def commit(self, repo: str, ref: str) -> str | None:
        return self.git.get(repo, {}).get(ref)

    def externals_of(self, repo: str, commit: str) -> tuple[External, ...] | None:
        """The pinned external projects of one vLLM commit; None when resolve has not read them."""
        found = self.externals.get(externals_key(repo, commit))
        if found is None:
            return None
        try:
            return tuple(External.from_json(e) for e in found)
        except ScanError as exc:
            raise ConfigError(f"{self.file}: externals: {exc}; run `sparkbuild resolve`") from None

    def digest(self, image: str) -> str | None:
        return self.images.get(image)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LOCK_FORMAT,
            "resolved_at": self.resolved_at,
            "git": {repo: dict(sorted(refs.items())) for repo, refs in sorted(self.git.items())},
            "images": dict(sorted(self.images.items())),
            "externals": dict(sorted(self.externals.items())),
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def externals_key(repo: str, commit: str) -> str:
    return f"{repo}@{commit}"


def default_path(matrix_file: Path) -> Path:
    """``matrix.yaml`` -> ``matrix.lock.json`` beside it."""
    return matrix_file.with_name(f"{matrix_file.stem}.lock.json")


def read(path: Path) -> Lock:
    """Read and check a lock file; every problem names the file and what to do."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable lock file ({exc}); run `sparkbuild resolve` to write it again") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != LOCK_FORMAT:
        raise ConfigError(f"{path}: lock format {found} is not {LOCK_FORMAT}; run `sparkbuild resolve` to write it again")
    gits = data.get("git", {})
    images = data.get("images", {})
    for repo, refs in gits.items():
        for ref, commit in refs.items():
            if not _SHA.match(str(commit)):
                raise ConfigError(f"{path}: git.{repo}.{ref}: '{commit}' is not a full commit SHA; run `sparkbuild resolve`")
    for image, digest in images.items():
        if not _DIGEST.match(str(digest)):
            raise ConfigError(f"{path}: images.{image}: '{digest}' is not a sha256 digest; run `sparkbuild resolve`")
    found_externals = data.get("externals", {})
    if not isinstance(found_externals, dict) or not all(isinstance(v, list) for v in found_externals.values()):
        raise ConfigError(f"{path}: externals: expected a mapping of lists; run `sparkbuild resolve`")
    return Lock(git=gits, images=images, resolved_at=str(data.get("resolved_at", "")), file=path, externals=found_externals)
