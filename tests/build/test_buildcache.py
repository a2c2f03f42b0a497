"""The build cache across runners: the mode each builder gets, the flags each mode passes, and
that no mode moves a stage hash or a content tag (the flags are given at build time only)."""

from __future__ import annotations

import json

import pytest

from sparkbuild import oci
from sparkbuild.build import buildcache
from sparkbuild.build.buildcache import Mode
from sparkbuild.config.options import BuildCacheSetting
from sparkbuild.errors import ConfigError
from sparkbuild.oci.buildkit import Builder, buildx_driver
from sparkbuild.plan import plan
from tests.plan.test_plan import TWO_TARGETS, options
from tests.support.cli import in_process as sparkbuild
from tests.support.matrix import MatrixWriter

DEBIAN_CLIENT = Builder(buildx=False, driver="docker", client="20.10.24+dfsg1")
BUILDX_DOCKER = Builder(buildx=True, driver="docker")
BUILDX_CONTAINER = Builder(buildx=True, driver="docker-container")
REF = "127.0.0.1:5000/sparkbuild/cache:t-vllm"


@pytest.mark.parametrize(
    ("setting", "builder", "registry", "mode", "why"),
    [
        ("auto", DEBIAN_CLIENT, True, Mode.INLINE, "docker 20.10 build, no buildx"),
        ("auto", BUILDX_DOCKER, True, Mode.INLINE, "buildx, docker driver"),
        ("auto", BUILDX_CONTAINER, True, Mode.REGISTRY, "buildx, docker-container driver"),
        ("auto", Builder(buildx=True, driver="remote"), True, Mode.REGISTRY, "buildx, remote driver"),
        ("auto", Builder(buildx=True, driver="unknown"), True, Mode.INLINE, "buildx, unknown driver"),
        ("registry", BUILDX_CONTAINER, True, Mode.REGISTRY, "buildx, docker-container driver"),
        ("inline", BUILDX_CONTAINER, True, Mode.INLINE, "SPARKBUILD_BUILD_CACHE=inline"),
        ("auto", BUILDX_CONTAINER, False, Mode.NONE, "no registry in this run"),
        ("off", BUILDX_CONTAINER, True, Mode.NONE, "SPARKBUILD_BUILD_CACHE=off"),
        ("off", DEBIAN_CLIENT, True, Mode.NONE, "SPARKBUILD_BUILD_CACHE=off"),
    ],
)
def test_the_builder_and_the_setting_choose_the_mode(
    setting: BuildCacheSetting, builder: Builder, registry: bool, mode: Mode, why: str
) -> None:
    choice = buildcache.choose(setting, builder, registry)
    assert choice.mode is mode
    assert why in choice.why
    assert choice.text().startswith(f"{mode} (")


@pytest.mark.parametrize("builder", [DEBIAN_CLIENT, BUILDX_DOCKER])
def test_a_registry_cache_asked_of_a_builder_that_cannot_export_one_says_what_to_do(builder: Builder) -> None:
    with pytest.raises(ConfigError, match=r"SPARKBUILD_BUILD_CACHE=registry: .* cannot export .*docker-container"):
        buildcache.choose("registry", builder, True)


def test_registry_mode_reads_and_writes_buildkits_registry_cache_on_every_stage() -> None:
    expected = ("--cache-from", f"type=registry,ref={REF}", "--cache-to", f"type=registry,ref={REF},mode=max")
    assert buildcache.flags(Mode.REGISTRY, REF, final=False) == expected
    assert buildcache.flags(Mode.REGISTRY, REF, final=True) == expected


def test_inline_mode_puts_the_cache_in_stage_images_and_reads_the_last_one() -> None:
    assert buildcache.flags(Mode.INLINE, REF, final=False) == ("--build-arg", "BUILDKIT_INLINE_CACHE=1", "--cache-from", REF)
    # The target's image is pushed only by publish, after verify: no cache tag moves to it.
    assert buildcache.flags(Mode.INLINE, REF, final=True) == ()


def test_none_passes_nothing() -> None:
    assert buildcache.flags(Mode.NONE, REF, final=False) == buildcache.flags(Mode.NONE, REF, final=True) == ()


