"""Upstream pull requests grafted by number (issue 31, item 3), against a real change served by git
on 127.0.0.1: vLLM's cmake/utils.cmake as 0.32.0 has it (the PR's base) and as 0.33.0 has it (the
PR's head: the loose-intersection fix for a/f targets), with CMakeLists.txt changed in the same PR,
published as refs/pull/4242/head beside main.

Proven: the pin `sparkbuild patch pr` prints; a three-way merge onto older releases (0.30.0 keeps its
own lines around the change); `upstream` on the release that holds the change; the fetch cached by
content (a second use reaches no network); the graft in the support table; the build context
carrying the fetched files so the source stage's engine (the bundle, no cache, no network) merges
them; a wrong sha256 (exit 10, nothing kept, nothing planned) and a PR that no longer applies (exit
9, the tree untouched), each with one message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from sparkbuild import patch
from sparkbuild.patch import pullrequest
from tests.patch.test_bundle import copy_bundle, run
from tests.support import ROOT
from tests.support.git import git, git_daemon
from tests.support.trees import TreeFactory, tree_hash

NUMBER = 4242
FILE = "cmake/utils.cmake"


@dataclass(frozen=True)
class Upstream:
    url: str
    base: str
    head: str


@pytest.fixture(scope="module")
def upstream(pristine: TreeFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    root = tmp_path_factory.mktemp("prs")
    work = root / "work"
    for rel in (FILE, "CMakeLists.txt"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pristine("0.32.0") / rel, work / rel)
    git("init", "--quiet", "--initial-branch=main", cwd=work)
    git("add", "--all", cwd=work)
    git("commit", "--quiet", "-m", "v0.32.0's CMake files", cwd=work)
    base = git("rev-parse", "HEAD", cwd=work)
    git("switch", "--quiet", "-c", "fix-loose-intersection", cwd=work)
    for rel in (FILE, "CMakeLists.txt"):
        shutil.copy(pristine("0.33.0") / rel, work / rel)
    git("commit", "--quiet", "-am", "[Build] keep a/f targets in cuda_archs_loose_intersection", cwd=work)
    head = git("rev-parse", "HEAD", cwd=work)
    served = root / "served" / "vllm.git"
    git("init", "--quiet", "--bare", served, cwd=root)
    # GitHub serves any reachable commit by id; git daemon only when told so.
    git("config", "uploadpack.allowReachableSHA1InWant", "true", cwd=served)
    git("push", "--quiet", served, "main", f"fix-loose-intersection:refs/pull/{NUMBER}/head", cwd=work)
    with git_daemon(root / "served") as url:
        yield Upstream(f"{url}/vllm.git", base, head)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own: the fetches it makes start cold."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPARKBUILD_CACHE", str(folder))
    return folder


def sparkbuild(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkbuild", *args], capture_output=True, text=True, cwd=ROOT, env=os.environ)


def pinned(upstream: Upstream) -> dict[str, object]:
    done = sparkbuild("patch", "pr", upstream.url, str(NUMBER), "--base", upstream.base, "--path", FILE)
    assert done.returncode == 0, done.stderr
    change: dict[str, object] = yaml.safe_load(done.stdout)
    return change


def graft(folder: Path, change: dict[str, object], versions: str = ">=0.22") -> Path:
    (folder / "pr-4242").mkdir(parents=True)
    meta = {
        "summary": "vLLM's a/f-keeping loose intersection, grafted from its PR",
        "why": "made by tests/patch/test_pull_request.py",
        "component": "vllm",
        "versions": versions,
        "upstream": {"fixed_in": "0.33.0", "links": [f"pull/{NUMBER}"]},
        **change,
    }
    (folder / "pr-4242" / "patch.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return folder


def spark_matrix(tmp_path: Path, patches: Path) -> Path:
    """The shipped matrix with one Spark target, 0.19.0 (pinned), whose patch set is the graft."""
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    (spark,) = [t for t in shipped["targets"] if t.get("id") == "vllm-0.19.0-cu129-sm121"]
    shipped["targets"] = [{**spark, "patches": ["pr-4242"]}]
    shipped["patches_dir"] = str(patches)
    shipped.pop("rehearsal", None)
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(shipped, sort_keys=False))
    return path


def test_the_pin_names_the_pr_its_commits_and_the_sha256_of_its_change(upstream: Upstream, cache: Path) -> None:
    change = pinned(upstream)
    outer = change["change"]
    assert isinstance(outer, dict)
    spec = outer["pr"]
    assert (spec["repo"], spec["number"], spec["base"], spec["head"], spec["paths"]) == (
        upstream.url,
        NUMBER,
        upstream.base,
        upstream.head,
        [FILE],
    )
    assert len(spec["sha256"]) == 64
    # The whole PR (no path filter) is another change, with another sha256.
    whole = sparkbuild("patch", "pr", upstream.url, str(NUMBER), "--base", upstream.base)
    assert yaml.safe_load(whole.stdout)["change"]["pr"]["sha256"] != spec["sha256"]


def test_a_pr_grafts_onto_older_releases_by_a_three_way_merge(
    upstream: Upstream, cache: Path, tree_copy: TreeFactory, pristine: TreeFactory, tmp_path: Path
) -> None:
    patches = graft(tmp_path / "patches", pinned(upstream))
    tree = tree_copy("0.27.0")
    report = patch.check(tree, patch.load(patches), "0.27.0")
    (result,) = report.results
    assert (result.status, result.files) == ("applies", (FILE,))
    assert result.detail == f"PR #{NUMBER} of {upstream.url}: {FILE} by a 3-way merge"
    patch.apply(report)
    merged = (tree / FILE).read_text()
    assert 'list(REMOVE_ITEM _TGT_CUDA_ARCHS "${_base}a" "${_base}f")' in merged  # the PR's change
    assert "--manifest ${HIPIFY_MANIFEST}" in merged
    assert merged != (pristine("0.33.0") / FILE).read_text()  # 0.27.0's own lines stay around it
    assert (tree / "CMakeLists.txt").read_bytes() == (pristine("0.27.0") / "CMakeLists.txt").read_bytes()  # not in paths
    # Applied again: by content (merging changes nothing) and the record, `applied`.
    (again,) = patch.check(tree, patch.load(patches), "0.27.0").results
    assert (again.status, again.files) == ("applied", (FILE,))
    # On the PR's own base the merge is the PR's head, byte for byte.
    base = tree_copy("0.32.0")
    patch.apply(patch.check(base, patch.load(patches), "0.32.0"))
    assert (base / FILE).read_bytes() == (pristine("0.33.0") / FILE).read_bytes()


def test_the_release_that_holds_the_change_reads_upstream(
    upstream: Upstream, cache: Path, pristine: TreeFactory, tmp_path: Path
) -> None:
    patches = graft(tmp_path / "patches", pinned(upstream))
    (result,) = patch.check(pristine("0.33.0"), patch.load(patches), "0.33.0").results
    assert result.status == "upstream"
    assert result.detail == f"the change of PR #{NUMBER} of {upstream.url} is in the tree (merging it changes nothing)"


def test_the_fetch_is_cached_by_content_and_a_second_use_reaches_no_network(
    upstream: Upstream, cache: Path, pristine: TreeFactory, tmp_path: Path
) -> None:
    change = pinned(upstream)
    spec = change["change"]
    assert isinstance(spec, dict)
    patches = graft(tmp_path / "patches", change)
    patch.check(pristine("0.30.0"), patch.load(patches), "0.30.0")
    cached = cache / pullrequest.CACHE / str(spec["pr"]["sha256"])
    manifest = json.loads((cached / pullrequest.MANIFEST).read_text())
    assert manifest["files"] == [{"path": FILE, "status": "M"}] and manifest["head"] == upstream.head
    assert (cached / "base" / FILE).read_bytes() == (pristine("0.32.0") / FILE).read_bytes()
    # The same pin from a remote that does not answer: the cache serves it.
    spec["pr"]["repo"] = "git://127.0.0.1:9/nowhere.git"
    offline = graft(tmp_path / "offline", change)
    (result,) = patch.check(pristine("0.30.0"), patch.load(offline), "0.30.0").results
    assert result.status == "applies"


def test_the_graft_is_in_the_support_table(upstream: Upstream, cache: Path, every_tree: dict[str, Path], tmp_path: Path) -> None:
    """Every release from 0.10.0: not applicable before 0.22 (its range), merged 0.22.0 - 0.32.0, upstream on 0.33.0."""
    patches = graft(tmp_path / "patches", pinned(upstream))
    # The release slices come from the session's cache (the fetch went to this test's own).
    env = {**os.environ, "SPARKBUILD_CACHE": str(cache)}
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "patch-trees").symlink_to(next(iter(every_tree.values())).parent)
    done = subprocess.run(
        [sys.executable, "-m", "sparkbuild", "patch", "table", "--through", "0.33.0", "--patches", str(patches), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    # The slices hold cmake/**/*.cmake, so the PR's cmake/utils.cmake needs no download.
    assert "files.pythonhosted.org" not in done.stderr
    rows = {r["version"]: r["results"]["pr-4242"] for r in json.loads(done.stdout)["releases"]}
    statuses = {v: r["status"] for v, r in rows.items()}
    merged = {v for v in statuses if Version("0.22.0") <= Version(v) < Version("0.33.0")}
    assert {v for v, s in statuses.items() if s == "applies"} == merged
    assert statuses["0.21.0"] == "not-applicable" and statuses["0.33.0"] == "upstream"
    assert rows["0.30.0"]["needed"]["13.0"] == {"needed": True, "why": "its change is not in this release"}
    markdown = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkbuild",
            "patch",
            "table",
            "--through",
            "0.33.0",
            "--patches",
            str(patches),
            "--markdown",
            "--needed",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert "| 0.22.0 - 0.32.0 | applies, needed |" in markdown.stdout, markdown.stdout
    assert "| 0.33.0 | upstream |" in markdown.stdout


def test_the_build_context_carries_the_fetched_pr_and_the_source_stage_does_not_fetch(
    upstream: Upstream, cache: Path, tree_copy: TreeFactory, tmp_path: Path
) -> None:
    """What plan.resources gives the source stage, and the bundled engine run on it with neither the
    cache nor the remote: it merges from the patch folder's fetched/ files."""
    from sparkbuild.plan import matrix, plan

    change = pinned(upstream)
    patches = graft(tmp_path / "patches", change)
    target = spark_matrix(tmp_path, patches)
    (spark,) = matrix.load(target).targets
    files = dict(plan.resources(spark, {"pr-4242": patches / "pr-4242"})["patches"])
    assert f"patches/pr-4242/{pullrequest.FETCHED}/{pullrequest.MANIFEST}" in files
    assert f"patches/pr-4242/{pullrequest.FETCHED}/head/{FILE}" in files
    context = tmp_path / "context"
    for rel, data in files.items():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        (context / rel).write_bytes(data)
    spec = change["change"]
    assert isinstance(spec, dict)
    spec["pr"]["repo"] = "git://127.0.0.1:9/nowhere.git"  # the stage could not fetch if it tried
    (context / "patches" / "pr-4242" / "patch.yaml").write_text(
        (context / "patches" / "pr-4242" / "patch.yaml").read_text().replace(upstream.url, "git://127.0.0.1:9/nowhere.git")
    )
    shutil.rmtree(cache)
    lib = copy_bundle(tmp_path / "lib")
    tree = tree_copy("0.30.0")
    done = run(lib, "apply", "--source", str(tree), "--version", "0.30.0", "--patches", str(context / "patches"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pr-4242" in done.stdout and "applies" in done.stdout
    assert 'list(REMOVE_ITEM _TGT_CUDA_ARCHS "${_base}a" "${_base}f")' in (tree / FILE).read_text()
    assert not cache.exists()


# --- bad input: one message each, nothing built on a wrong premise -------------------------------


def test_a_wrong_sha256_is_refused_with_exit_10_and_nothing_kept_or_planned(
    upstream: Upstream, cache: Path, tree_copy: TreeFactory, tmp_path: Path
) -> None:
    change = pinned(upstream)
    spec = change["change"]
    assert isinstance(spec, dict)
    good = str(spec["pr"]["sha256"])
    spec["pr"]["sha256"] = "0" * 64
    patches = graft(tmp_path / "patches", change)
    tree = tree_copy("0.30.0")
    before = tree_hash(tree)
    done = sparkbuild("patch", "apply", "--source", str(tree), "--patches", str(patches))
    assert done.returncode == 10, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert (
        f"PR #{NUMBER} of {upstream.url}: the diff of {upstream.base[:12]}..{upstream.head[:12]} in {FILE} has sha256 {good}"
        in message
    )
    assert f"the patch pins {'0' * 64}" in message and "Nothing was kept or built" in message
    assert tree_hash(tree) == before
    assert not any((cache / pullrequest.CACHE).glob("*/pr.json"))
    # A build plans nothing on it: `sparkbuild plan` of a Spark target that lists the graft stops there.
    planned = sparkbuild("plan", "--matrix", str(spark_matrix(tmp_path, patches)), "--json")
    assert planned.returncode == 10, planned.stdout + planned.stderr
    assert "has sha256" in planned.stderr and f"PR #{NUMBER}" in planned.stderr


def test_a_pr_that_no_longer_applies_is_one_message_exit_9_and_the_tree_untouched(
    upstream: Upstream, cache: Path, tree_copy: TreeFactory, tmp_path: Path
) -> None:
    """0.21.0's cmake/utils.cmake predates the code the PR changes."""
    patches = graft(tmp_path / "patches", pinned(upstream), versions=">=0.19")
    tree = tree_copy("0.21.0")
    before = tree_hash(tree)
    done = sparkbuild("patch", "apply", "--source", str(tree), "--patches", str(patches))
    assert done.returncode == 9, done.stderr
    assert f"pr-4242: PR #{NUMBER} of {upstream.url} no longer applies: {FILE}: " in done.stderr
    assert "conflicting region(s), the first at line " in done.stderr
    assert tree_hash(tree) == before
