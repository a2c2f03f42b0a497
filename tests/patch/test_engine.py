"""The patch engine on a real vLLM tree with diff patches made here by git: every status, 3-way, all or nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.errors import ConfigError, PatchError
from sparkbuild.upstream import sources
from tests.support import cli
from tests.support.trees import PATCHES, TreeFactory, tree_hash

TARGET = "vllm/v1/attention/backends/flashinfer.py"  # a file every version has
NEEDLE = "from dataclasses import dataclass"  # a line of it


def make_diff(tree: Path, rel: str, edit: tuple[str, str], dest: Path) -> Path:
    """A real ``git diff`` of ``rel`` with one replacement, paths relative to the tree (a/ b/)."""
    work = dest.parent / f"{dest.stem}-work"
    for side in ("a", "b"):
        (work / side / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree / rel, work / side / rel)
    text = (work / "b" / rel).read_text()
    assert edit[0] in text, edit[0]
    (work / "b" / rel).write_text(text.replace(edit[0], edit[1], 1))
    dest.write_text(git_diff(work, rel))
    return dest


def git_diff(work: Path, rel: str) -> str:
    """``git diff`` of work/a/<rel> and work/b/<rel>, so the headers read a/<rel> and b/<rel>."""
    args = ["git", "diff", "--no-index", "--no-prefix", f"a/{rel}", f"b/{rel}"]
    done = subprocess.run(args, cwd=work, capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stderr
    return done.stdout


def add_patch(patches: Path, name: str, diff: Path | None = None, versions: str = ">=0.10", detect: str = "") -> None:
    folder = patches / name
    folder.mkdir(parents=True)
    if diff is not None:
        shutil.move(diff, folder / "change.diff")
    (folder / "patch.yaml").write_text(
        textwrap.dedent(f"""\
            summary: test patch {name}
            why: made by a test
            component: vllm
            versions: "{versions}"
            upstream:
              fixed_in: null
              links: [https://example.invalid/{name}]
            {detect}
            change:
              diff: change.diff
            """).replace("\n\n", "\n")
    )


def first_line(tree: Path, rel: str, needle: str) -> str:
    return next(line for line in (tree / rel).read_text().splitlines() if needle in line)


def test_diff_applies_and_apply_records_it(tree_copy: TreeFactory, tmp_path: Path) -> None:
    tree = tree_copy("0.11.0")
    patches = tmp_path / "patches"
    line = first_line(tree, TARGET, NEEDLE)
    add_patch(patches, "envs-comment", make_diff(tree, TARGET, (line, f"{line}  # sparkbuild"), tmp_path / "d.diff"))
    report = patch.check(tree, patch.load(patches), "0.11.0")
    assert report.results[0].status == "applies"
    assert (tree / TARGET).read_text().count("# sparkbuild") == 0, "check must not write"
    assert patch.apply(report) == (TARGET,)
    assert f"{line}  # sparkbuild" in (tree / TARGET).read_text()
    record = json.loads((tree / patch.RECORD).read_text())
    assert record["results"][0] == {"patch": "envs-comment", "status": "applies", "detail": "applies cleanly", "files": [TARGET]}


def test_change_already_there_is_upstream(tree_copy: TreeFactory, tmp_path: Path) -> None:
    """A diff whose result is already in the tree applies in reverse: upstream, not conflict."""
    tree = tree_copy("0.11.0")
    patches = tmp_path / "patches"
    line = first_line(tree, TARGET, NEEDLE)
    # The diff removes-then-adds in the other direction: made from a tree without the line.
    made = make_diff(tree, TARGET, (line, f"{line}  # sparkbuild"), tmp_path / "d.diff")
    shutil.copy(tmp_path / "d-work" / "b" / TARGET, tree / TARGET)  # the tree already has the change
    add_patch(patches, "envs-comment", made)
    [result] = patch.check(tree, patch.load(patches), "0.11.0").results
    assert (result.status, result.detail) == ("upstream", "the change is already in the tree (the diff applies in reverse)")


def test_detect_marker_and_version_range_and_missing_file(tree_copy: TreeFactory, tmp_path: Path) -> None:
    tree = tree_copy("0.11.0")
    patches = tmp_path / "patches"
    line = first_line(tree, TARGET, NEEDLE)
    add_patch(
        patches,
        "a-marked",
        make_diff(tree, TARGET, (line, line + " #"), tmp_path / "1.diff"),
        detect=f"  detect: [{{file: {TARGET}, contains: '{NEEDLE}'}}]",
    )
    add_patch(patches, "b-newer", make_diff(tree, TARGET, (line, line + " #"), tmp_path / "2.diff"), versions=">=0.12")
    moved = make_diff(tree, TARGET, (line, line + " #"), tmp_path / "3.diff")
    moved.write_text(moved.read_text().replace(TARGET, "csrc/libtorch_stable/moved.py"))
    add_patch(patches, "c-moved", moved)
    report = patch.check(tree, patch.load(patches), "0.11.0")
    assert [(r.status, r.detail) for r in report.results] == [
        ("upstream", f"{TARGET} already has '{NEEDLE}'"),
        ("not-applicable", "0.11.0 is outside >=0.12"),
        ("not-applicable", "csrc/libtorch_stable/moved.py does not exist in this layout"),
    ]


def conflicting_patch(tree: Path, patches: Path, tmp_path: Path) -> None:
    """A two-hunk diff whose second hunk's context is not in the tree."""
    text = (tree / TARGET).read_text()
    first, last = first_line(tree, TARGET, NEEDLE), text.splitlines()[-3]
    diff = make_diff(tree, TARGET, (first, first + "  # one"), tmp_path / "c.diff")
    work_b = tmp_path / "c-work" / "b" / TARGET
    work_b.write_text(work_b.read_text().replace(last, last + "  # two", 1))
    (tmp_path / "c-work" / "a" / TARGET).write_text(
        (tmp_path / "c-work" / "a" / TARGET).read_text().replace(last, last + " x", 1)
    )
    diff.write_text(git_diff(tmp_path / "c-work", TARGET))
    add_patch(patches, "z-conflict", diff)


def test_conflict_names_file_and_hunk_and_leaves_tree_untouched(tree_copy: TreeFactory, tmp_path: Path) -> None:
    tree = tree_copy("0.11.0")
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES / "cmake-arch-sm121", patches / "cmake-arch-sm121")  # applies, and runs first
    conflicting_patch(tree, patches, tmp_path)
    before = tree_hash(tree)
    report = patch.check(tree, patch.load(patches), "0.11.0")
    assert [r.status for r in report.results] == ["applies", "conflict"]
    detail = report.results[1].detail
    assert detail.startswith(f"{TARGET}: hunk 2 of 2 (@@ -") and detail.endswith("does not apply"), detail
    with pytest.raises(PatchError, match=r"tree is untouched\. Conflicts: z-conflict"):
        patch.apply(report)
    assert tree_hash(tree) == before


