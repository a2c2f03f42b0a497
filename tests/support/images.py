"""Images tests build: the shipped local target as the nightly builds it (or with some of its keys
changed), and images derived from another, one layer away, built for real (an input broken on purpose)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbuild.build import build
from sparkbuild.config import options
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from sparkbuild.plan.matrix import Check
from sparkbuild.verify import verify
from tests.support import ROOT
from tests.support.matrix import LOCAL_PLATFORM


def local_image(engine: Engine, cache: Path, out: Path, **changes: Any) -> str:
    """The shipped matrix's local target with ``changes`` to its keys, built (or found by content) as
    the nightly builds it; ``out`` gets its matrix and the build's output."""
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    (local,) = [t for t in shipped["targets"] if t.get("profile") == "local"]
    shipped["targets"] = [{**local, **changes}]
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


def verify_each(
    engine: Engine, images: dict[str, str], check: Check, cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[verify.Verified, Path]]:
    """Verify ``check`` on each of ``images`` (name to image), side by side: a server start is mostly
    imports, and each waits on its own requests. Each name's result and its verify.json.

    Each image's engine is bound to one of this host's CPUs in turn (``bound_to_one_cpu``): left to
    itself, vLLM's CPU engine binds to the first CPU it does not reserve, the same one in every server,
    so the engines' model loads and steps took turns on it (five servers healthy in 117 s; spread over
    2 CPUs, 88 s; measured 2026-12-06). One thread each, as on the 2-core machine CI is."""
    cpus = sorted(os.sched_getaffinity(0))
    for i, (name, image) in enumerate(images.items()):
        bound_to_one_cpu(engine, image, cpus[i % len(cpus)], tmp_path_factory.mktemp(f"bound-{name}"))
    out = {name: tmp_path_factory.mktemp(f"verify-{name}") / "verify.json" for name in images}
    with ThreadPoolExecutor(max_workers=len(images)) as pool:
        futures = {n: pool.submit(verify.verify_all, engine, i, [check], out[n], cache=cache) for n, i in images.items()}
        return {n: (f.result(), out[n]) for n, f in futures.items()}


def bound_to_one_cpu(engine: Engine, image: str, cpu: int, folder: Path) -> str:
    """``image`` (the same tag) with its vLLM CPU engine's threads bound to ``cpu`` alone
    (``VLLM_CPU_OMP_THREADS_BIND``, vLLM's own setting): a metadata layer, nothing else changed."""
    return derived_image(engine, image, image, f"ENV VLLM_CPU_OMP_THREADS_BIND={cpu}", folder)


class Created:
    """The containers the engine creates from ``images`` while the block runs, by Docker's own events
    (``docker events``, nanosecond bounds: an event of the second before the block is not counted).

    ``named``: only those whose name starts so, the names the code under test gives its containers.
    The other worker's tests create containers from the same images meanwhile (the local image
    above all): counted by image alone, a test that asserts "nothing started" failed for a container of
    another module's test created in its second (seen in a warm run, 2026-12-08)."""

    def __init__(self, engine: Engine, *images: str, named: str = "") -> None:
        self.engine, self.images, self.named = engine, list(images), named
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Created:
        self.since = f"{time.time():.9f}"
        return self

    def __exit__(self, *exc: object) -> None:
        wanted = {"type": "container", "event": "create", "image": self.images}
        until = f"{time.time():.9f}"
        found = self.engine.client.events(since=self.since, until=until, filters=wanted, decode=True)
        self.events = [e for e in found if str(e["Actor"]["Attributes"].get("name", "")).startswith(self.named)]
