"""What the speed gate is proven with (tests/verify/test_speed_gate.py, bench/speed_gate.py):
local images made slower on purpose (tests/data/slower_vllm.py), one layer from the shipped one, the
inputs the gate exists to catch; and a check's speed measured on an image as verify measures it."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Literal

import docker.errors

from sparkbuild.oci import jitcache
from sparkbuild.oci.engine import Engine
from sparkbuild.plan.matrix import Check
from sparkbuild.verify import benchmark, checkmodel, speed, verify
from sparkbuild.verify.benchmark import Benchmark
from tests.support import DATA
from tests.support.images import derived_image

SCRIPT = DATA / "slower_vllm.py"
Kind = Literal["moe", "decode"]


def slowed_image(engine: Engine, image: str, kind: Kind, seconds: float, folder: Path) -> str:
    """``image`` with a sleep of ``seconds`` after its CPU MoE kernel call (``moe``) or in every
    decode step (``decode``): built for real; its tag, ``sparkbuild-test/slower-<kind>:<ms>``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, folder / SCRIPT.name)
    step = f"RUN --mount=type=bind,source={SCRIPT.name},target=/tmp/{SCRIPT.name} python3 /tmp/{SCRIPT.name} {kind} {seconds}"
    return derived_image(engine, image, f"sparkbuild-test/slower-{kind}:{round(seconds * 1000)}ms", step, folder)


def remove(engine: Engine, image: str) -> None:
    """The slowed image and the volume its servers compiled into (each image has its own)."""
    volumes = jitcache.for_image(str(engine.inspect(image)["Id"]))
    # Forced: a server container left stopped (a run killed before its cleanup) must not keep it.
    engine.client.images.remove(image, force=True)
    for volume in volumes:
        with contextlib.suppress(docker.errors.NotFound):  # a cache the server never wrote
            engine.client.volumes.get(volume).remove()


def measure(engine: Engine, image: str, check: Check, cache: Path, folder: Path, *, only_judged: bool = False) -> Benchmark:
    """``check``'s speed on ``image``: served as verify serves it (a fresh server, the image's own
    compile volume), benchmarked by ``vllm bench serve`` from the image. ``only_judged``: where this
    host leaves the benchmark client no CPU of its own (``benchmark.contention``), the levels above 1
    are not measured, since the gate judges none of their figures there (the suite's time; the bench
    measures them all)."""
    model = checkmodel.provide(cache, check)
    with verify.started(engine, image, check, model) as (container, url):
        verify.wait_healthy(container, url, check.startup_timeout)
        if only_judged and 1 in check.concurrency and benchmark.contention(container.logs(tail=None), engine.cpus()):
            check = dataclasses.replace(check, concurrency=(1,))
        return speed.measure(
            engine,
            image,
            check,
            model,
            url=url,
            served_name=verify.MODEL_NAME,
            folder=folder,
            read_log=lambda: container.logs(tail=None),
        )