def test_cli_check_exits_9_on_conflict_and_still_prints_json(tree_copy: TreeFactory, tmp_path: Path) -> None:
    tree = tree_copy("0.11.0")
    patches = tmp_path / "patches"
    conflicting_patch(tree, patches, tmp_path)
    args = ["patch", "check", "--source", str(tree), "--patches", str(patches), "--json"]
    done = cli.run(*args)
    assert done.returncode == 9, done.stderr
    assert json.loads(done.stdout)["results"][0]["status"] == "conflict"
    before = tree_hash(tree)
    apply = cli.run(args[0], "apply", *args[2:-1])
    assert apply.returncode == 9
    assert "tree is untouched" in apply.stderr
    assert tree_hash(tree) == before


def git(cwd: Path, *args: str) -> None:
    env_args = ["-c", "user.name=sparkbuild", "-c", "user.email=test@sparkbuild.invalid", "-c", "init.defaultBranch=main"]
    subprocess.run(["git", *env_args, *args], cwd=cwd, check=True, capture_output=True)


def test_three_way_merge_in_a_git_checkout(pristine: TreeFactory, tmp_path: Path) -> None:
    """The diff was made on an older commit; a nearby line changed since, so only a 3-way merge applies it."""
    repo = tmp_path / "vllm"
    (repo / TARGET).parent.mkdir(parents=True)
    shutil.copy(pristine("0.11.0") / TARGET, repo / TARGET)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "v0.11.0")
    git(repo, "tag", "v0.11.0")
    line = first_line(repo, TARGET, NEEDLE)
    patches = tmp_path / "patches"
    add_patch(patches, "envs-comment", make_diff(repo, TARGET, (line, line + "  # sparkbuild"), tmp_path / "d.diff"))
    text = (repo / TARGET).read_text().splitlines(keepends=True)
    at = next(i for i, t in enumerate(text) if t.rstrip("\n") == line)
    text[at + 3] = text[at + 3].rstrip("\n") + "  # changed upstream\n"  # in the hunk's context, not adjacent
    (repo / TARGET).write_text("".join(text))
    git(repo, "commit", "-qam", "upstream moves on")
    report = patch.check(repo, patch.load(patches), sources.tree_version(repo) or "")
    assert report.version == "0.11.0"
    assert (report.results[0].status, report.results[0].detail) == ("applies", "applies with a 3-way merge")
    patch.apply(report)
    assert "# sparkbuild" in (repo / TARGET).read_text() and "# changed upstream" in (repo / TARGET).read_text()


def test_patch_metadata_errors_name_file_line_and_suggest(tmp_path: Path) -> None:
    folder = tmp_path / "patches" / "broken"
    folder.mkdir(parents=True)
    (folder / "patch.yaml").write_text("summary: s\nwhy: w\ncomponent: vllm\nverisons: '>=1'\n")
    with pytest.raises(ConfigError, match=r"patch.yaml:4: verisons: unknown key 'verisons'. Perhaps you meant 'versions'\?"):
        patch.load(tmp_path / "patches")
    (folder / "patch.yaml").write_text(
        "summary: s\nwhy: w\ncomponent: vllm\nversions: '>=1'\nupstream: {links: []}\nchange: {rule: cmake-arch-sm12}\n"
    )
    with pytest.raises(
        ConfigError, match=r"patch.yaml:6: change.rule: unknown rule 'cmake-arch-sm12'. Perhaps you meant 'cmake-arch-sm121'\?"
    ):
        patch.load(tmp_path / "patches")
