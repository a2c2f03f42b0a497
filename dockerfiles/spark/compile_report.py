"""Every unit that failed in a compile log, with its first error (stdlib only; runs in the build
container after a failed compile, and on the host over the stage's build log).

Reads ninja's output as ``cmake --build`` prints it: a failing edge is ``FAILED: OUTPUTS``, then its
command, then the compiler's messages. Prints one ``sparkbuild-compile:`` line per failed unit, which
sparkbuild finds in the build log and puts in the stage's report.
"""

import json
import re
import shlex
import sys

MARK = "sparkbuild-compile:"
# BuildKit's plain progress puts "#12 345.6 " before each line of a RUN's output.
BUILDKIT = re.compile(r"^#\d+ \d+(?:\.\d+)? ")
PROGRESS = re.compile(r"^\[\d+/\d+\] ")
ERROR = re.compile(r"\berror\b", re.IGNORECASE)
SOURCE = re.compile(r"\.(cu|cpp|cc|cxx|c)$")


def _unit(outputs, command):
    """The source a failed edge compiled: the argument after -c, else its object's name."""
    try:
        args = shlex.split(command)
    except ValueError:
        args = command.split()
    for i, arg in enumerate(args[:-1]):
        if arg == "-c" and SOURCE.search(args[i + 1]):
            return args[i + 1]
    return re.sub(r"\.o(bj)?$", "", outputs.split()[0]) if outputs else "?"


def failures(lines):
    """[{"unit", "output", "error"}] in the order ninja reported them."""
    found, current, waiting_command = [], None, False
    for raw in lines:
        line = BUILDKIT.sub("", raw.rstrip("\n"))
        if line.startswith("FAILED: "):
            current = {"output": line[len("FAILED: ") :].strip(), "unit": "", "error": ""}
            found.append(current)
            waiting_command = True
        elif current is not None and waiting_command:
            current["unit"] = _unit(current["output"], line)
            waiting_command = False
        elif PROGRESS.match(line) or line.startswith("ninja: "):
            current = None
        elif current is not None and not current["error"] and ERROR.search(line):
            current["error"] = line.strip()[:400]
    return found


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: compile_report.py LOG")
    with open(sys.argv[1], encoding="utf-8", errors="replace") as log:
        found = failures(log)
    print(f"{MARK} {len(found)} unit(s) failed to compile")
    for f in found:
        print(f"{MARK} FAILED {f['unit']}: {f['error'] or '(no line with error; see the log)'}")
    print(f"{MARK} json {json.dumps(found)}")


if __name__ == "__main__":
    main()
