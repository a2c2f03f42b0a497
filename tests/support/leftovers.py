"""What the suite leaves in the Docker engine, removed as the session ends, so that a machine which
runs it again and again (CI's does, warm) does not fill its disk.

Without this, each session left about 5 GB: images under the tests' own names (a build or publish
test's image, made from a fresh upstream each session, so never used again) and the BuildKit
records of their layers, which BuildKit keeps after their images go (its garbage collection is off
in Debian's 20.10 engine unless ``daemon.json`` turns it on). CI's machine ran out of disk so in the
run of 2026-11-29 (`not enough free disk`: 6.7 GB free, 7.5 GB needed).

Kept for the next session: every image under sparkbuild's own names (the local image, stage images,
rehearsal images: the suite's warm state, reused by content), every record an image holds, the
cache mounts (pip's, apt's downloads), and every record older than the session.
"""

from __future__ import annotations

import contextlib
import re

import docker.errors

from sparkbuild.oci.engine import CacheRecord, Engine
from sparkbuild.util import log

# Names only the tests give images: their own repositories, and a loopback registry's names (a
# test's registry lives for that test alone).
TEST_NAMES = re.compile(r"^(sparkbuild-test/|sparkbuild-t17/|sparkbuild/reproduce:|127\.0\.0\.1:\d+/|localhost:\d+/)")
JIT_VOLUME = re.compile(r"^sparkbuild-jit-([0-9a-f]{16})-")
# Records kept even where made in the session: a cache mount holds downloads the next session uses.
KEPT_KINDS = frozenset({"exec.cachemount"})


def names(engine: Engine) -> list[str]:
    """Every name of every image in the engine: its tags and its digests (``repo@sha256:...``, which
    a push or a pull by digest leaves, and which hold an image as a tag does)."""
    found = []
    for image in engine.client.images.list():
        found += image.tags + [d for d in image.attrs.get("RepoDigests") or [] if not d.startswith("<none>")]
    return sorted(found)


def test_images(engine: Engine) -> list[str]:
    """Every name in the engine that only the tests give."""
    return [name for name in names(engine) if TEST_NAMES.match(name)]


def registry_names(engine: Engine, host: str) -> list[str]:
    """Every name in the engine under a registry's (``host/...``)."""
    return [name for name in names(engine) if name.startswith(f"{host}/")]


def remove_test_images(engine: Engine) -> None:
    """Untag every test name; an image no other name holds goes with it, then every dangling image."""
    for tag in test_images(engine):
        # force: a stopped container of a session cut short may hold it; gone already is what we want.
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.client.images.remove(tag, force=True)
    engine.client.images.prune(filters={"dangling": True})


def orphaned_jit_volumes(engine: Engine) -> list[str]:
    """``sparkbuild run``'s JIT cache volumes of images no longer in the engine (named by image ID,
    ``sparkbuild/oci/jitcache.py``): a test image's go with it."""
    ids = {image.id.removeprefix("sha256:")[:16] for image in engine.client.images.list(all=True)}
    found = []
    for volume in engine.client.volumes.list():
        named = JIT_VOLUME.match(volume.name)
        if named and named.group(1) not in ids:
            found.append(volume.name)
    return sorted(found)


def made_in_session(engine: Engine, before: set[str]) -> list[CacheRecord]:
    """Records the session made that take disk of their own and no later session can use."""
    return [r for r in engine.made_since(before) if r.kind not in KEPT_KINDS]


def clean(engine: Engine, before: set[str]) -> int:
    """Remove the session's test images, their JIT volumes and the build records the session made;
    returns the bytes reclaimed."""
    remove_test_images(engine)
    for name in orphaned_jit_volumes(engine):
        engine.client.volumes.get(name).remove()
    made = made_in_session(engine, before)
    reclaimed = engine.prune_build_cache(made)
    log.info(f"test session: {len(made)} build-cache records it made removed, {reclaimed / 1e9:.1f} GB reclaimed")
    return reclaimed
