"""The suite's cleanup keeps for the next session the records a marked block made (the rehearsal's
preflight and intermediate stages: no image holds them, and each warm session compiled them again),
removes the rest the session made, and removes what earlier sessions kept for a block once its
records outgrow their bound."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkbuild.oci.engine import Engine
from tests.support import leftovers
from tests.support.matrix import LOCAL_PLATFORM

pytestmark = pytest.mark.docker


@pytest.fixture
def blocks() -> Iterator[dict[str, set[str]]]:
    """The session's marked blocks, as they were before this test (it marks blocks of its own)."""
    saved = {block: set(ids) for block, ids in leftovers.KEPT.items()}
    yield leftovers.KEPT
    leftovers.KEPT.clear()
    leftovers.KEPT.update(saved)


def build_two_layers(engine: Engine, base: str, folder: Path, marker: str) -> list[str]:
    """A build whose image goes at once (as a preflight's output or an intermediate stage: no image
    holds its layers); the ids of its two records."""
    folder.mkdir()
    (folder / "Dockerfile").write_text(
        f"FROM {base}\nRUN head -c 100000 /dev/urandom > /one # {marker}\nRUN head -c 100000 /dev/urandom > /two # {marker}\n"
    )
    ref = f"sparkbuild-test/leftovers:{marker}"
    engine.build(context=folder, tag=ref, platform=LOCAL_PLATFORM, labels={}, build_args={}, secrets={}, log_file=folder / "log")
    engine.remove_image(ref)
    return [r.id for r in engine.build_cache() if marker in r.description]


def test_a_marked_blocks_records_stay_and_the_rest_the_session_made_go(
    engine: Engine, base: str, tmp_path: Path, blocks: dict[str, set[str]]
) -> None:
    before = {r.id for r in engine.build_cache()}
    mark = f"sparkbuild-kept-{time.time_ns()}"
    with leftovers.kept_for_next_session(engine, "test-block"):
        kept = build_two_layers(engine, base, tmp_path / "kept", mark)
    other = build_two_layers(engine, base, tmp_path / "other", f"sparkbuild-other-{time.time_ns()}")
    try:
        assert len(kept) == 2 and set(kept) <= blocks["test-block"]  # with its build context's
        made = {r.id for r in leftovers.made_in_session(engine, before)}
        assert set(other) <= made and not set(kept) & made
        # Earlier sessions' records of the block stay under the bound, and go past it (this run's stay).
        records = engine.build_cache()
        assert leftovers.carried(records, "test-block", other) == (set(other), set())
        sizes = {r.id: r.size for r in records}
        bound = sum(sizes[i] for i in [*kept, *other]) - 1
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(leftovers, "KEPT_BLOCK_BYTES", bound)
            assert leftovers.carried(records, "test-block", [*other, *kept]) == (set(), set(other))
        assert leftovers.carried(records, "a block not run", ["no such record", *other]) == (set(other), set())
    finally:
        engine.prune_build_cache([r for r in engine.build_cache() if r.id in {*kept, *other}])
