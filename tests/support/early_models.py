"""Make the check models the suite serves, one after another, in a process of its own: the suite starts it
(tests/conftest.py) where its cache lacks some, so that a cold run makes them while its first tests build
images. Each making holds the model's lock (sparkbuild.models.model.ensure): a test that needs a model
meanwhile waits for it instead of making it again.

Usage: python -m tests.support.early_models CACHE NAME...
"""

from __future__ import annotations

import sys
from pathlib import Path

from sparkbuild.errors import FatalError
from sparkbuild.models import model


def main(argv: list[str]) -> int:
    cache, names = Path(argv[0]), argv[1:]
    failed = 0
    for name in names:
        try:
            model.ensure(cache, name)
        except FatalError as exc:
            # The test that needs it makes it again and fails with this error, where it belongs.
            print(f"model {name}: {exc}", file=sys.stderr, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
