#!/bin/sh
# ninja, told to keep going past failing units (-k 0): vLLM's setup.py runs `cmake --build . -j N`,
# which stops at the first unit that fails, an hour into the compile, and names only that one.
# Given to CMake as CMAKE_MAKE_PROGRAM, so every unit that can compile does (ccache keeps them for
# the rerun) and compile_report.py names every one that failed.
exec ninja -k 0 "$@"
