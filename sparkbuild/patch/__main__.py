"""``python3 -m sparkbuild.patch check|apply``: the patch stage inside a container's source stage.

Needs only the standard library, PyYAML, packaging and git (no click, no Docker SDK, no requests),
so a source stage runs it from the copy ``sparkbuild.patch.bundle`` lists. ``sparkbuild patch`` is the
same for people.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparkbuild.errors import FatalError, PatchError
from sparkbuild.patch import engine, meta, scope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m sparkbuild.patch")
    parser.add_argument("action", choices=("check", "apply"))
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--version", required=True, help="vLLM version of the tree")
    parser.add_argument("--patches", type=Path, default=None)
    parser.add_argument("--patch", dest="names", action="append", default=[])
    parser.add_argument(
        "--installed",
        action="store_true",
        help="the tree is an unpacked wheel: a patch may change the vllm/ package's Python files only",
    )
    args = parser.parse_args(argv)
    try:
        report = engine.check(
            args.source,
            meta.load(meta.folders((args.patches,) if args.patches else meta.default_dirs()), tuple(args.names) or None),
            args.version,
        )
        print(engine.table(report), flush=True)
        if args.installed:
            scope.require_installed(report)
        if args.action == "apply":
            print(f"patched {len(engine.apply(report))} file(s); record in {args.source / engine.RECORD}", flush=True)
        elif not report.ok:
            raise PatchError("a patch conflicts with this tree (see above)")
    except FatalError as exc:  # a conflict and a broken patch folder alike: one line, its exit code
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
