"""The image's entrypoint: ``vllm serve`` with the user's arguments, plus each serving default the
user did not give.

``ENTRYPOINT ["vllm", "serve"]`` with the defaults in ``CMD`` loses every default as soon as a user
names a model (``docker run IMAGE MODEL``). Here a default is added unless the user's arguments
already set that option, in any spelling vLLM accepts: ``--max-model-len 4096``,
``--max-model-len=4096``, ``--max_model_len``, and for the compilation config also ``-O`` /
``-cc`` and dotted forms (``--compilation-config.cudagraph_capture_sizes``).

Standard library only; runs in the image as ``python3 serve_defaults.py DEFAULTS.json CMD... -- ARGS``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The README's exit code for invalid input (this script runs in the image, without builder.errors).
USAGE = 2
# Short spellings vLLM's argument parser accepts for an option.
ALIASES = {"-O": "--compilation-config", "-cc": "--compilation-config", "-tp": "--tensor-parallel-size"}


def option_name(arg: str) -> str | None:
    """The canonical ``--long-name`` an argument sets, or None for a value or a positional."""
    if not arg.startswith("-") or arg == "-" or _is_number(arg):
        return None
    for short, long in ALIASES.items():
        if arg == short or (arg.startswith(short) and not arg.startswith("--")):
            return long
    name = arg.split("=", 1)[0].split(".", 1)[0]
    return "--" + name.lstrip("-").replace("_", "-")


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def given(args: list[str]) -> set[str]:
    return {name for arg in args if (name := option_name(arg)) is not None}


def merge(defaults: list[str], args: list[str]) -> list[str]:
    """``args`` followed by every default option (with its values) whose name ``args`` does not set."""
    chosen = given(args)
    out = list(args)
    i = 0
    while i < len(defaults):
        name = option_name(defaults[i])
        j = i + 1
        while j < len(defaults) and option_name(defaults[j]) is None:
            j += 1
        if name is not None and name not in chosen:
            out += defaults[i:j]
        i = j
    return out


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        print("usage: serve_defaults.py DEFAULTS.json COMMAND... [ARGS...]", file=sys.stderr)
        sys.exit(USAGE)
    defaults_file, command = Path(argv[0]), argv[1:]
    defaults: list[str] = json.loads(defaults_file.read_text(encoding="utf-8")) if defaults_file.is_file() else []
    # The command is "vllm serve"; everything after it is the user's.
    program, user = command[:2], command[2:]
    full = [*program, *merge(defaults, user)]
    print("+ " + " ".join(full), file=sys.stderr, flush=True)
    os.execvp(full[0], full)  # noqa: S606 - the image's own server, with the user's arguments as a list


if __name__ == "__main__":
    main(sys.argv[1:])
