"""check-binary, kernel by kernel, on real objects, libraries and a wheel made here with nvcc 13 and
listed by PyPI's cuobjdump.

The library users fear is vLLM's: every unit linked into one ``_C.abi3.so``, each compiled for its
own arch list, so one kernel built only for ``sm_120a`` hides beside kernels built for ``sm_121a``.
Here such a library is made for real (two units, two arch lists, one ``nvcc -shared``) and must fail
naming the kernel and the library; a Hopper-only kernel beside good ones, PTX-only kernels and
family (``sm_120f``) cubins must pass. Compiles are cached by content (tests/support/nvcc.py), so
a warm run compiles nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbuild.build import binaries
from sparkbuild.config.options import Options
from tests.support import nvcc

pytestmark = pytest.mark.nvcc
BIN = Path(sys.executable).parent
SM121 = binaries.Arch.parse("12.1")  # the GB10 in the DGX Spark
# One kernel per unit (and a template instance in the good one), named for what it is built for.
UNITS = {
    "good": "__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }\n"
    "template <int N> __global__ void shift(float* x) { x[threadIdx.x] += N; }\n"
    "template __global__ void shift<3>(float*);\n",
    "only120a": "__global__ void only_sm120a(float* x) { x[threadIdx.x] *= 3.0f; }\n",
    "ptx120a": "__global__ void only_compute120a(float* x) { x[threadIdx.x] *= 5.0f; }\n",
    "hopper": "__global__ void hopper_only(float* x) { x[threadIdx.x] -= 1.0f; }\n",
    "jit": "__global__ void jit_only(float* x) { x[threadIdx.x] += 7.0f; }\n",
    "family": "__global__ void family_sm120f(float* x) { x[threadIdx.x] *= 11.0f; }\n",
    # One template kernel instantiated in two units, as vLLM's helpers are: two kernels to the runtime.
    "twin": "template <int N> __global__ void twin(int* o) { *o = N; }\ntemplate __global__ void twin<5>(int*);\n",
    # Device code but no kernel, like vLLM's nvfp4_quant_entry.cu: an empty cubin, nothing to launch.
    "nokernels": "__device__ int twice(int x) { return 2 * x; }\nint host(int x) { return x + 1; }\n",
}
# Each object: (its unit, its -gencode).
OBJECTS = {
    "good_sm121a.o": ("good", "arch=compute_121a,code=sm_121a"),
    "only_sm120a.o": ("only120a", "arch=compute_120a,code=sm_120a"),
    "ptx_compute120a.o": ("ptx120a", "arch=compute_120a,code=compute_120a"),
    "hopper_sm90a.o": ("hopper", "arch=compute_90a,code=sm_90a"),
    "jit_compute80.o": ("jit", "arch=compute_80,code=compute_80"),
    "family_sm120f.o": ("family", "arch=compute_120f,code=sm_120f"),
    "no_kernels_sm121a.o": ("nokernels", "arch=compute_121a,code=sm_121a"),
    "twin_sm121a.o": ("twin", "arch=compute_121a,code=sm_121a"),
    "twin_sm120a.o": ("twin", "arch=compute_120a,code=sm_120a"),
    "twin_sm90a.o": ("twin", "arch=compute_90a,code=sm_90a"),
}
# Each library: the objects linked into it.
LIBRARIES = {
    "libmixed.so": ("good_sm121a.o", "only_sm120a.o"),  # the mixed-arch build: must fail
    "libmixed_ptx.so": ("good_sm121a.o", "ptx_compute120a.o"),  # arch-specific PTX of 12.0: must fail
    "libhopper_beside.so": ("good_sm121a.o", "hopper_sm90a.o"),  # passes, hopper_only listed
    "libjit.so": ("jit_compute80.o",),  # PTX only: passes, JIT
    "libfamily.so": ("family_sm120f.o",),  # a family cubin: runs on every 12.x
    "libhopper.so": ("hopper_sm90a.o",),  # nothing for this GPU at all
    "libtwins.so": ("twin_sm121a.o", "twin_sm120a.o"),  # one instance cannot run: must fail
    "libtwins_hopper.so": ("twin_sm121a.o", "twin_sm90a.o"),  # the other instance is Hopper's: passes
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The objects and libraries above (cached by content), and a host-only library."""
    cache = Options.from_env().cache
    sources = tmp_path_factory.mktemp("units")
    found: dict[str, Path] = {}
    for name, (unit, gencode) in OBJECTS.items():
        (sources / f"{unit}.cu").write_text(UNITS[unit])
        args = ["-c", "-Xcompiler", "-fPIC", "-gencode", gencode, "{src}"]
        found[name] = _made(nvcc.compile_cached(args, {"src": nvcc.Root(sources / f"{unit}.cu")}, name, cache))
    for name, objects in LIBRARIES.items():
        roots = {f"o{i}": nvcc.Root(found[o]) for i, o in enumerate(objects)}
        args = ["-shared", *(f"{{{r}}}" for r in roots)]
        found[name] = _made(nvcc.compile_cached(args, roots, name, cache))
    (sources / "host.c").write_text("int host(void) { return 1; }\n")
    found["libhost.so"] = sources / "libhost.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(sources / "host.c"), "-o", str(found["libhost.so"])], check=True)
    return found


