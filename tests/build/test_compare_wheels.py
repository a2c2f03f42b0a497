"""The wheel comparison of ``sparkbuild reproduce`` on real wheels with a C extension, each built here
by setuptools and gcc from the same source in the same folder, as a build stage builds its wheel.

The non-reproducibility users fear in a compiled wheel is the one the anchor (timothystewart6/vllm-gb10)
hashes symbol tables for: a library that embeds the time it was built (``__DATE__``/``__TIME__``), or
one whose exported symbols changed. Both are built for real and must be named, member and cause; the
same source built twice at one SOURCE_DATE_EPOCH (which gcc honours for ``__DATE__``, and setuptools for
the zip's times) must give the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbuild.build import compare, inventory

SOURCE = r"""
#include <Python.h>

/* What a build stamp looks like: the time the compiler ran, kept in the library. */
const char stamp_built[] = "built " __DATE__ " " __TIME__;

#ifdef STAMP_EXTRA
void stamp_extra(void) {}
#endif

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stamp", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_stamp(void) { return PyModule_Create(&module); }
"""

SETUP = """
import hashlib
import os
from setuptools import Extension, setup

macros = [("STAMP_EXTRA", "1")] if os.environ.get("STAMP_EXTRA") else []
setup(name="stamp", version="1.0", ext_modules=[Extension("stamp", ["stamp.c"], define_macros=macros)])
"""

# Two moments an hour, a minute and a second apart (2023-11-14 22:13:20 and 23:14:21 UTC).
EPOCH = 1700000000
LATER = EPOCH + 3661


@pytest.fixture(scope="module")
def area(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every stamp wheel of this module is built: one folder, as a stage builds in /src."""
    return tmp_path_factory.mktemp("stamp")


@pytest.fixture(scope="module")
def first(area: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stamp wheel built at EPOCH: the first build of each test."""
    return built(area, tmp_path_factory.mktemp("first"), EPOCH)


def built(area: Path, dest: Path, epoch: int, extra: bool = False) -> Path:
    """The stamp wheel built from a fresh copy of its source, always in ``area/src`` (a build in
    another folder would differ by its path in the debug information), moved into ``dest``."""
    src = area / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    (src / "stamp.c").write_text(SOURCE)
    (src / "setup.py").write_text(SETUP)
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), **({"STAMP_EXTRA": "1"} if extra else {})}
    out = area / "out"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", str(out), str(src)],
        env=env,
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("stamp-1.0-*.whl")
    dest.mkdir(parents=True, exist_ok=True)
    return wheel.rename(dest / wheel.name)


def read(path: Path) -> dict[str, inventory.Wheel]:
    with path.open("rb") as stream:
        sha256 = hashlib.file_digest(stream, "sha256").hexdigest()
        return {f"wheels/{path.name}": inventory.read_wheel(f"wheels/{path.name}", sha256, stream)}


def library(wheel: inventory.Wheel) -> inventory.Member:
    (member,) = (m for m in wheel.members.values() if m.name.endswith(".so"))
    return member


def test_the_same_source_at_one_source_date_epoch_gives_the_same_wheel(first: Path, area: Path, tmp_path: Path) -> None:
    second = built(area, tmp_path, EPOCH)
    assert first.read_bytes() == second.read_bytes()
    found = compare.compare_wheels(read(first), read(second))
    assert found.matches, found.lines()
    assert "the same bytes" in found.lines()[0]
    (summary,) = found.wheels
    (elf,) = summary["elf"]
    assert elf["same"] and elf["first_sha256"] == elf["second_sha256"] and elf["member"].endswith(".so")
    assert "PyInit_stamp" in library(next(iter(read(first).values()))).symbols.names  # type: ignore[union-attr]


def test_a_library_that_embeds_its_build_time_is_named_with_the_times(first: Path, area: Path, tmp_path: Path) -> None:
    second = built(area, tmp_path, LATER)
    a, b = read(first), read(second)
    found = compare.compare_wheels(a, b)
    member = library(next(iter(a.values()))).name
    wheel = f"wheels/{first.name}"
    # The library, and the wheel's RECORD that holds its hash; the library's cause needs its bytes.
    assert [(d.path, d.cause) for d in found.differences] == [
        (f"{wheel}!stamp-1.0.dist-info/RECORD", "record"),
        (f"{wheel}!{member}", "content"),
    ]
    (summary,) = found.wheels
    assert summary["elf"][0]["same"]  # the same symbols: only the bytes differ
    assert set(summary["times_only"]) >= {"stamp-1.0.dist-info/METADATA"}  # the zip's own times differ too

    explained = compare.explain_members(wheel, found.differences, first, second, tmp_path)
    d = explained[1]
    assert d.cause == "build-time", d
    assert "'built Nov 14 2023 22:13:20'" in d.detail and "'built Nov 14 2023 23:14:21'" in d.detail
    assert "build-time (1)" in "\n".join(compare.group_lines(explained))


def test_a_library_whose_exported_symbols_differ_names_each_symbol(first: Path, area: Path, tmp_path: Path) -> None:
    second = built(area, tmp_path, EPOCH, extra=True)
    found = compare.compare_wheels(read(first), read(second))
    assert [d.cause for d in found.differences] == ["record", "elf-symbols"]
    d = found.differences[1]
    symbols = d.to_json()["symbols"]
    assert symbols["only_in_first"] == [] and symbols["only_in_second"] == ["stamp_extra"]
    assert symbols["first_sha256"] != symbols["second_sha256"]
    (summary,) = found.wheels
    assert not summary["elf"][0]["same"]
    assert "1 only in the second (stamp_extra)" in d.detail


def test_a_wheel_in_one_build_only_is_named(first: Path) -> None:
    found = compare.compare_wheels(read(first), {})
    assert [(d.path, d.cause) for d in found.differences] == [(f"wheels/{first.name}", "only-first")]
