"""Shared fixtures. Unit tests need no Docker; tests marked `docker` use the real engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import urljoin

import pytest
import requests
import yaml

from builder import base_image, build, gitrepo, host, matrix, options, plan
from builder.engine import Engine
from builder.registry import Registry, embedded

ROOT = Path(__file__).resolve().parent.parent
# The local profile builds and serves for this host's own platform (the shipped matrix names none):
# tests that build or run an image, or name the local target, take it from here, so the suite runs
# the same on x86_64 and aarch64.
LOCAL_PLATFORM = host.host_platform()


def local_id(version: str = "0.32.0") -> str:
    """The id of a local target of vLLM ``version`` (``rc`` in the rc lane) on this host:
    ``vllm-0.32.0-cpu-amd64`` on x86_64, ``vllm-0.32.0-cpu-arm64`` on aarch64."""
    return matrix.target_id(version, None, "", LOCAL_PLATFORM)


CHECKS = """\
checks:
  alphabet:
    model: alphabet
    prompts:
      - {name: completion, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}
bases:
  deb:
    debootstrap: {suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}
"""


PATCH_YAML = """\
summary: test patch {name}
why: a patch folder for the matrix tests
component: vllm
versions: ">=0.1"
upstream: {{links: []}}
change: {{diff: fix.diff}}
"""


def quick_checks(path: Path) -> Path:
    """Rewrite the matrix at ``path`` so that each check's benchmark runs one level once, eager.

    For the tests whose subject is a lane, an installed tool or a report, not the speed: the README's
    main job (tests/integration/test_nightly.py) runs the shipped checks in full, and
    tests/integration/test_benchmark.py measures the benchmark itself."""
    data = yaml.safe_load(path.read_text())
    for check in data["checks"].values():
        check.update(concurrency=[1], bench_repeats=1)
        # Eager too: these tests build images of their own (their content differs), and each would
        # compile anew; the compiled path is served by the main job's test (test_nightly.py).
        args = check.setdefault("serve_args", [])
        if "--enforce-eager" not in args:
            args.append("--enforce-eager")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class MatrixWriter(Protocol):
    def __call__(self, body: str, with_checks: bool = True) -> Path: ...


@pytest.fixture
def write_matrix(tmp_path: Path) -> MatrixWriter:
    """Write a matrix (checks and bases are prepended unless given) with a patches/ folder beside it."""

    def write(body: str, with_checks: bool = True) -> Path:
        for name, diff in (("one", "--- a\n+++ b\n"), ("two", "two\n")):
            (tmp_path / "patches" / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / "patches" / name / "fix.diff").write_text(diff)
            (tmp_path / "patches" / name / "patch.yaml").write_text(PATCH_YAML.format(name=name))
        text = (CHECKS if with_checks else "") + textwrap.dedent(body)
        path = tmp_path / "matrix.yaml"
        path.write_text(text)
        return path

    return write


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sparkbuild's cache for the test session; SPARKBUILD_TEST_CACHE keeps it between runs.

    Its check models are sparkbuild's own model cache (``~/.cache/sparkbuild/models``) even so:
    they are cached by content, and written only once proven (the MoE ones take minutes to make).
    SPARKBUILD_TEST_MODELS names another folder for them."""
    keep = os.environ.get("SPARKBUILD_TEST_CACHE")
    if keep:
        return Path(keep)
    folder = tmp_path_factory.mktemp("sparkbuild-cache")
    models = Path(os.environ.get("SPARKBUILD_TEST_MODELS") or options.default_cache() / "models")
    models.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(models)
    (folder / "registry").symlink_to(emptied_registry())
    return folder


def emptied_registry() -> Path:
    """The embedded registry storage of the session's cache: kept from one session to the next as
    a layer cache (SPARKBUILD_TEST_REGISTRY, default ``~/.cache/sparkbuild/test-registry``), and
    emptied of every image through the registry's API as the session starts, so each session
    publishes anew. Its blobs stay: at the address the registry keeps (builder/registry.py), Docker
    mounts the layers an earlier session pushed instead of compressing the local image again
    (minutes). Remove the folder to start from nothing."""
    data = Path(os.environ.get("SPARKBUILD_TEST_REGISTRY") or options.default_cache() / "test-registry")
    with embedded(data) as registry:
        for repository in catalog(registry):
            for tag in registry.tags(repository):
                digest = registry.digest(repository, tag)
                if digest is not None:  # None: an earlier delete took this tag with its manifest
                    registry.delete(repository, digest)
    return data


def catalog(registry: Registry) -> list[str]:
    """Every repository of the registry, page by page (``Link: <...>; rel="next"``)."""
    found: list[str] = []
    url: str | None = f"{registry.base_url}/_catalog?n=100"
    while url is not None:
        response = requests.get(url, timeout=30)
        response.raise_for_status()
        found += response.json().get("repositories") or []
        following = response.links.get("next", {}).get("url")
        url = None if following is None else urljoin(registry.base_url, following)
    return found


@pytest.fixture(scope="session")
def base(engine: Engine, cache: Path) -> str:
    """The shipped matrix's base image, made with debootstrap (cached by content in the engine)."""
    target = matrix.load(ROOT / "matrix.yaml").targets[0]
    return base_image.ensure(engine, target.base, target.platform, cache / "rootfs")


@pytest.fixture(scope="session")
def local_image(engine: Engine, base: str, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shipped matrix's local target, built (or found by content) as the nightly builds it."""
    out = tmp_path_factory.mktemp("local-image")
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    shipped["targets"] = [t for t in shipped["targets"] if t.get("profile") == "local"]
    shipped.pop("rehearsal", None)
    (out / "matrix.yaml").write_text(yaml.safe_dump(shipped, sort_keys=False))
    (out / "patches").symlink_to(ROOT / "patches")
    opts = options.Options.from_env(matrix=out / "matrix.yaml", cache=cache, out=out)
    (p,) = plan.make(opts)
    return build.build(engine, p, opts).image


def derived_image(engine: Engine, image: str, tag: str, steps: str, folder: Path, files: dict[str, str] | None = None) -> str:
    """An image one layer away from ``image`` (``steps``: Dockerfile lines after its FROM; ``files``:
    written into the build context), built for real: an input broken on purpose in one known way."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    (folder / "Dockerfile").write_text(f"FROM {image}\n{steps}\n")
    engine.build(
        context=folder,
        tag=tag,
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=folder / "build.log",
    )
    return tag


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """A real registry (Debian's docker-registry) on 127.0.0.1 for one test."""
    with embedded(tmp_path / "registry") as reg:
        yield reg


# --- real git repositories and the sparkbuild command, for tests that need them ------------------

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Upstream Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.invalid",
    "GIT_COMMITTER_NAME": "Upstream Dev",
    "GIT_COMMITTER_EMAIL": "dev@example.invalid",
    "PATH": "/usr/bin:/bin",
}


def git(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(["git", *map(str, args)], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True)
    return result.stdout.strip()


# One daemon for the tests and `sparkbuild rehearse --offline`: the package's own.
git_daemon = gitrepo.daemon


def run_sparkbuild(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``sparkbuild ARGS`` as a user runs it (a new process), with ``env`` added to this one's."""
    result = subprocess.run(
        [sys.executable, "-m", "builder", *args], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT
    )
    sys.stderr.write(result.stderr[-4000:])
    return result