def _made(done: nvcc.Compiled) -> Path:
    assert done.returncode == 0, done.stderr
    return done.output


def verdicts(report: binaries.FileReport) -> dict[str, str]:
    return {k.name: k.verdict for k in report.kernels}


def sparkbuild(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN / "sparkbuild", "check-binary", *map(str, args)], capture_output=True, text=True, check=False)


def test_an_sm120a_only_kernel_linked_beside_sm121a_kernels_fails_by_name(built: dict[str, Path]) -> None:
    report = binaries.check_file(built["libmixed.so"], SM121)
    assert verdicts(report) == {"_Z5scalePf": "sass", "_Z5shiftILi3EEvPf": "sass", "_Z11only_sm120aPf": "fails"}
    assert report.ok is False and report.runs  # the library-level check of old passed it: sm_121a is there
    assert [c.label() for c in report.failing[0].codes] == ["sm_120a"]
    # Arch-specific PTX is no better: compute_120a is JIT-compiled for 12.0 only.
    ptx = binaries.check_file(built["libmixed_ptx.so"], SM121)
    assert verdicts(ptx)["_Z16only_compute120aPf"] == "fails"
    assert [c.label() for c in ptx.failing[0].codes] == ["compute_120a"]


def test_a_template_kernel_in_two_units_is_judged_in_each(built: dict[str, Path]) -> None:
    # Each launch site runs its own unit's instance: on an H100 the sm_100f unit's launch of the same
    # instance failed beside the sm_90a unit's (docs/check-binary.md). The union of both would pass.
    (twin,) = binaries.check_file(built["libtwins.so"], SM121).kernels
    assert (twin.name, twin.verdict) == ("_Z4twinILi5EEvPi", "fails")
    assert sorted([c.label() for c in unit] for unit in twin.units) == [["sm_120a"], ["sm_121a"]]
    (hopper,) = binaries.check_file(built["libtwins_hopper.so"], SM121).kernels
    assert hopper.verdict == "sass" and sorted([c.label() for c in unit] for unit in hopper.units) == [["sm_121a"], ["sm_90a"]]
    done = sparkbuild(built["libtwins.so"])
    assert done.returncode == 11 and "_Z4twinILi5EEvPi (per unit: " in done.stderr.splitlines()[-1]


def test_hopper_only_ptx_only_and_family_kernels_pass(built: dict[str, Path]) -> None:
    beside = binaries.check_file(built["libhopper_beside.so"], SM121)
    assert verdicts(beside) == {"_Z5scalePf": "sass", "_Z5shiftILi3EEvPf": "sass", "_Z11hopper_onlyPf": "other"}
    assert beside.ok is True and beside.other_archs() == {"sm_90a": 1}
    jit = binaries.check_file(built["libjit.so"], SM121)
    assert verdicts(jit) == {"_Z8jit_onlyPf": "ptx"} and jit.ok is True and jit.runs_with() == {"compute_80": 1}
    # cuobjdump -lelf names this cubin sm_120; its symbol table says sm_120f, which is what runs on 12.1.
    family = binaries.check_file(built["libfamily.so"], SM121)
    assert verdicts(family) == {"_Z13family_sm120fPf": "sass"} and family.runs_with() == {"sm_120f": 1}
    assert binaries.check_file(built["libhost.so"], SM121).ok is None  # no device code: not judged
    empty = binaries.check_file(built["no_kernels_sm121a.o"], SM121)
    assert (empty.ok, empty.kernels, [c.label() for c in empty.codes]) == (True, (), ["sm_121a"])
    # The same Hopper kernel judged for an H100 runs from its cubin.
    assert verdicts(binaries.check_file(built["libhopper.so"], binaries.Arch.parse("9.0"))) == {"_Z11hopper_onlyPf": "sass"}


