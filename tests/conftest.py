"""Shared fixtures. Unit tests need no Docker; tests marked `docker` use the real engine."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import pytest
import requests

from sparkbuild.build import base_image
from sparkbuild.config import options
from sparkbuild.models import model
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry, embedded
from sparkbuild.plan import matrix
from tests.support import ROOT, cli, images, leftovers, workers
from tests.support import matrix as support_matrix
from tests.support.matrix import MatrixWriter

# Fixtures every test may use, wherever it lives: vLLM source trees, a real upstream of releases, and
# linux/arm64 made runnable (emulated on x86_64).
pytest_plugins = ["tests.support.trees", "tests.support.upstream", "tests.support.emulation", "tests.support.browser"]

# A suite started in the background by a script (`.ci/run &`, nohup) inherits SIGINT ignored, and so
# would every sparkbuild process it starts: the Ctrl-C tests' processes would then never see their
# Ctrl-C. A handler here (not an ignore) gives each child the default again when it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The check models the suite serves, in the order its tests first need them.
EARLY_MODELS = ("alphabet", "alphabet-reversed", "moe-alphabet", "moe-nvfp4", "moe-nvfp4a16", "moe-fp8", "gptoss-mxfp4")
_early: dict[str, subprocess.Popen[bytes]] = {}


def models_cache() -> Path:
    """A cache folder whose models are the ones the ``cache`` fixture gives the session."""
    keep = os.environ.get("SPARKBUILD_TEST_CACHE")
    if keep:
        return Path(keep)
    models = Path(os.environ.get("SPARKBUILD_TEST_MODELS") or options.default_cache() / "models")
    if models == options.default_cache() / "models":
        return options.default_cache()
    folder = Path(tempfile.mkdtemp(prefix="sparkbuild-early-models-"))
    models.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(models)
    return folder


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the session runs tests that serve check models (``docker``) and the cache lacks some (a cold
    run: about ten minutes of making, on one core by design), they are made in the background from the
    start, while the first tests build images; a test that needs one meanwhile waits on its lock."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # one worker makes them; the other waits on a model's lock where it needs one first
    if not any(item.get_closest_marker("docker") for item in session.items):
        return
    cache = models_cache()
    missing = [n for n in EARLY_MODELS if not (model.model_dir(cache, n) / "sparkbuild-model.json").is_file()]
    if not missing:
        return
    log_path = Path(tempfile.gettempdir()) / f"sparkbuild-early-models-{os.getpid()}.log"
    command = [sys.executable, "-m", "tests.support.early_models", str(cache), *missing]
    print(f"\nmaking {', '.join(missing)} in the background (log: {log_path}): {shlex.join(command)}")
    with log_path.open("wb") as out:
        _early["making"] = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_configure(config: pytest.Config) -> None:
    workers.configure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller, as it starts a worker: the session's shared folder."""
    workers.configure_node(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> workers.Scheduler | None:
    return workers.Scheduler(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """A worker ended: the build records its tests marked as the next session's."""
    for block, ids in (getattr(node, "workeroutput", {}) or {}).get("kept", {}).items():
        leftovers.KEPT.setdefault(block, set()).update(ids)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test's turn: beside the other worker's, or ``alone`` (tests/support/workers.py)."""
    with workers.turn(item.config, item.get_closest_marker("alone") is not None):
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A making still under way when the session ends (a run cut short, or one that needed no model) is
    interrupted: its half-made folder is removed (the making's own cleanup), never cached.

    A worker hands the controller the records its tests kept; the controller (or the one process of a
    run without workers), once every test has ended, removes what the session left in the engine."""
    making = _early.pop("making", None)
    if making is not None and making.poll() is None:
        os.killpg(making.pid, signal.SIGINT)
        making.wait(timeout=60)
    if workers.is_worker(session.config):
        session.config.workeroutput["kept"] = {b: sorted(ids) for b, ids in leftovers.KEPT.items()}  # type: ignore[attr-defined]
        return
    before = workers.done("engine")
    if before is not None and not leftovers.keeping():
        leftovers.clean(Engine(), set(before))


def pytest_unconfigure(config: pytest.Config) -> None:
    workers.unconfigure(config)


@pytest.fixture(autouse=True)
def no_sparkbuild_left() -> Iterator[None]:
    """A sparkbuild process a test started and left running (a failed assertion before its end) is
    ended after the test, so it cannot fail the next one."""
    yield
    cli.end_started()


@pytest.fixture
def write_matrix(tmp_path: Path) -> MatrixWriter:
    """Write a matrix (checks and bases are prepended unless given) with a patches/ folder beside it."""

    def write(body: str, with_checks: bool = True) -> Path:
        return support_matrix.write(tmp_path, body, with_checks)

    return write


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The Docker engine. The first worker to ask removes what an earlier session cut short left in
    it and notes its build records; what this session leaves is removed as it ends
    (``pytest_sessionfinish``, tests/support/leftovers.py), unless SPARKBUILD_TEST_KEEP_IMAGES=1 keeps
    it to look at."""
    found = Engine()
    workers.once("engine", lambda: leftovers.start(found))
    return found


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
    # Emptied once a session, by the first worker that asks (the other may be publishing to it by then).
    (folder / "registry").symlink_to(Path(workers.once("registry", lambda: str(emptied_registry()))))
    return folder


def emptied_registry() -> Path:
    """The embedded registry storage of the session's cache: kept from one session to the next as
    a layer cache (SPARKBUILD_TEST_REGISTRY, default ``~/.cache/sparkbuild/test-registry``), and
    emptied of every image through the registry's API as the session starts, so each session
    publishes anew. Its blobs stay: at the address the registry keeps (sparkbuild/oci/registry.py), Docker
    mounts the layers an earlier session pushed instead of compressing the local image again
    (minutes). Remove the folder to start from nothing."""
    data = Path(os.environ.get("SPARKBUILD_TEST_REGISTRY") or options.default_cache() / "test-registry")
    if folder_bytes(data) > REGISTRY_KEPT_BYTES:
        shutil.rmtree(data)  # each session adds its own images' layers: start again from nothing
    with embedded(data) as registry:
        for repository in catalog(registry):
            for tag in registry.tags(repository):
                digest = registry.digest(repository, tag)
                if digest is not None:  # None: an earlier delete took this tag with its manifest
                    registry.delete(repository, digest)
    return data


# What the kept test registry may hold before a session starts it again from nothing: the local
# image's layers (about 2 GB compressed) and a few sessions' worth of the images tests publish.
REGISTRY_KEPT_BYTES = 5 * 10**9


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


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
    return images.local_image(engine, cache, tmp_path_factory.mktemp("local-image"))


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """A real registry (Debian's docker-registry) on 127.0.0.1 for one test."""
    with embedded(tmp_path / "registry") as reg:
        yield reg


# Fixtures that need a running Docker engine. A test that uses one, directly or through another
# fixture, must be marked `docker` (the markers are declared strictly in pyproject.toml), so that
# `pytest -m "not docker"` selects exactly what runs without an engine.
NEEDS_DOCKER = frozenset({"engine", "base"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = workers.ordered(items)
    unmarked = [
        item.nodeid
        for item in items
        if NEEDS_DOCKER & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("docker") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"these tests use a Docker engine but are not marked docker: {', '.join(unmarked)}")
