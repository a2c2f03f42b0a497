"""``sparkbuild patch`` for people: versions written as tags or half-written, misspelt patch names,
releases with wheels only, and what a download prints on a terminal and in a CI log.

The index is PyPI's own, except for the download tests, which serve a real PEP 503 index over
HTTP on 127.0.0.1 (a wrong hash cannot be had from PyPI, and a small file keeps the test fast).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkbuild.errors import SourceError
from sparkbuild.upstream import sources
from tests.support import cli
from tests.support.index import loopback_index
from tests.support.trees import TreeFactory


def sparkbuild(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli.run(*args, env=env)


def test_a_version_written_as_its_tag_is_the_release(pristine: TreeFactory) -> None:
    """v0.33.0 and 0.33.0 name the same release (the tree comes from the cache once downloaded)."""
    plain = json.loads(sparkbuild("patch", "check", "--vllm-version", "0.33.0", "--json").stdout)
    tagged = sparkbuild("patch", "check", "--vllm-version", "v0.33.0", "--json")
    assert tagged.returncode == 0, tagged.stderr
    assert json.loads(tagged.stdout) == plain
    assert plain["version"] == "0.33.0"


def test_a_half_written_version_lists_the_releases_it_could_mean() -> None:
    done = sparkbuild("patch", "check", "--vllm-version", "0.33")
    assert done.returncode == 2, done.stderr
    assert "--vllm-version 0.33 names no single release; releases that match: 0.33.0" in done.stderr
    # Three parts name one release, even where a longer one starts the same (0.10.1.1).
    assert sources.sdist_link("0.10.1").filename == "vllm-0.10.1.tar.gz"


def test_an_unknown_patch_name_suggests_the_near_one() -> None:
    done = sparkbuild("patch", "check", "--vllm-version", "0.33.0", "--patch", "e2m1")
    assert done.returncode == 2, done.stderr
    assert "unknown patch 'e2m1'" in done.stderr and "Perhaps you meant 'e2m1-software'?" in done.stderr
    done = sparkbuild("patch", "check", "--vllm-version", "0.33.0", "--patch", "cmake-arch-sm12")
    assert "Perhaps you meant 'cmake-arch-sm121'?" in done.stderr


def test_a_release_with_wheels_only_says_so() -> None:
    done = sparkbuild("patch", "check", "--vllm-version", "0.15.0")
    assert done.returncode == 10, done.stderr
    assert "vLLM 0.15.0 has wheels on PyPI but no sdist" in done.stderr
    assert "check out the tag v0.15.0 from git and pass --source DIR" in done.stderr
    assert "Release candidates" not in done.stderr


def test_a_release_candidate_points_at_git() -> None:
    done = sparkbuild("patch", "check", "--vllm-version", "0.34.0rc1")
    assert done.returncode == 10, done.stderr
    assert "Release candidates exist only as git tags" in done.stderr


# --- downloads from a real HTTP index on loopback -------------------------------------------------


@pytest.fixture
def local_index(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A PEP 503 index served over HTTP on 127.0.0.1 from a folder (the files are put in by the test)."""
    root = tmp_path / "index"
    (root / "vllm").mkdir(parents=True)

    with loopback_index(root) as url:
        yield url, root


def serve(root: Path, name: str, data: bytes, sha256: str | None = None) -> None:
    (root / "vllm" / name).write_bytes(data)
    digest = sha256 or hashlib.sha256(data).hexdigest()
    (root / "vllm" / "index.html").write_text(f'<a href="{name}#sha256={digest}">{name}</a>')


def test_download_with_wrong_sha256_is_refused_and_discarded(
    local_index: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, root = local_index
    wrong = "0" * 64
    serve(root, "vllm-9.9.9.tar.gz", b"not the file the index promised", sha256=wrong)
    monkeypatch.setenv("SPARKBUILD_PYPI_SIMPLE", url)
    cache = tmp_path / "cache"
    with pytest.raises(SourceError, match=f"does not match the index's {wrong}; the download is discarded"):
        sources.vllm_sdist("9.9.9", cache)
    assert list((cache / "sdists").iterdir()) == []
    with pytest.raises(SourceError, match=r"PyPI has no sdist vllm-9\.9\.8\.tar\.gz; nearest: vllm-9\.9\.9\.tar\.gz"):
        sources.vllm_sdist("9.9.8", cache)


FETCH = (
    f"import {sources.__name__} as sources; from pathlib import Path; import sys; "
    "sources.fetch(sources.sdist_link('9.9.9'), Path(sys.argv[1]))"
)


def test_a_download_in_a_ci_log_is_one_line_with_its_size(local_index: tuple[str, Path], tmp_path: Path) -> None:
    url, root = local_index
    serve(root, "vllm-9.9.9.tar.gz", os.urandom(3 * 1024 * 1024))
    env = {**os.environ, "SPARKBUILD_PYPI_SIMPLE": url}
    done = subprocess.run([sys.executable, "-c", FETCH, str(tmp_path / "cache")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "vllm-9.9.9" in line] == [f"+ GET {url}vllm/vllm-9.9.9.tar.gz (3.0 MiB)"]
    assert "\r" not in done.stderr and "%|" not in done.stderr


def test_a_download_on_a_terminal_shows_a_progress_bar(local_index: tuple[str, Path], tmp_path: Path) -> None:
    url, root = local_index
    serve(root, "vllm-9.9.9.tar.gz", os.urandom(3 * 1024 * 1024))
    env = {**os.environ, "SPARKBUILD_PYPI_SIMPLE": url}
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen([sys.executable, "-c", FETCH, str(tmp_path / "cache")], stderr=follower, env=env)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closes with the process
            break
        if not chunk:
            break
        output += chunk
    proc.wait()
    os.close(leader)
    text = output.decode(errors="replace")
    assert "(3.0 MiB)" in text
    assert "vllm-9.9.9.tar.gz" in text and "%|" in text, text  # tqdm's bar: name, percentage, bar
