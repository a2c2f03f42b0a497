"""What the command line loads before it does anything: a patch verdict must not pay for Docker,
Jinja2, gitpython or requests, and a nightly with nothing to do not for what only some targets or
steps need (the time this saves is measured by bench/patch_verdicts.py and bench/startup.py). The
imports inside functions that keep these out are held here."""

from __future__ import annotations

import subprocess
import sys

from sparkbuild import cli
from sparkbuild.lanes import bisect

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


def test_bisect_stages_written_in_the_cli_are_bisects_own() -> None:
    assert cli.BISECT_STAGES == bisect.STAGES


def test_lanes_written_in_the_cli_are_the_matrixs_own() -> None:
    from sparkbuild.plan import matrix

    assert cli.LANES == matrix.LANES
