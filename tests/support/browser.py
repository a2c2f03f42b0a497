"""A real browser for the page tests: Debian's chromium (installed once per session by
``scripts/browser``), driven by Playwright through that executable. Where the browser cannot be had
(not root, no package archive), every such test skips with the script's own reason: never a
failure, never a silent pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.support import setup_script, workers

if TYPE_CHECKING:
    from playwright.sync_api import Browser


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of a chromium executable, or the test skips saying why."""
    ran, said = workers.once("browser", lambda: list(setup_script("browser")))  # one apt-get at a time
    if not ran:
        pytest.skip(f"no browser for the page tests: {said}")
    return str(said)


@pytest.fixture
def browser(chromium: str) -> Iterator[Browser]:
    """A headless chromium (Playwright's ``Browser``), closed after the test."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: the suite runs as root in CI, where chromium refuses its sandbox.
        launched = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()