def test_a_cache_ref_is_a_valid_tag_per_target_and_stage() -> None:
    ref = buildcache.ref("reg:5000", "vllm-0.33.0-cu130-sm121", "vllm")
    assert ref == "reg:5000/sparkbuild/cache:vllm-0.33.0-cu130-sm121-vllm"
    long_id, long_stage = "x" * oci.MAX_ID, "s" * 40
    tag = buildcache.tag(long_id, long_stage)
    assert oci.is_tag(tag) and tag.startswith(long_id) and tag != buildcache.tag(long_id, "t" * 40)


def test_buildx_inspect_names_the_driver() -> None:
    output = "Name:          spark\nDriver:        docker-container\nLast Activity: 2026-01-01\n\nNodes:\nName: spark0\n"
    assert buildx_driver(output) == "docker-container"
    assert buildx_driver("Name: default\nDriver: docker\n") == "docker"
    assert buildx_driver("garbled") == "unknown"


SETTINGS = ("auto", "registry", "inline", "off")


def test_no_mode_moves_a_stage_hash_a_content_tag_or_a_dockerfile(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    plans = {setting: plan.make(options(path, build_cache=setting)) for setting in SETTINGS}
    identities = {
        setting: [
            (p.content_hash, p.content_tag, [(s.ref, s.content_hash, s.rendered.dockerfile) for s in p.stages]) for p in planned
        ]
        for setting, planned in plans.items()
    }
    assert all(identity == identities["off"] for identity in identities.values())
    dockerfiles = " ".join(s.rendered.dockerfile for p in plans["auto"] for s in p.stages)
    assert "BUILDKIT_INLINE_CACHE" not in dockerfiles and buildcache.CACHE_REPOSITORY not in dockerfiles


def test_plan_shows_both_modes_and_each_stages_ref(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    text = sparkbuild("plan", "--matrix", str(path), "--only", "*0.32*")
    assert text.code == 0, text.err
    cache = [line.removeprefix("  cache:   ") for line in text.out.splitlines() if line.startswith("  cache:")]
    assert cache[0].startswith("registry with buildx (docker-container, remote, kubernetes driver), else inline")
    assert cache[1].startswith("registry: --cache-from type=registry,ref=REF --cache-to type=registry,ref=REF,mode=max")
    assert cache[2].startswith("inline:   stage images carry BuildKit's inline cache (--build-arg BUILDKIT_INLINE_CACHE=1)")
    assert cache[3].split() == ["torch", "REF", "<registry>/sparkbuild/cache:vllm-0.32.0-cpu-amd64-torch"]

    shown = sparkbuild("plan", "--json", "--matrix", str(path), "--only", "*0.32*", env={"SPARKBUILD_REGISTRY": "reg:5000"})
    (entry,) = json.loads(shown.out)
    ref = "reg:5000/sparkbuild/cache:vllm-0.32.0-cpu-amd64-torch"
    assert entry["build_cache"]["refs"]["torch"] == ref
    assert entry["build_cache"]["modes"]["inline"] == {
        "torch": ["--build-arg", "BUILDKIT_INLINE_CACHE=1", "--cache-from", ref],
        "runtime": [],
    }
    assert entry["build_cache"]["modes"]["registry"]["torch"][:2] == ["--cache-from", f"type=registry,ref={ref}"]


def test_plan_shows_none_when_turned_off_and_refuses_a_bad_setting(write_matrix: MatrixWriter) -> None:
    path = write_matrix(TWO_TARGETS)
    off = sparkbuild("plan", "--matrix", str(path), env={"SPARKBUILD_BUILD_CACHE": "off"})
    assert [line for line in off.out.splitlines() if "cache:" in line] == ["  cache:   none (SPARKBUILD_BUILD_CACHE=off)"] * 2
    bad = sparkbuild("plan", "--matrix", str(path), env={"SPARKBUILD_BUILD_CACHE": "always"})
    assert bad.code == 2 and "SPARKBUILD_BUILD_CACHE='always': expected one of auto, registry, inline, off" in bad.err
