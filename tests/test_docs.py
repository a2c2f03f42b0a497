"""The documentation: a front-page README that links to docs/, and docs/ that builds as a site with
``mkdocs build --strict`` (a broken link, a missing anchor or a page left out of the navigation fails)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

README = ROOT / "README.md"


def test_the_docs_build_as_a_site_with_no_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= 150


def test_every_file_the_readme_links_to_exists() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []
