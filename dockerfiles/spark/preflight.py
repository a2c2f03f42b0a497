"""Run in the vLLM build stage before the long compile (stdlib only):

1. vLLM's own CMake configure of the patched source, with the target's TORCH_CUDA_ARCH_LIST, the
   external projects from the source stage (``*_SRC_DIR``) and FetchContent disconnected, so a
   source that would be cloned from GitHub is an error here and not a download;
2. which of the configured units the compile builds: vLLM's ``setup.py`` builds the CMake targets
   of the extensions it lists (``cmake --build --target ...``), so its own module is run with
   ``setuptools.setup`` replaced (nothing built) to read that list, and ninja names every command
   those targets need (``ninja -t commands``); a unit of no such target is ``not_built``;
3. the translation units that include a file the patch set changed (the patch record says which:
   the files of every patch that ``applies`` or is ``applied``), compiled with exactly the flags
   CMake gave them, through ccache; each result names the changed files its unit reaches.

It writes ``compile_commands.json``, the compiled objects, ``preflight.json`` and the image's record of
it (``record.json``, without this build's times and memory) to ``--out``;
sparkbuild audits the code targets of every unit and runs check-binary on the objects.
The arguments mirror vLLM's ``setup.py`` (``cmake_build_ext.configure``).
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

GCC_MIN = re.compile(r'CMAKE_CXX_COMPILER_VERSION\s+VERSION_LESS\s+"([\d.]+)"')
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
STUB_MARK = ".sparkbuild-stub"


def version_tuple(text: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def check_toolchain(source: pathlib.Path) -> None:
    """The C++ compiler meets the newest minimum vLLM's CMakeLists.txt checks for (GCC >= 13 for 0.33)."""
    cmake = (source / "CMakeLists.txt").read_text(errors="replace")
    minimum = max((m for m in GCC_MIN.findall(cmake)), key=version_tuple, default=None)
    gcc = shutil.which("g++") or shutil.which("c++")
    if gcc is None:
        sys.exit("preflight: no C++ compiler (g++) in the build image; its toolchain packages did not install")
    have = subprocess.run([gcc, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, check=True).stdout.strip()
    if minimum is not None and version_tuple(have) < version_tuple(minimum):
        sys.exit(
            f"preflight: vLLM's CMakeLists.txt needs GCC >= {minimum}; this build base has {gcc} {have}. Use a base image "
            "whose distribution has a newer GCC (Ubuntu 24.04: 13, Debian trixie: 14)"
        )
    print("preflight: {} {} (vLLM needs >= {})".format(gcc, have, minimum or "nothing stated"), flush=True)


def configure(source: pathlib.Path, build: pathlib.Path, log: pathlib.Path) -> float:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    args = [
        "cmake", str(source), "-G", "Ninja",
        f"-DCMAKE_BUILD_TYPE={os.environ.get('CMAKE_BUILD_TYPE', 'RelWithDebInfo')}",
        "-DVLLM_TARGET_DEVICE=cuda",
        f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}",
        f"-DVLLM_PYTHON_PATH={':'.join(sys.path)}",
        f"-DFETCHCONTENT_BASE_DIR={build / 'deps'}",
        f"-DNVCC_THREADS={os.environ.get('NVCC_THREADS', '1')}",
        f"-DCMAKE_CUDA_COMPILER={cuda_home}/bin/nvcc",
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
        *os.environ.get("CMAKE_ARGS", "").split(),
    ]  # fmt: skip
    build.mkdir(parents=True, exist_ok=True)
    print("+ " + shlex.join(args), flush=True)
    start = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(args, cwd=build, stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        # Generators run by the configure (Marlin, Machete) log beside the build: show theirs too.
        for extra in sorted(build.glob("*.log")):
            tail += ["", f"--- {extra.name} (last lines)", *extra.read_text(errors="replace").splitlines()[-30:]]
        lines = "\n".join(tail)
        sys.exit(f"preflight: vLLM's CMake configure failed (exit {done.returncode}); last lines:\n{lines}")
    return time.monotonic() - start


# Run in a process of its own: setup.py's module with setuptools.setup replaced, so it lists its
# extensions and builds nothing (what `setup.py bdist_wheel` would pass to `cmake --build --target`).
SETUP_EXTENSIONS = """
import json, runpy, setuptools, sys
found = {}
setuptools.setup = lambda **kwargs: found.update(kwargs)
sys.argv = ["setup.py", "--name"]
runpy.run_path("setup.py", run_name="__main__")
print("SPARKBUILD-EXTENSIONS " + json.dumps([e.name for e in found.get("ext_modules", [])]))
"""


def setup_targets(source: pathlib.Path) -> list:
    """The CMake targets vLLM's setup.py builds for this environment, named as its build_ext names them."""
    done = subprocess.run([sys.executable, "-c", SETUP_EXTENSIONS], cwd=source, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SPARKBUILD-EXTENSIONS ")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        sys.exit(f"preflight: could not read the extensions vLLM's setup.py builds (exit {done.returncode}):\n{tail}")
    names = json.loads(lines[-1].split(" ", 1)[1])
    return [n.removeprefix("vllm.").removeprefix("vllm_flash_attn.") for n in names]


def not_built(commands: list, build: pathlib.Path, targets: list) -> tuple:
    """The files of the configured units none of ``targets`` needs (ninja's own closure of them), and
    the targets the configure does not define."""
    ninja = shutil.which("ninja")
    if ninja is None:
        sys.exit("preflight: no ninja on PATH (vLLM's build requirements install it)")
    listed = subprocess.run([ninja, "-C", str(build), "-t", "targets", "all"], capture_output=True, text=True, check=True)
    known = {line.split(":", 1)[0] for line in listed.stdout.splitlines()}
    present = [t for t in targets if t in known]
    needed = subprocess.run([ninja, "-C", str(build), "-t", "commands", *present], capture_output=True, text=True, check=True)
    # ninja writes outputs relative to the build folder, compile_commands.json as CMake gave them.
    outputs = set()
    for line in needed.stdout.splitlines():
        words = line.split()
        outputs.update(os.path.normpath(build / words[i + 1]) for i, word in enumerate(words[:-1]) if word == "-o")
    files = sorted(
        {
            e["file"]
            for e in commands
            if e.get("output") and os.path.normpath(pathlib.Path(e.get("directory", build)) / e["output"]) not in outputs
        }
    )
    return files, [t for t in targets if t not in known]


def entry_args(entry: dict) -> list:
    return list(entry["arguments"]) if "arguments" in entry else shlex.split(entry["command"])


def include_dirs(args: list, directory: pathlib.Path) -> list:
    dirs = []
    for i, arg in enumerate(args):
        if arg in ("-I", "-isystem") and i + 1 < len(args):
            dirs.append(args[i + 1])
        elif arg.startswith("-I") and len(arg) > 2:
            dirs.append(arg[2:])
        elif arg.startswith("-isystem") and len(arg) > 8:
            dirs.append(arg[8:])
    return [(directory / d).resolve() for d in dirs]


def includes(path: pathlib.Path, seen_text: dict) -> list:
    if path not in seen_text:
        try:
            seen_text[path] = INCLUDE.findall(path.read_text(errors="replace"))
        except OSError:
            seen_text[path] = []
    return seen_text[path]


def reaches(unit: pathlib.Path, dirs: list, changed: set, source: pathlib.Path, cache: dict) -> set:
    """The changed files ``unit`` is or includes (transitively, within the source tree)."""
    todo, seen, found = [unit.resolve()], set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path in changed:
            found.add(path)
        for name in includes(path, cache):
            for folder in [path.parent, *dirs]:
                candidate = (folder / name).resolve()
                if candidate.is_file():
                    if source in candidate.parents:
                        todo.append(candidate)
                    break
    return found


# The statuses whose files hold the patch set's change in this tree: made now, or already there.
CHANGED = ("applies", "applied")


def changed_files(source: pathlib.Path) -> set:
    """Every file the patch record says holds a patch's change (by content: the engine says
    ``applied`` only where the change itself is in the file)."""
    record = source / ".sparkbuild-patches.json"
    if not record.is_file():
        return set()
    data = json.loads(record.read_text())
    return {(source / f).resolve() for r in data.get("results", []) if r.get("status") in CHANGED for f in r.get("files", [])}


def patched_units(commands: list, source: pathlib.Path, changed: set) -> list:
    """(entry, the changed files it reaches) of every CUDA unit that is or includes a changed file."""
    cache: dict = {}
    units = []
    for e in commands:
        if e["file"].endswith(".cu"):
            found = reaches(
                pathlib.Path(e["file"]), include_dirs(entry_args(e), pathlib.Path(e["directory"])), changed, source, cache
            )
            if found:
                units.append((e, sorted(str(p.relative_to(source)) for p in found)))
    return units


def compile_unit(entry: dict, out: pathlib.Path, index: int, reached: list, measured: bool = False) -> dict:
    args = entry_args(entry)
    if "-o" not in args:
        return {"file": entry["file"], "ok": False, "error": "no -o in its compile command", "reaches": reached}
    obj = out / "objects" / f"{index:03d}-{pathlib.Path(entry['file']).name}.o"
    obj.parent.mkdir(parents=True, exist_ok=True)
    args[args.index("-o") + 1] = str(obj)
    # A measured unit is compiled whatever ccache holds: a cache hit runs no compiler to measure.
    launcher = ["ccache"] if shutil.which("ccache") and not measured else []
    start = time.monotonic()
    returncode, output, peak_mb = run_measured(launcher + args, pathlib.Path(entry["directory"]))
    result = {
        "file": entry["file"],
        "object": str(obj.relative_to(out)) if returncode == 0 else None,
        "ok": returncode == 0,
        "seconds": round(time.monotonic() - start, 1),
        "peak_rss_mb": peak_mb,
        "reaches": reached,
    }
    if measured:
        result["measured"] = True
    if returncode != 0:
        result["error"] = output[-3000:]
    state = "ok  " if result["ok"] else "FAIL"
    print("  {} {} ({:.0f}s, {} MB)".format(state, entry["file"], result["seconds"], peak_mb), flush=True)
    return result


def run_measured(args: list, cwd: pathlib.Path) -> tuple:
    """(exit status, output, the largest resident set of the process and every process it waited for, MB).

    The kernel gives that peak for one child tree through wait4(), so compiles run side by side are
    each measured apart (nvcc waits for its cicc and ptxas, ccache for nvcc). It starts at this
    process's own high-water mark (the kernel carries it into the child's exec): tens of MB here."""
    with tempfile.TemporaryFile() as sink:
        proc = subprocess.Popen(args, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        sink.seek(0)
        output = sink.read().decode(errors="replace")
    return proc.returncode, output, round(usage.ru_maxrss / 1024)


# A regular expression over the configured units' paths: each unit it finds is compiled as well and
# its memory measured (bench/compile_memory.py sets it through the build argument of the same name).
MEASURE = "SPARKBUILD_PREFLIGHT_MEASURE"


def measured_units(commands: list, already: set) -> list:
    """The configured CUDA units the measure pattern finds, less those compiled or never built anyway."""
    pattern = os.environ.get(MEASURE, "")
    if not pattern:
        return []
    found = [e for e in commands if e["file"].endswith(".cu") and re.search(pattern, e["file"]) and e["file"] not in already]
    if not found:
        sys.exit(f"preflight: {MEASURE}={pattern!r} finds no configured CUDA unit that the compile builds")
    return found


def src_dirs() -> dict:
    """Every local tree the compile is handed: *_SRC_DIR variables, and FetchContent's own overrides
    (-DFETCHCONTENT_SOURCE_DIR_<NAME>=...) in CMAKE_ARGS."""
    found = {k: v for k, v in os.environ.items() if k.endswith("_SRC_DIR") and v}
    for arg in os.environ.get("CMAKE_ARGS", "").split():
        if arg.startswith("-DFETCHCONTENT_SOURCE_DIR_") and "=" in arg:
            name, value = arg[2:].split("=", 1)
            found[name] = value
    return dict(sorted(found.items()))


def stubbed(source: pathlib.Path) -> list:
    """External projects whose tree is a stand-in (it carries a marker), not the real source."""
    names = []
    for name, value in src_dirs().items():
        folder = pathlib.Path(value)
        if any((p / STUB_MARK).is_file() for p in [folder, *folder.parents] if p != pathlib.Path("/")):
            names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", type=pathlib.Path, required=True)
    parser.add_argument("--build", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--check-toolchain", action="store_true", help="only check the compiler against vLLM's minimum")
    args = parser.parse_args()
    check_toolchain(args.source)
    if args.check_toolchain:
        return
    if args.build is None or args.out is None:
        parser.error("--build and --out are needed unless --check-toolchain")
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = configure(args.source, args.build, args.out / "configure.log")
    commands = json.loads((args.build / "compile_commands.json").read_text())
    (args.out / "compile_commands.json").write_text(json.dumps(commands, indent=1))
    targets = setup_targets(args.source)
    skipped, undefined = not_built(commands, args.build, targets)
    print(f"preflight: setup.py builds {', '.join(targets)}; {len(skipped)} configured unit(s) none of them needs", flush=True)
    changed = changed_files(args.source)
    units = patched_units(commands, args.source.resolve(), changed)
    extra = measured_units(commands, {e["file"] for e, _ in units} | set(skipped))
    # As many at once as the compile will run: vLLM's MAX_JOBS // NVCC_THREADS.
    workers = max(1, int(os.environ.get("MAX_JOBS", "1")) // int(os.environ.get("NVCC_THREADS", "1")))
    print(f"preflight: {len(units)} CUDA units include a patched file; compiling them, {workers} at once", flush=True)
    if extra:
        print(f"preflight: and {len(extra)} unit(s) {MEASURE} names, compiled without ccache to measure them", flush=True)
    jobs = [(e, reached, False) for e, reached in units] + [(e, [], True) for e in extra]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(compile_unit, e, args.out, i, reached, measured) for i, (e, reached, measured) in enumerate(jobs)]
        compiled = [f.result() for f in futures]
    report = {
        # The largest resident set of any compiler process (cicc, ptxas, ...) these compiles ran:
        # what the plan's memory per nvcc thread is checked against (a ccache hit runs no compiler).
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "source": str(args.source),
        "configure_seconds": round(seconds, 1),
        "compile_seconds": round(time.monotonic() - start, 1),
        "changed_files": sorted(str(p.relative_to(args.source.resolve())) for p in changed),
        "compiled": compiled,
        "stubbed": stubbed(args.source),
        "src_dirs": src_dirs(),
        "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "targets": targets,
        "undefined_targets": undefined,
        "not_built": skipped,
    }
    (args.out / "preflight.json").write_text(json.dumps(report, indent=2) + "\n")
    # The image's copy: the same without what this build measured (times, the compilers' peak memory),
    # which differ between two builds of the same inputs (`sparkbuild reproduce` found peak_rss_mb so).
    record = {k: v for k, v in report.items() if k not in MEASURED}
    record["compiled"] = [{k: v for k, v in unit.items() if k not in MEASURED_PER_UNIT} for unit in compiled]
    (args.out / "record.json").write_text(json.dumps(record, indent=2) + "\n")


# Measurements of this build in preflight.json, left out of the image's record.
MEASURED = ("peak_rss_mb", "configure_seconds", "compile_seconds")
# And each compiled unit's.
MEASURED_PER_UNIT = ("seconds", "peak_rss_mb")


if __name__ == "__main__":
    main()
