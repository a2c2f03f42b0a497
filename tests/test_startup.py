"""What the command line loads before it does anything: a patch verdict must not pay for Docker,
Jinja2, gitpython or requests, and a nightly with nothing to do not for what only some targets or
steps need (the time this saves is measured by bench/patch_verdicts.py and bench/startup.py). The
imports inside functions that keep these out are held here; tests/lanes/test_nightly.py holds a
real nightly with nothing to build to the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkbuild import cli
from sparkbuild.config.options import Options
from sparkbuild.lanes import bisect
from sparkbuild.plan import plan
from sparkbuild.util import yamlsrc
from tests.support import ROOT

HEAVY = (
    "docker",
    "jinja2",
    "git",
    "requests",
    "torch",
    "cyclonedx",
    "packageurl",
    "sparkbuild.plan.plan",
    "sparkbuild.lanes.pipeline",
    "sparkbuild.plan.matrix",
)


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_command_line_loads_no_heavy_package() -> None:
    loaded = loaded_after("import sparkbuild.cli")
    assert {m for m in HEAVY if m in loaded} == set()


def test_patch_check_help_loads_no_heavy_package() -> None:
    run = "cli.main(['patch', 'check', '--help'], standalone_mode=False)"
    loaded = loaded_after(f"from sparkbuild.cli import cli\ntry:\n    {run}\nexcept SystemExit:\n    pass")
    assert {m for m in HEAVY if m in loaded} == set()


# What a lane loads only when a target needs it: gitpython for a target built from a git source,
# cyclonedx (and jsonschema's format checkers under its validator) to make an SBOM, matplotlib to
# plot a benchmark, torch and transformers to make a check model.
LANE_LAZY = ("git", "cyclonedx", "jsonschema", "matplotlib", "torch", "transformers")


def test_a_lane_loads_only_what_every_target_needs() -> None:
    loaded = loaded_after("import sparkbuild.lanes.pipeline")
    assert {m for m in LANE_LAZY if m in loaded} == set()


def test_the_commands_list_loads_no_subgroup() -> None:
    """``sparkbuild --help`` lists ``patch`` from the help written beside its loader."""
    run = "cli.main(['--help'], standalone_mode=False)"
    loaded = loaded_after(f"from sparkbuild.cli import cli\ntry:\n    {run}\nexcept SystemExit:\n    pass")
    assert {m for m in loaded if m.startswith("sparkbuild.patch")} == set()


def test_each_lazy_subgroups_listed_help_is_its_own() -> None:
    for name, (load, help_text) in cli.LAZY_GROUPS.items():
        group = load()
        assert (group.name, group.help, group.hidden) == (name, help_text, False)


# A nightly with nothing to build builds, verifies and judges no speed: it loads none of those
# stages (only where verify writes its results), nor the patch commands.
def skipped_by_a_noop(loaded: set[str]) -> set[str]:
    stages = {m for m in loaded if m.startswith(("sparkbuild.build.", "sparkbuild.verify.")) and m != "sparkbuild.verify.layout"}
    return stages | ({"sparkbuild.publish.baseline", "sparkbuild.patch.cli", "sparkbuild.patch.releases"} & loaded)


def test_a_lane_loads_no_stage_a_target_with_nothing_to_build_skips() -> None:
    assert skipped_by_a_noop(loaded_after("import sparkbuild.cli, sparkbuild.lanes.pipeline")) == set()


def test_only_a_stage_that_copies_the_patch_engine_derives_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deriving the patch engine's modules parses their source (tens of ms); only the source stage
    of a Spark target with patches copies them (``file("sparkbuild")``), so the local target's plan
    never derives them. The shipped matrix, its first Spark target given a patch."""
    derived = []
    real = plan.engine_files

    def counted() -> tuple[tuple[str, bytes], ...]:
        derived.append(True)
        return real()

    monkeypatch.setattr(plan, "engine_files", counted)
    plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", profile="local"))
    assert derived == []
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    spark = next(t for t in shipped["targets"] if t["profile"] == "spark")
    spark["patches"] = ["cmake-arch-sm121"]
    (tmp_path / "matrix.yaml").write_text(yaml.safe_dump({**shipped, "targets": [spark]}))
    (tmp_path / "patches").symlink_to(ROOT / "patches")
    (patched,) = plan.make(Options.from_env(matrix=tmp_path / "matrix.yaml"))
    assert derived == [True]
    assert any(name.startswith("sparkbuild/sparkbuild/patch/") for stage in patched.stages for name, _ in stage.rendered.files)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "sparkbuild" / "resources").glob("*.yaml")))
def test_each_shipped_yaml_reads_as_pyyamls_own_parser_reads_it(name: str) -> None:
    """Every run reads the shipped defaults and kernel paths, with libyaml's parser (a tenth of the time)."""
    text = (ROOT / "sparkbuild" / "resources" / name).read_text()
    assert yamlsrc.load_shipped(text) == yaml.safe_load(text)


def test_bisect_stages_written_in_the_cli_are_bisects_own() -> None:
    assert cli.BISECT_STAGES == bisect.STAGES


def test_lanes_written_in_the_cli_are_the_matrixs_own() -> None:
    from sparkbuild.plan import matrix

    assert cli.LANES == matrix.LANES
