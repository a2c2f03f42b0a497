"""The build cache across runners for real, with this machine's docker 20.10 client (no buildx):
BuildKit's inline cache, carried by a stage image pushed to a real registry, lets a build on an
engine that never ran the step (its image and BuildKit's record of it removed) skip that step,
though the stage's hash changed."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from sparkbuild.build import build, buildcache
from sparkbuild.config.options import Options
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import plan
from sparkbuild.plan.plan import STAGE_REPOSITORY
from tests.support import ROOT
from tests.support.matrix import local_target

pytestmark = pytest.mark.docker


def write_project(tmp_path: Path, marker: str, second_step: bool) -> Options:
    """A local target of two tiny stages: ``layers`` (a RUN that writes the marker; with
    ``second_step``, another RUN after it) and the image, which copies its file."""
    folder = tmp_path / "dockerfiles" / "local"
    folder.mkdir(parents=True, exist_ok=True)
    second = f"RUN echo {marker}-second > /second\n" if second_step else ""
    (folder / "10-layers.Dockerfile.j2").write_text(f"FROM {{{{ base_image }}}}\nRUN echo {marker} > /first\n{second}")
    (folder / "90-image.Dockerfile.j2").write_text(
        'FROM {{ base_image }}\nCOPY --from={{ stage("layers") }} /first /first\nCMD ["cat", "/first"]\n'
    )
    head = (ROOT / "matrix.yaml").read_text().split("targets:")[0]
    target = "targets:\n" + local_target(
        id="cache-test",
        torch_index="https://download.pytorch.org/whl/cpu",
        base="debian-bookworm",
        repository="sparkbuild-test/cache-image",
    )
    (tmp_path / "matrix.yaml").write_text(head + target)
    return Options.from_env(
        matrix=tmp_path / "matrix.yaml",
        dockerfiles=tmp_path / "dockerfiles",
        cache=tmp_path / "cache",
        out=tmp_path / "out",
        build_cache="inline",
    )


def forget(engine: Engine, marker: str, names: list[str]) -> None:
    """What a runner that never built these has: none of the images, no BuildKit record of the steps."""
    for name in names:
        if engine.image_exists(name):
            engine.client.images.remove(name, force=True)
    engine.prune_build_cache([r for r in engine.build_cache() if marker in r.description])
    left = [r.id for r in engine.build_cache() if marker in r.description]
    assert left == [], f"BuildKit still holds {left}"


def step(log: str, command: str) -> str:
    """Every line of the BuildKit step (plain progress) that runs ``command``."""
    match = re.search(rf"^(#\d+) \[[^\]]*\] RUN {re.escape(command)}$", log, re.MULTILINE)
    assert match is not None, f"no step RUN {command} in the log"
    return "\n".join(line for line in log.splitlines() if line.startswith(f"{match.group(1)} "))


def test_inline_cache_from_the_registry_skips_steps_on_another_runner(
    engine: Engine, base: str, tmp_path: Path, registry: Registry
) -> None:
    if not engine.cli.builder.buildx:  # Debian's 20.10 client: the fallback is chosen, not only forced
        assert buildcache.choose("auto", engine.cli.builder, True).mode is buildcache.Mode.INLINE
    marker = f"sparkbuild-cache-test-{time.time_ns()}"  # a step no earlier build ran
    first = write_project(tmp_path, marker, second_step=False)
    (p1,) = plan.make(first)
    layers1 = p1.stages[0]
    cache_ref = buildcache.ref(registry.host, p1.id, "layers")
    cache_repository, cache_tag = cache_ref.removeprefix(f"{registry.host}/").rsplit(":", 1)
    made = [p1]
    try:
        assert [s.action for s in build.build(engine, p1, first, registry).stages] == ["built", "built"]
        # The stage image is in the registry under its content tag and, moved there, under its cache tag.
        pushed = registry.digest(STAGE_REPOSITORY, layers1.ref.rsplit(":", 1)[1])
        assert pushed is not None and registry.digest(cache_repository, cache_tag) == pushed

        # Another runner: a changed stage (one more step), an engine that never ran the first step.
        forget(engine, marker, [layers1.ref, f"{registry.host}/{layers1.ref}", cache_ref, p1.stages[-1].ref])
        second = write_project(tmp_path, marker, second_step=True)
        (p2,) = plan.make(second)
        made.append(p2)
        layers2 = p2.stages[0]
        assert layers2.content_hash != layers1.content_hash
        assert [s.action for s in build.build(engine, p2, second, registry).stages] == ["built", "built"]

        log = (second.out / p2.id / "build-layers.log").read_text()
        assert f"importing cache manifest from {cache_ref}" in log
        reused, ran = step(log, f"echo {marker} > /first"), step(log, f"echo {marker}-second > /second")
        assert reused.endswith("CACHED"), reused
        assert "CACHED" not in ran and "DONE" in ran, ran
        # The cache tag moved to the new stage image, for the next runner.
        assert registry.digest(cache_repository, cache_tag) == registry.digest(STAGE_REPOSITORY, layers2.ref.rsplit(":", 1)[1])
    finally:
        forget(engine, marker, [*(n for p in made for s in p.stages for n in (s.ref, f"{registry.host}/{s.ref}")), cache_ref])
