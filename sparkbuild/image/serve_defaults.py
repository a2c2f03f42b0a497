"""The image's entrypoint: ``vllm serve`` with the user's arguments, plus each serving default the
user did not give.

``ENTRYPOINT ["vllm", "serve"]`` with the defaults in ``CMD`` loses every default as soon as a user
names a model (``docker run IMAGE MODEL``). Here a default is added unless the user's arguments
already set that option, in any spelling vLLM accepts: ``--max-model-len 4096``,
``--max-model-len=4096``, ``--max_model_len``, and for the compilation config also ``-cc`` and
dotted forms (``--compilation-config.cudagraph_capture_sizes``). ``-O`` is vLLM's optimization level
(``--optimization-level``, from 0.19 at least), not the compilation config.

The CUDA graph sizes follow the ``--max-num-seqs`` in effect: vLLM's own sizes for it, plus the
extra sizes the image names (5 and 10 on the Spark: a public report measured the padding dip at
those concurrencies). A fixed list would cap the graphs at the image's default batch when a user asks
for ``--max-num-seqs 256``. They step aside for every option with which the user sizes the graphs
or changes how vLLM sizes them (``SIZES_GRAPHS``): the user's options win, and vLLM never sees two
that it refuses together.

Standard library only; runs in the image as ``python3 serve_defaults.py DEFAULTS.json CMD... ARGS``,
where DEFAULTS.json is ``{"args": [...], "cudagraph_extra_sizes": [...]}`` (or a list of args).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

# The README's exit code for invalid input (this script runs in the image, without builder.errors).
USAGE = 2
# Short spellings vLLM's argument parser accepts for an option.
ALIASES = {
    "-O": "--optimization-level",
    "-cc": "--compilation-config",
    "-sc": "--speculative-config",
    "-tp": "--tensor-parallel-size",
}
# The user's options that size the CUDA graphs, or change how vLLM sizes them: with any of them given,
# the image adds no graph sizes. vLLM 0.32 and 0.33 refuse --cudagraph-capture-sizes and
# --max-cudagraph-capture-size beside a compilation config that sets the same field ("... are mutually
# exclusive", vllm/engine/arg_utils.py); speculative decoding sizes vLLM's graphs by the tokens a step
# decodes, and --performance-mode interactivity captures every size up to 32 (vllm/config/vllm.py).
SIZES_GRAPHS = frozenset(
    {
        "--compilation-config",
        "--cudagraph-capture-sizes",
        "--max-cudagraph-capture-size",
        "--speculative-config",
        "--spec-method",
        "--spec-model",
        "--spec-tokens",
        "--performance-mode",
    }
)
# vLLM's default ceiling of the CUDA graph sizes off data-center Blackwell (GB10 is SM121).
MAX_GRAPH_SIZE = 512


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


def drop_option(args: list[str], name: str) -> list[str]:
    """``args`` without the ``name`` option and its values."""
    out: list[str] = []
    skipping = False
    for arg in args:
        option = option_name(arg)
        if option is not None:
            skipping = option == name
        if not skipping:
            out.append(arg)
    return out


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


def vllm_capture_sizes(max_num_seqs: int) -> list[int]:
    """The CUDA graph sizes vLLM captures by default for ``max_num_seqs`` without speculative
    decoding: ``[1, 2, 4]``, multiples of 8 below 256, multiples of 16 from 256, up to
    ``min(2 * max_num_seqs, 512)`` (vLLM 0.33's ``VllmConfig._set_cudagraph_sizes``)."""
    ceiling = min(2 * max_num_seqs, MAX_GRAPH_SIZE)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_GRAPH_SIZE + 1, 16)]
    return [s for s in grid if s <= ceiling]


def capture_sizes(max_num_seqs: int, extra: list[int]) -> list[int]:
    """vLLM's sizes for ``max_num_seqs`` and the ``extra`` ones below their largest."""
    sizes = vllm_capture_sizes(max_num_seqs)
    return sorted({*sizes, *(s for s in extra if s <= sizes[-1])})


def value_of(args: list[str], name: str) -> str | None:
    """The value the last ``name`` option in ``args`` sets (``--opt V`` or ``--opt=V``), if any."""
    found = None
    for i, arg in enumerate(args):
        if option_name(arg) != name:
            continue
        if "=" in arg:
            found = arg.split("=", 1)[1]
        elif i + 1 < len(args):
            found = args[i + 1]
    return found


def with_graph_sizes(args: list[str], user: list[str], extra: list[int]) -> list[str]:
    """``args`` plus a compilation config whose graph sizes follow the ``--max-num-seqs`` in ``args``,
    unless the user gave an option that sizes the graphs (``SIZES_GRAPHS``) or no max_num_seqs is known."""
    seqs = value_of(args, "--max-num-seqs")
    if not extra or given(user) & SIZES_GRAPHS or seqs is None or not seqs.isdigit():
        return args
    sizes = capture_sizes(int(seqs), extra)
    return [*args, "--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]


def read_defaults(path: Path) -> tuple[list[str], list[int]]:
    """The default arguments and extra graph sizes of ``path`` (none when it is absent)."""
    if not path.is_file():
        return [], []
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, list):
        return [str(a) for a in data], []
    return [str(a) for a in data.get("args", [])], [int(s) for s in data.get("cudagraph_extra_sizes", [])]


# What vLLM's shared-memory message queues between its processes take in /dev/shm (seen: 160 to 240
# MiB with vLLM 0.32); Docker gives a container 64 MiB unless told otherwise.
SHM_NEEDED_MIB = 256


def shm_warning(path: Path = Path("/dev/shm")) -> str | None:  # noqa: S108 - the shared memory vLLM uses, read only
    """A warning, at once, where /dev/shm is too small for vLLM: else it fails minutes later, when its
    engine starts, with "Insufficient space in /dev/shm"."""
    if not path.is_dir():
        return None
    free = shutil.disk_usage(path).free >> 20
    if free >= SHM_NEEDED_MIB:
        return None
    return (
        f"WARNING: /dev/shm has {free} MiB free; vLLM's engine needs about {SHM_NEEDED_MIB} MiB there and will fail "
        "to start: run the container with --ipc=host (as `sparkbuild run` does) or --shm-size 1g"
    )


def command(defaults_file: Path, program: list[str], user: list[str]) -> list[str]:
    """``program`` (``vllm serve``) with the ``user``'s arguments and the defaults of ``defaults_file``
    they leave: what the entrypoint runs."""
    defaults, extra = read_defaults(defaults_file)
    # The image's own graph sizes are replaced by ones that follow the max_num_seqs in effect.
    without_graphs = drop_option(defaults, "--compilation-config") if extra else defaults
    return [*program, *with_graph_sizes(merge(without_graphs, user), user, extra)]


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        print("usage: serve_defaults.py DEFAULTS.json COMMAND... [ARGS...]", file=sys.stderr)
        sys.exit(USAGE)
    # The command is "vllm serve"; everything after it is the user's.
    full = command(Path(argv[0]), argv[1:3], argv[3:])
    warning = shm_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print("+ " + " ".join(full), file=sys.stderr, flush=True)
    os.execvp(full[0], full)  # noqa: S606 - the image's own server, with the user's arguments as a list


if __name__ == "__main__":
    main(sys.argv[1:])
