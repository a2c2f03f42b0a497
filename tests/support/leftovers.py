"""What the suite leaves in the Docker engine, removed as the session ends, so that a machine which
runs it again and again (CI's does, warm) does not fill its disk.

Without this, each session left about 5 GB: images under the tests' own names (a build or publish
test's image, made from a fresh upstream each session, so never used again) and the BuildKit
records of their layers, which BuildKit keeps after their images go (its garbage collection is off
in Debian's 20.10 engine unless ``daemon.json`` turns it on). CI's machine ran out of disk so in the
run of 2026-11-29 (`not enough free disk`: 6.7 GB free, 7.5 GB needed).

Kept for the next session: every image under sparkbuild's own names (the local image, stage images,
rehearsal images: the suite's warm state, reused by content), every record an image holds, the
cache mounts (pip's, apt's downloads), every record older than the session, and the records a
block of tests marks as the next session's (``kept_for_next_session``: the rehearsal's preflight and
intermediate stages, which no image holds and whose inputs are the same each session; without them
each warm session compiled its preflight again: the two rehearse commands 161 s and 75 s in place of
39 s and 19 s on 2 cores, 2026-12-06). Once a block's records outgrow KEPT_BLOCK_BYTES (its inputs
changed often enough), those earlier sessions kept go at once; this session's stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import docker.errors

from sparkbuild.config import options
from sparkbuild.oci.engine import CacheRecord, Engine
from sparkbuild.util import log

# Names only the tests give images: their own repositories, and a loopback registry's names (a
# test's registry lives for that test alone).
TEST_NAMES = re.compile(r"^(sparkbuild-test/|sparkbuild-t17/|sparkbuild/reproduce:|127\.0\.0\.1:\d+/|localhost:\d+/)")
JIT_VOLUME = re.compile(r"^sparkbuild-jit-([0-9a-f]{16})-")
# Records kept even where made in the session: a cache mount holds downloads the next session uses.
KEPT_KINDS = frozenset({"exec.cachemount"})
# The records each marked block made in this session (block name -> record ids); kept_file() holds
# every block's kept records from one session to the next.
KEPT: dict[str, set[str]] = {}
# What one block may keep (its records of earlier sessions go past it): the rehearsal's about 7 GB.
KEPT_BLOCK_BYTES = 20 * 10**9


def kept_file() -> Path:
    return options.default_cache() / "test-kept-records.json"


@contextlib.contextmanager
def kept_for_next_session(engine: Engine, block: str) -> Iterator[None]:
    """The records the builds inside this block make are kept when the session ends, with the ones
    earlier sessions kept for it. A build of the other worker's that ends meanwhile is kept with them:
    the tests' own builds are small and made the same way each session (a layer over the local
    image), so the next session's build of it finds them, and the block's bound holds them all."""
    before = {r.id for r in engine.build_cache()}
    try:
        yield
    finally:
        KEPT.setdefault(block, set()).update(r.id for r in engine.made_since(before))


def _kept_before() -> dict[str, list[str]]:
    try:
        found = json.loads(kept_file().read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def carried(records: list[CacheRecord], block: str, earlier: list[str]) -> tuple[set[str], set[str]]:
    """A block's records of earlier sessions: (kept, stale). All kept while the block's records stay
    under KEPT_BLOCK_BYTES, and all stale once they outgrow it (a change of the block's inputs made new
    ones: the next session makes again what it still needs, once). Their age cannot tell: BuildKit
    moves a record's last use only when a build loads it, not on every cache hit (measured on the
    20.10 engine: the rehearsal's 5.6 GB pip layer, a hit in every later rehearsal, kept its first time)."""
    by_id = {r.id: r for r in records}
    earlier_found = {i for i in earlier if i in by_id and not by_id[i].shared and not by_id[i].in_use}
    made = KEPT.get(block, set())
    if sum(by_id[i].size for i in earlier_found | made if i in by_id) > KEPT_BLOCK_BYTES:
        return set(), earlier_found - made
    return earlier_found, set()


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


def keeping() -> bool:
    """SPARKBUILD_TEST_KEEP_IMAGES=1: the session removes nothing from the engine, to look at."""
    return os.environ.get("SPARKBUILD_TEST_KEEP_IMAGES") == "1"


def start(engine: Engine) -> list[str]:
    """As a session starts: an earlier session's test images go (one cut short before its end),
    unless ``keeping()``; the ids of the engine's build records now, which the session's end keeps."""
    if not keeping():
        remove_test_images(engine)
    return sorted(r.id for r in engine.build_cache())


def made_in_session(engine: Engine, before: set[str]) -> list[CacheRecord]:
    """Records the session made that take disk of their own and no later session can use."""
    keep: set[str] = set().union(*KEPT.values())
    return [r for r in engine.made_since(before) if r.kind not in KEPT_KINDS and r.id not in keep]


def clean(engine: Engine, before: set[str]) -> int:
    """Remove the session's test images, their JIT volumes and the build records the session made;
    returns the bytes reclaimed."""
    remove_test_images(engine)
    for name in orphaned_jit_volumes(engine):
        engine.client.volumes.get(name).remove()
    records = engine.build_cache()
    kept_before = _kept_before()
    kept: dict[str, list[str]] = {}
    stale: set[str] = set()
    for block in sorted(set(kept_before) | set(KEPT)):
        earlier, gone = carried(records, block, kept_before.get(block, []))
        kept[block] = sorted(earlier | KEPT.get(block, set()))
        stale |= gone
    made = made_in_session(engine, before) + [r for r in records if r.id in stale]
    reclaimed = engine.prune_build_cache(made)
    kept_file().parent.mkdir(parents=True, exist_ok=True)
    kept_file().write_text(json.dumps(kept, indent=1) + "\n")
    log.info(
        f"test session: {len(made)} build-cache records removed (made by it, or kept past their bound), "
        f"{reclaimed / 1e9:.1f} GB reclaimed; kept for the next session: {sum(map(len, kept.values()))} records"
    )
    return reclaimed
