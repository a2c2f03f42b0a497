"""vLLM's own ``setup.py`` functions, run from the source tree rather than copied into sparkbuild.

``setup.py`` cannot be imported (it calls ``setup()`` and needs torch), so the functions sparkbuild
depends on are read out of it with ``ast`` and run in a namespace that provides what they use:

- ``get_requirements()``: the ``install_requires`` of the CUDA wheel (``requirements/cuda.txt``
  with its ``-r`` includes and vLLM's own per-CUDA-version edits);
- ``cmake_build_ext.compute_num_jobs()``: how ``MAX_JOBS`` and ``NVCC_THREADS`` become parallel
  compiles (vLLM divides the first by the second);
- ``setup(extras_require=...)``: an extra's requirements (``b12x``), read as the literal it is.

Standard library only, but for ``packaging`` (which vLLM's build requirements install): it also runs
inside the vLLM build stage (``python3 -m builder.vllm_setup``). Each requirement is written as a wheel's
METADATA writes it (packaging's own form, comments dropped), so a source build's requirements file is the
text a build from upstream's wheel reads out of the wheel, and the runtime's dependency layer, which
BuildKit keys by that file's content, is one layer for both.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _helpers(module: ast.Module) -> tuple[str, ...]:
    """The platform predicates get_requirements calls (``_is_cuda``, ``_no_device``, ...), as this
    version of setup.py defines them."""
    wanted = ("_no_device", "_build_custom_ops")
    return tuple(
        node.name
        for node in module.body
        if isinstance(node, ast.FunctionDef) and (node.name.startswith("_is_") or node.name in wanted)
    )


# The README's exit code for an invalid input (this script runs in the image, without builder.errors).
USAGE = 2


class SetupError(Exception):
    """setup.py of this tree lacks a function sparkbuild relies on, or it failed; the message says which."""


def _tree(source: Path) -> ast.Module:
    path = source / "setup.py"
    if not path.is_file():
        raise SetupError(f"{path}: no setup.py; not a vLLM source tree")
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _function(module: ast.Module, name: str) -> ast.FunctionDef | None:
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _run(module: ast.Module, names: tuple[str, ...], namespace: dict[str, Any], source: Path) -> dict[str, Any]:
    body: list[ast.stmt] = [f for n in names if (f := _function(module, n)) is not None]
    code = compile(ast.Module(body=body, type_ignores=[]), str(source / "setup.py"), "exec")
    exec(code, namespace)  # noqa: S102 - vLLM's own setup.py functions, from the tree being built
    return namespace


def requirements(source: Path, cuda: str) -> list[str]:
    """``install_requires`` of vLLM's CUDA wheel built against CUDA ``cuda`` (``13.0``)."""
    module = _tree(source)
    if _function(module, "get_requirements") is None:
        raise SetupError(f"{source / 'setup.py'} has no get_requirements(); sparkbuild reads the requirements with it")
    torch = SimpleNamespace(version=SimpleNamespace(cuda=cuda, hip=None))
    namespace: dict[str, Any] = {
        "ROOT_DIR": source,
        "VLLM_TARGET_DEVICE": "cuda",
        "envs": SimpleNamespace(VLLM_TARGET_DEVICE="cuda"),
        "torch": torch,
        "sys": SimpleNamespace(argv=["setup.py", "bdist_wheel"], platform="linux"),
        "os": os,
        "Path": Path,
        "logger": logging.getLogger("vllm-setup"),
    }
    _run(module, (*_helpers(module), "get_requirements"), namespace, source)
    try:
        found = namespace["get_requirements"]()
    except Exception as exc:  # any failure of vLLM's own code is reported, with its file
        raise SetupError(f"{source / 'setup.py'}: get_requirements() failed: {type(exc).__name__}: {exc}") from None
    return canonical([str(r) for r in found], source / "setup.py")


def canonical(lines: list[str], where: Path) -> list[str]:
    """Each requirement line (pip's requirements-file syntax: a trailing ``# comment``) in packaging's
    own form, the form a wheel's METADATA holds (``transformers<5.21.0,>=5.16.1``, markers in double
    quotes); blank lines dropped. A line packaging cannot read is a SetupError naming it."""
    from packaging.requirements import InvalidRequirement, Requirement

    found = []
    for line in lines:
        text = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not text:
            continue
        try:
            found.append(str(Requirement(text)))
        except InvalidRequirement as exc:
            raise SetupError(f"{where}: requirement {text!r} is not one pip reads: {exc}") from None
    return found


def extras(source: Path, names: list[str]) -> list[str]:
    """The requirements of vLLM's extras ``names`` (``setup(extras_require={...})``, a literal)."""
    if not names:
        return []
    declared: dict[str, list[str]] | None = None
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for keyword in node.keywords:
                if keyword.arg == "extras_require":
                    try:
                        declared = ast.literal_eval(keyword.value)
                    except ValueError:
                        raise SetupError(f"{source / 'setup.py'}: extras_require is not a literal") from None
    if declared is None:
        raise SetupError(f"{source / 'setup.py'}: setup() names no extras_require")
    unknown = [n for n in names if n not in declared]
    if unknown:
        raise SetupError(f"{source / 'setup.py'}: no extra {', '.join(unknown)}; it has {', '.join(sorted(declared))}")
    return canonical([r for n in names for r in declared[n]], source / "setup.py")


def compute_num_jobs(source: Path, max_jobs: int, nvcc_threads: int, cores: int) -> tuple[int, int | None]:
    """What vLLM's ``compute_num_jobs`` makes of ``MAX_JOBS`` and ``NVCC_THREADS``: (parallel
    compiles, nvcc threads each)."""
    module = _tree(source)
    if _function(module, "compute_num_jobs") is None:
        raise SetupError(f"{source / 'setup.py'} has no compute_num_jobs(); cannot size the build for this version")
    from packaging.version import Version

    namespace: dict[str, Any] = {
        "envs": SimpleNamespace(MAX_JOBS=str(max_jobs), NVCC_THREADS=str(nvcc_threads)),
        "os": SimpleNamespace(sched_getaffinity=lambda _: range(cores), cpu_count=lambda: cores),
        "_is_cuda": lambda: True,
        "CUDA_HOME": "/usr/local/cuda",
        "get_nvcc_cuda_version": lambda: Version("13.0"),
        "Version": Version,
        "logger": logging.getLogger("vllm-setup"),
    }
    _run(module, ("compute_num_jobs",), namespace, source)
    jobs, threads = namespace["compute_num_jobs"](SimpleNamespace())
    return int(jobs), None if threads is None else int(threads)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m builder.vllm_setup requirements --source DIR --cuda 13.0 [--extra NAME]... [--out FILE]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m builder.vllm_setup")
    parser.add_argument("action", choices=("requirements",))
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--cuda", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--extra", action="append", default=[], help="one of vLLM's extras (repeatable)")
    args = parser.parse_args(argv)
    try:
        found = requirements(args.source, args.cuda) + extras(args.source, args.extra)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    text = "\n".join(found) + "\n"
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
