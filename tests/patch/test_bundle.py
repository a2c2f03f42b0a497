"""The patch engine as a container's source stage runs it: the files ``sparkbuild.patch.bundle`` derives,
copied alone into a folder, run by a Python that cannot import click, docker, jinja2, requests or
git. No download: the tree is a small CMake project made here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from sparkbuild.patch import bundle, rules
from tests.support.trees import PATCHES

BLOCKED = ("click", "docker", "jinja2", "requests", "git", "tqdm")
# Run as `python3 -c`: refuse the blocked packages, then run the engine's __main__ from the copy.
RUNNER = textwrap.dedent("""\
    import importlib.abc, runpy, sys
    BLOCKED = {blocked!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is not available in a source stage")
            return None

    sys.meta_path.insert(0, Refuse())
    import sparkbuild.patch as entry
    assert entry.__file__.startswith({lib!r}), entry.__file__
    sys.argv = ["python3 -m sparkbuild.patch", *sys.argv[1:]]
    runpy.run_module("sparkbuild.patch", run_name="__main__", alter_sys=True)
""")

CMAKE = """\
cmake_minimum_required(VERSION 3.26)
if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 12.8)
  set(CUDA_SUPPORTED_ARCHS "8.0;9.0;10.0;12.0")
endif()
cuda_archs_loose_intersection(FP4_ARCHS "12.0;12.0a" "${CUDA_ARCHS}")
"""


def copy_bundle(dest: Path) -> Path:
    for rel, data in bundle.files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    return dest


def run(lib: Path, *args: str) -> subprocess.CompletedProcess[str]:
    code = RUNNER.format(blocked=BLOCKED, lib=str(lib))
    # -S: no site-packages .pth file, so the checkout's own builder package cannot shadow the copy;
    # PyYAML and packaging come from the folder the copy is run with.
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PYTHONPATH": f"{lib}:{site}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-S", "-c", code, *args], capture_output=True, text=True, env=env, cwd=lib)


def status_of(table: str, name: str) -> str:
    (line,) = [line for line in table.splitlines() if line[2:].split()[:1] == [name]]
    return line[2:].split()[1]


def test_the_bundle_holds_the_engine_every_rule_and_nothing_for_people() -> None:
    names = bundle.modules()
    assert "sparkbuild.patch.__main__" in names and "sparkbuild.patch.engine" in names
    assert {f"sparkbuild.patch.rules.{r.replace('-', '_')}" for r in rules.names()} <= set(names)
    for for_people in (
        "sparkbuild.cli",
        "sparkbuild.patch.cli",
        "sparkbuild.patch.releases",
        "sparkbuild.upstream.sources",
        "sparkbuild.plan.plan",
    ):
        assert for_people not in names


def test_the_copied_engine_runs_with_the_heavy_packages_blocked(tmp_path: Path) -> None:
    lib = copy_bundle(tmp_path / "lib")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "CMakeLists.txt").write_text(CMAKE)
    args = ["--source", str(tree), "--version", "0.12.0", "--patches", str(PATCHES), "--patch", "cmake-arch-sm121"]
    check = run(lib, "check", *args)
    assert check.returncode == 0, check.stderr
    assert status_of(check.stdout, "cmake-arch-sm121") == "applies"
    apply = run(lib, "apply", *args)
    assert apply.returncode == 0, apply.stderr
    text = (tree / "CMakeLists.txt").read_text()
    assert '"8.0;9.0;10.0;12.0;12.1"' in text and '"12.0;12.0a;12.1a"' in text
    assert json.loads((tree / ".sparkbuild-patches.json").read_text())["results"][0]["status"] == "applies"
    again = run(lib, "apply", *args)
    assert again.returncode == 0, again.stderr
    assert status_of(again.stdout, "cmake-arch-sm121") == "applied"


def test_a_blocked_import_is_refused_for_real(tmp_path: Path) -> None:
    """The blocker itself works: a module that needs requests fails in the same runner."""
    lib = copy_bundle(tmp_path / "lib")
    (lib / bundle.PACKAGE / "patch" / "needs_requests.py").write_text("import requests\n")
    code = RUNNER.format(blocked=BLOCKED, lib=str(lib)).replace(
        "import sparkbuild.patch as entry", "import sparkbuild.patch.needs_requests as entry"
    )
    site = next(p for p in sys.path if p.endswith("site-packages"))
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, env={"PYTHONPATH": f"{lib}:{site}"}, cwd=lib
    )
    assert done.returncode != 0 and "requests is not available in a source stage" in done.stderr
