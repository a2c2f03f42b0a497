"""``python -m sparkbuild.models CACHE NAME RESULT``: make check model NAME into CACHE in this process.

Started by ``sparkbuild.models.making.run`` with the arithmetic pinned in the environment; not a command
for users (``sparkbuild model NAME`` is). A failure is written to RESULT for the parent to raise again.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sparkbuild.errors import FatalError
from sparkbuild.models import making, model
from sparkbuild.util import log


def main(argv: list[str]) -> int:
    cache, name, result = Path(argv[0]), argv[1], Path(argv[2])
    try:
        making.pin_torch()
        model.ensure_here(cache, name)
    except FatalError as exc:
        log.error(str(exc))
        making.report(result, exc)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
