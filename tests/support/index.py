"""A PEP 503 package index served over HTTP on 127.0.0.1 from a folder: the downloads the tests make
go through a real HTTP server, never a mock (the files are put in by each test)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def loopback_index(root: Path) -> Iterator[str]:
    """Serve ``root`` on 127.0.0.1 until the block ends; its base URL (``http://127.0.0.1:PORT/``)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