def test_the_cli_fails_with_exit_11_naming_kernel_and_library(built: dict[str, Path]) -> None:
    bad = sparkbuild(built["libhopper_beside.so"], built["libmixed.so"], "--arch", "12.1")
    assert bad.returncode == 11, bad.stderr
    error = bad.stderr.splitlines()[-1]
    assert f"{built['libmixed.so']}: _Z11only_sm120aPf (sm_120a)" in error
    assert "libhopper_beside.so" not in error and "scale" not in error
    # The summary: counts per library, then the failing kernel demangled, with its library.
    # The summary: counts per library, then the failing kernel demangled, with its library (paths
    # under the folder named atop the table).
    top = bad.stdout.splitlines()[0].split(", in ")[1]
    assert Path(top) in built["libmixed.so"].parents and Path(top) in built["libhopper_beside.so"].parents
    mixed, beside = (str(built[n].relative_to(top)) for n in ("libmixed.so", "libhopper_beside.so"))
    rows = [line.split() for line in bad.stdout.splitlines()]
    assert ["ok", "3", "2", "0", "1", "0", beside] in rows
    assert ["FAILS", "3", "2", "0", "0", "1", mixed] in rows
    assert f"{beside}: not for this GPU: 1 [sm_90a]" in bad.stdout
    assert bad.stdout.splitlines()[-2:] == [
        "FAILING: 1 kernel(s) have code for sm_12x but none that runs on sm_121:",
        f"  {mixed}: only_sm120a(float*) [sm_120a]",
    ]

    good = sparkbuild("--json", built["libhopper_beside.so"], built["libjit.so"], built["libfamily.so"], built["libhost.so"])
    assert good.returncode == 0, good.stderr
    by_name = {Path(r["path"]).name: r for r in json.loads(good.stdout)}
    assert by_name["libjit.so"]["counts"] == {"sass": 0, "ptx": 1, "other": 0, "fails": 0}
    assert by_name["libhopper_beside.so"]["kernels"][0] == {"name": "_Z11hopper_onlyPf", "verdict": "other", "codes": ["sm_90a"]}
    assert by_name["libhost.so"]["ok"] is None


def test_nothing_for_this_gpu_at_all_fails(built: dict[str, Path]) -> None:
    alone = sparkbuild(built["libhopper.so"], built["no_kernels_sm121a.o"], "--arch", "12.1")
    assert alone.returncode == 11
    assert f"no kernel in {built['libhopper.so']} runs on sm_121: their code is only for other GPUs (sm_90a)" in alone.stderr
    # A unit of device code without kernels passes alone: it has nothing to launch.
    assert sparkbuild(built["no_kernels_sm121a.o"]).returncode == 0


def test_a_wheel_has_each_of_its_libraries_judged(built: dict[str, Path], tmp_path: Path) -> None:
    bad = wheel(tmp_path / "bad", "kernels_bad", [built["libmixed.so"], built["libhopper_beside.so"], built["libhost.so"]])
    done = sparkbuild("--json", bad)
    assert done.returncode == 11, done.stderr
    assert f"{bad}/kernels_bad/libmixed.so: _Z11only_sm120aPf (sm_120a)" in done.stderr.splitlines()[-1]
    rows = {r["path"]: r["ok"] for r in json.loads(done.stdout)}
    assert rows == {
        f"{bad}/kernels_bad/{n}": ok for n, ok in (("libhopper_beside.so", True), ("libhost.so", None), ("libmixed.so", False))
    }

    good = wheel(tmp_path / "good", "kernels_good", [built["libhopper_beside.so"], built["libjit.so"]])
    done = sparkbuild(good)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(f"2 file(s), 2 with GPU code, in {good}/kernels_good")
    assert ["ok", "1", "0", "1", "0", "0", "libjit.so"] in [line.split() for line in done.stdout.splitlines()]


def wheel(folder: Path, package: str, libraries: list[Path]) -> Path:
    """A real wheel, built by pip and setuptools from a project that ships ``libraries`` as package data."""
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("")
    for library in libraries:
        (folder / package / library.name).write_bytes(library.read_bytes())
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "{package}"\nversion = "1.0"\n'
        f'[tool.setuptools]\npackages = ["{package}"]\n[tool.setuptools.package-data]\n{package} = ["*.so"]\n'
    )
    out = folder / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out), str(folder)],
        check=True,
    )
    (built,) = out.glob(f"{package}-1.0-*.whl")
    return built
