"""Ctrl-C at any moment: a few calls must not be cut in half between starting something and
registering its cleanup (a container created but not yet in a ``try``, a registry process started).

``Held`` keeps SIGINT and SIGTERM back for such a call and hands them on right after, once the
cleanup is in place; a plain Ctrl-C elsewhere raises KeyboardInterrupt as usual.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)


class Held:
    """``with held: start()`` then, inside the ``try`` whose ``finally`` undoes it, ``held.deliver()``."""

    def __init__(self) -> None:
        self.caught: int | None = None
        self._saved: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.caught = signum

    def __enter__(self) -> Held:
        # Handlers can only be set from the main thread; elsewhere signals never arrive anyway.
        if threading.current_thread() is threading.main_thread():
            self._saved = {s: signal.signal(s, self._record) for s in HELD}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}
        if error is not None:
            self.deliver()  # the call failed: nothing to clean up, so stop now if asked to

    def deliver(self) -> None:
        """Raise the KeyboardInterrupt a held signal stands for."""
        if self.caught is not None:
            self.caught = None
            raise KeyboardInterrupt
