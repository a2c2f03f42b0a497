"""Stages for real: the Spark source stage built here from a git remote made from a real vLLM
sdist, and stage reuse of the local profile counted through the engine and a real registry."""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry, embedded
from sparkbuild.plan import plan
from sparkbuild.upstream import sources
from tests.support import ROOT, leftovers
from tests.support.git import git, git_daemon
from tests.support.matrix import LOCAL_PLATFORM

pytestmark = pytest.mark.docker


def commit_tree(source: Path, repo: Path, tag: str) -> str:
    shutil.copytree(source, repo)
    git("init", "--quiet", "--initial-branch=main", cwd=repo)
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", tag, cwd=repo)
    git("tag", tag, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """vLLM 0.19.0's sdist as a git repository, and a small stand-in for CUTLASS, served on loopback."""
    root = tmp_path_factory.mktemp("git")
    vllm = sources.vllm_sdist("0.19.0", Options.from_env().cache)
    commits = {"vllm": commit_tree(vllm, root / "vllm", "v0.19.0")}
    # CUTLASS is not reachable here; its stand-in is one header (the source stage only fetches it).
    (root / "cutlass-src" / "include" / "cutlass").mkdir(parents=True)
    (root / "cutlass-src" / "include" / "cutlass" / "cutlass.h").write_text("#pragma once\n")
    commits["cutlass"] = commit_tree(root / "cutlass-src", root / "cutlass", "v4.2.1")
    with git_daemon(root) as url:
        yield url, commits


def spark_matrix(tmp_path: Path, url: str, commits: dict[str, str]) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_text(
        f"patches_dir: {ROOT / 'patches'}\n"
        + (ROOT / "matrix.yaml").read_text().split("targets:")[0]
        + textwrap.dedent(f"""\
        targets:
          - profile: spark
            id: source-test
            vllm: {{version: "0.19.0", repo: {url}/vllm, commit: {commits["vllm"]}}}
            cutlass: {{ref: v4.2.1, repo: {url}/cutlass, commit: {commits["cutlass"]}}}
            cuda: "12.9"
            torch: "2.10.0+cu129"
            platform: {LOCAL_PLATFORM}
            base: debian-bookworm
            runtime_base: debian-bookworm
            patches: [cmake-arch-sm121, e2m1-software]
            check: alphabet
        """)
    )
    return path


def test_the_source_stage_fetches_pinned_commits_and_applies_the_patches(
    engine: Engine, base: str, cache: Path, tmp_path: Path, served: tuple[str, dict[str, str]]
) -> None:
    url, commits = served
    opts = Options.from_env(matrix=spark_matrix(tmp_path, url, commits), cache=cache, out=tmp_path / "out")
    (p,) = plan.make(opts)
    stage = next(s for s in p.stages if s.name == "vllm")
    context = build.write_context(p, stage, tmp_path / "context", tmp_path)
    engine.build(
        context=context,
        tag="sparkbuild-test/source-stage:1",
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=tmp_path / "build.log",
        target="source",
    )
    record = json.loads(
        engine.copy_out("sparkbuild-test/source-stage:1", "/src/vllm/.sparkbuild-patches.json", tmp_path / "x").read_text()
    )
    statuses = {r["patch"]: r["status"] for r in record["results"]}
    assert statuses == {"cmake-arch-sm121": "upstream", "e2m1-software": "applies"}
    utils = engine.copy_out("sparkbuild-test/source-stage:1", "/src/vllm/csrc", tmp_path / "csrc")
    patched = next(utils.rglob("nvfp4_utils.cuh")).read_text()
    assert "fp32_to_e2m1_software" in patched and "SPARKBUILD_E2M1_HW" in patched
    fetched = engine.copy_out("sparkbuild-test/source-stage:1", "/src/sources.txt", tmp_path / "s").read_text().split()
    assert commits["vllm"] in fetched and commits["cutlass"] in fetched


def local_matrix(tmp_path: Path, serve: dict[str, int]) -> Path:
    """Two local targets that differ only in their serving defaults: one torch stage, two images."""
    shipped = (ROOT / "matrix.yaml").read_text().split("\n  # The Spark profile")[0]
    head, entry = shipped.split("targets:\n")
    entries = [
        entry.replace(
            "    repository: sparkbuild/vllm-cpu\n",
            f"    repository: sparkbuild-test/stages-{n}\n    id: local-{n}\n    serve: {{max_model_len: {serve[n]}}}\n",
        )
        for n in ("a", "b")
    ]
    path = tmp_path / "matrix.yaml"
    path.write_text(head + "targets:\n" + "".join(entries))
    return path


def actions(result: build.BuildResult) -> dict[str, str]:
    return {s.name: s.action for s in result.stages}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """One registry for this module's tests: the local torch stage (GBs) is pushed to it once."""
    with embedded(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.mark.alone  # it removes the torch stage, which the local image's builds share by content
def test_stages_are_built_once_shared_and_pulled_by_another_runner(
    engine: Engine, base: str, cache: Path, tmp_path: Path, registry: Registry
) -> None:
    def run(serve: dict[str, int]) -> dict[str, dict[str, str]]:
        opts = Options.from_env(matrix=local_matrix(tmp_path, serve), cache=cache, out=tmp_path / "out")
        return {p.id: actions(build.build(engine, p, opts, registry)) for p in plan.make(opts)}

    # Serve settings no earlier run built (microseconds since the epoch), so counts start from zero.
    stamp = time.time_ns() // 1000
    first = run({"a": 3 * stamp, "b": 3 * stamp + 1})
    torch = [a["torch"] for a in first.values()]
    assert sorted(torch) in (["built", "reused"], ["reused", "reused"])  # reused if an earlier session built it
    assert [a["runtime"] for a in first.values()] == ["built", "built"]

    second = run({"a": 3 * stamp, "b": 3 * stamp + 2})  # only b's serving defaults change
    assert second == {"local-a": {"torch": "reused", "runtime": "reused"}, "local-b": {"torch": "reused", "runtime": "built"}}

    # Another runner: the torch stage is not in its engine, but the registry has it.
    opts = Options.from_env(
        matrix=local_matrix(tmp_path, {"a": 3 * stamp, "b": 3 * stamp + 2}), cache=cache, out=tmp_path / "out"
    )
    a = next(p for p in plan.make(opts) if p.id == "local-a")
    torch_ref = a.stages[0].ref
    engine.client.images.remove(torch_ref)
    assert actions(build.build(engine, a, opts, registry)) == {"torch": "pulled", "runtime": "reused"}
    assert engine.image_exists(torch_ref)
    # Neither the push nor the pull left a name in the registry that would hold old layers on disk.
    assert leftovers.registry_names(engine, registry.host) == []


@pytest.mark.alone  # as above: the torch stage goes from the engine
def test_a_stage_in_the_registry_alone_is_found_by_its_qualified_name(
    engine: Engine, base: str, cache: Path, tmp_path: Path, registry: Registry
) -> None:
    """A docker-container or remote BuildKit builder sees registries, never this engine's image store.
    No such builder runs here (its image is on Docker Hub and Debian ships no buildkitd), so the
    docker driver's BuildKit is put in its place: the earlier stage removed from the engine under
    every name and left in the registry alone. The later stage still builds, so the Dockerfile and
    its build arguments name the stage in a way the registry answers."""
    opts = Options.from_env(matrix=local_matrix(tmp_path, {"a": 4096, "b": 4097}), cache=cache, out=tmp_path / "out")
    a = next(p for p in plan.make(opts) if p.id == "local-a")
    build.build(engine, a, opts, registry)  # the torch stage is now in the registry too
    torch, runtime = a.stages
    engine.client.images.remove(torch.ref)  # the push left no other name (test above)
    engine.client.images.remove(runtime.ref)
    build.build_stage(engine, a, runtime, opts, registry)
    assert engine.image_exists(runtime.ref)
    assert not engine.image_exists(torch.ref)  # built from the registry's copy, not a local name
