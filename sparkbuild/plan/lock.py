"""The lock file: what ``sparkbuild resolve`` pinned, read back by every later command.

Pure data. The matrix names refs (``v0.33.0``, ``main``) and image tags; the lock maps each to the
commit or digest it had when resolved, so a nightly builds exactly what it resolved, and rerunning
with the same lock rebuilds the same thing. A commit written in the matrix itself wins over the lock.

``wheels`` pins upstream's published vLLM wheel of a release for a platform (file, URL, sha256) with
what resolve found in it: check-binary's verdict per GPU, the torch it requires and the CUDA major its
extensions link. A Spark target's plan reads it to choose between that wheel and the source build.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbuild.errors import ConfigError
from sparkbuild.upstream.externals import External, ScanError
from sparkbuild.util import yamlsrc

LOCK_FORMAT = 1
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, kw_only=True)
class BinaryVerdict:
    """check-binary of every library of a wheel, for one GPU: kernels by verdict (sass, ptx, other, fails)."""

    ok: bool
    libraries: int
    kernels: int
    sass: int
    ptx: int
    other: int
    fails: int
    # Why it failed, as check-binary says it (the failing kernels, or nothing that runs); "" when ok.
    error: str = ""

    def text(self) -> str:
        counts = f"{self.kernels} kernels in {self.libraries} libraries: {self.sass} sass, {self.ptx} ptx, {self.other} other"
        return f"{counts}, {self.fails} fail" + (f" ({self.error})" if self.error else "")


@dataclass(frozen=True, kw_only=True)
class WheelPin:
    """Upstream's vLLM wheel of ``version`` for ``platform``, pinned by ``resolve``; or, with
    ``missing``, why the index has none."""

    version: str
    platform: str
    index: str
    filename: str | None = None
    url: str | None = None
    sha256: str | None = None
    # The wheel's own torch requirement (Requires-Dist), e.g. "torch==2.14.0"; None: it names none.
    torch: str | None = None
    # The CUDA major its extensions link (DT_NEEDED libcudart.so.N); None: none links libcudart.
    cuda: str | None = None
    check_binary: dict[str, BinaryVerdict] = field(default_factory=dict)
    missing: str | None = None

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"version": self.version, "platform": self.platform, "index": self.index}
        if self.missing is not None:
            return {**found, "missing": self.missing}
        return {
            **found,
            "filename": self.filename,
            "url": self.url,
            "sha256": self.sha256,
            "torch": self.torch,
            "cuda": self.cuda,
            "check_binary": {gpu: vars(v) for gpu, v in sorted(self.check_binary.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WheelPin:
        """Raises ``ValueError`` naming what is wrong."""
        for key in ("version", "platform", "index"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"'{key}' is missing or not a string")
        if data.get("missing") is not None:
            return cls(version=data["version"], platform=data["platform"], index=data["index"], missing=str(data["missing"]))
        for key in ("filename", "url", "sha256"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"'{key}' is missing or not a string")
        if not _SHA256.match(data["sha256"]):
            raise ValueError(f"sha256 {data['sha256']!r} is not 64 hex digits")
        verdicts = data.get("check_binary") or {}
        if not isinstance(verdicts, dict):
            raise ValueError("'check_binary' is not a mapping of GPUs to verdicts")
        try:
            found = {str(gpu): BinaryVerdict(**v) for gpu, v in verdicts.items()}
        except TypeError as exc:
            raise ValueError(f"check_binary: {exc}") from None
        return cls(
            version=data["version"],
            platform=data["platform"],
            index=data["index"],
            filename=data["filename"],
            url=data["url"],
            sha256=data["sha256"],
            torch=data.get("torch"),
            cuda=data.get("cuda"),
            check_binary=found,
        )


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
    # "vllm==<version> <platform>" -> upstream's wheel pinned (``WheelPin.to_json``)
    wheels: dict[str, dict[str, Any]] = field(default_factory=dict)

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

    def wheel(self, version: str, platform: str) -> WheelPin | None:
        """Upstream's vLLM wheel of ``version`` for ``platform``; None when resolve has not pinned it."""
        found = self.wheels.get(wheel_key(version, platform))
        if found is None:
            return None
        try:
            return WheelPin.from_json(found)
        except ValueError as exc:
            raise ConfigError(f"{self.file}: wheels.{wheel_key(version, platform)}: {exc}; run `sparkbuild resolve`") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LOCK_FORMAT,
            "resolved_at": self.resolved_at,
            "git": {repo: dict(sorted(refs.items())) for repo, refs in sorted(self.git.items())},
            "images": dict(sorted(self.images.items())),
            "externals": dict(sorted(self.externals.items())),
            "wheels": dict(sorted(self.wheels.items())),
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def externals_key(repo: str, commit: str) -> str:
    return f"{repo}@{commit}"


def wheel_key(version: str, platform: str) -> str:
    return f"vllm=={version} {platform}"


def default_path(matrix_file: Path) -> Path:
    """``matrix.yaml`` -> ``matrix.lock.json`` beside it."""
    if not matrix_file.name:  # "." or "/": not a matrix file, which loading it says
        return matrix_file / "matrix.lock.json"
    return matrix_file.with_name(f"{matrix_file.stem}.lock.json")


MAX_BYTES = 4 * 1024 * 1024


def read(path: Path) -> Lock:
    """Read and check a lock file; every problem names the file and what to do."""
    again = "run `sparkbuild resolve` to write it again"
    try:
        data = json.loads(yamlsrc.read_text(path, "lock file", MAX_BYTES))
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or {again}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: not a readable lock file ({str(exc)[:120]}); {again}") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != LOCK_FORMAT:
        raise ConfigError(f"{path}: lock format {found!r} is not {LOCK_FORMAT}; {again}")
    gits = _table(path, data, "git", dict)
    for repo in gits:
        for ref, commit in _table(path, gits, repo, str, f"git.{repo}").items():
            if not _SHA.match(commit):
                raise ConfigError(f"{path}: git.{repo}.{ref}: {commit!r} is not a full commit SHA; {again}")
    images = _table(path, data, "images", str)
    for image, digest in images.items():
        if not _DIGEST.match(digest):
            raise ConfigError(f"{path}: images.{image}: {digest!r} is not a sha256 digest; {again}")
    found_externals = _table(path, data, "externals", list)
    wheels = _table(path, data, "wheels", dict)
    for key, entry in wheels.items():
        try:
            WheelPin.from_json(entry)
        except ValueError as exc:
            raise ConfigError(f"{path}: wheels.{key}: {exc}; {again}") from None
    resolved_at = data.get("resolved_at", "")
    return Lock(
        git=gits,
        images=images,
        resolved_at=resolved_at if isinstance(resolved_at, str) else "",
        file=path,
        externals=found_externals,
        wheels=wheels,
    )


def _table(path: Path, data: dict[str, Any], key: str, value_type: type, where: str = "") -> dict[str, Any]:
    """``data[key]``: a mapping of names to ``value_type`` (a missing key is an empty mapping)."""
    table = data.get(key, {})
    name = where or key
    if not isinstance(table, dict) or not all(isinstance(v, value_type) for v in table.values()):
        kind = "mappings" if value_type is dict else "lists" if value_type is list else "strings"
        raise ConfigError(f"{path}: {name}: expected a mapping of names to {kind}; run `sparkbuild resolve` to write it again")
    return table
