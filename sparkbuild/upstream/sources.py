"""Upstream source trees: vLLM sdists (and header-only wheels) from PyPI, checked against the index's
sha256 and cached.

PyPI's simple index (PEP 503) gives every file's sha256 in its link (``#sha256=...``); the JSON API is
not used, so a mirror that serves only the simple index works too (``SPARKBUILD_PYPI_SIMPLE``).
``requests`` is imported only where something is downloaded: a cached tree answers without it.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from sparkbuild.config import options
from sparkbuild.errors import ConfigError, SourceError
from sparkbuild.util import cmd, log
from sparkbuild.util.fsutil import glob_regex

DEFAULT_SIMPLE_INDEX = "https://pypi.org/simple/"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class IndexLink:
    filename: str
    url: str
    sha256: str


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.hrefs.append((data.strip(), self._href))
            self._href = None


def simple_index() -> str:
    return options.env("SPARKBUILD_PYPI_SIMPLE", DEFAULT_SIMPLE_INDEX).rstrip("/") + "/"


def index_links(project: str, index: str | None = None, suffix: str = "") -> dict[str, IndexLink]:
    """Every file of ``project`` in the simple index whose name ends with ``suffix``, with its sha256."""
    import requests

    page = urljoin(index or simple_index(), f"{project}/")
    log.info(f"+ GET {page}")
    try:
        response = requests.get(page, timeout=60, headers={"Accept": "text/html"})
        response.raise_for_status()
    except requests.RequestException as exc:
        raise SourceError(f"cannot read the package index {page}: {exc}. Check the network or SPARKBUILD_PYPI_SIMPLE.") from None
    parser = _Links()
    parser.feed(response.text)
    links: dict[str, IndexLink] = {}
    for text, href in parser.hrefs:
        url, fragment = urldefrag(urljoin(page, href))
        if not text.endswith(suffix) or not fragment.startswith("sha256="):
            continue
        links[text] = IndexLink(filename=text, url=url, sha256=fragment.removeprefix("sha256="))
    return links


def vllm_sdist(version: str, cache: Path) -> Path:
    """The unpacked vLLM ``version`` sdist under ``cache/sources``; downloads and checks it once.

    ``version`` may be written as its tag (``v0.33.0``), and must name one release exactly.
    """
    version = release_version(version)
    tree = cache / "sources" / f"vllm-{version}"
    stamp = tree / ".sparkbuild-unpacked"
    if stamp.is_file():
        return tree
    archive = fetch(sdist_link(version), cache / "sdists")
    _unpack(archive, tree, top=f"vllm-{version}", stamp=(stamp.name, archive.name + "\n"))
    return tree


def release_version(text: str) -> str:
    """``v0.33.0`` or ``0.33.0`` -> ``0.33.0``; what is not a version is an error."""
    version = text.strip().removeprefix("v")
    try:
        Version(version)
    except InvalidVersion:
        raise ConfigError(f"--vllm-version {text!r} is not a version (for example 0.33.0 or v0.33.0)") from None
    return version


def sdist_link(version: str, links: dict[str, IndexLink] | None = None) -> IndexLink:
    """The index's link to the sdist of exactly ``version``; the error says what there is instead:
    the releases a partial version (``0.33``) could mean, wheels only, or the nearest sdists."""
    links = index_links("vllm") if links is None else links
    filename = f"vllm-{version}.tar.gz"
    if filename in links:
        return links[filename]
    files = release_files(links)
    wanted = Version(version)
    if len(wanted.release) < 3:
        matching = sorted(v for v in files if v.release[: len(wanted.release)] == wanted.release and not v.is_prerelease)
        if matching:
            raise ConfigError(
                f"--vllm-version {version} names no single release; releases that match: {', '.join(map(str, matching))}"
            )
    if files.get(wanted) == {"wheel"}:
        raise SourceError(
            f"vLLM {version} has wheels on PyPI but no sdist, and sparkbuild patches source trees: "
            f"check out the tag v{version} from git and pass --source DIR."
        )
    near = sorted((n for n in links if n.startswith("vllm-") and n.endswith(".tar.gz")), key=lambda n: _distance(n, filename))
    rc = " Release candidates exist only as git tags: check one out and pass --source DIR." if wanted.is_prerelease else ""
    raise SourceError(f"PyPI has no sdist {filename}; nearest: {', '.join(near[:3]) or 'none'}.{rc}")


def release_files(links: dict[str, IndexLink]) -> dict[Version, set[str]]:
    """What the index has of each vLLM version: ``sdist``, ``wheel`` or both."""
    files: dict[Version, set[str]] = {}
    for name in links:
        try:
            if name.startswith("vllm-") and name.endswith(".tar.gz"):
                files.setdefault(Version(name.removeprefix("vllm-").removesuffix(".tar.gz")), set()).add("sdist")
            elif name.endswith(".whl"):
                files.setdefault(parse_wheel_filename(name)[1], set()).add("wheel")
        except (InvalidVersion, InvalidWheelFilename):
            continue  # a file whose name holds no version of its own: not a release of it
    return files


def fetch(link: IndexLink, folder: Path) -> Path:
    """``link`` downloaded into ``folder`` once; kept only when its sha256 matches the index.

    Prints one line per file with its size; on a terminal, a progress bar follows it.
    """
    import requests

    filename = link.filename
    target = folder / filename
    if target.is_file() and _sha256(target) == link.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    start = time.monotonic()
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, prefix=".part-") as part:
        try:
            with requests.get(link.url, stream=True, timeout=300) as response:
                response.raise_for_status()
                size = int(response.headers.get("Content-Length") or 0)
                log.info(f"+ GET {link.url} ({human_size(size) if size else 'size unknown'})")
                with _progress(filename, size) as advance:
                    for chunk in response.iter_content(_CHUNK):
                        digest.update(chunk)
                        part.write(chunk)
                        advance(len(chunk))
        except requests.RequestException as exc:
            Path(part.name).unlink()
            raise SourceError(f"download of {link.url} failed: {exc}") from None
    if digest.hexdigest() != link.sha256:
        Path(part.name).unlink()
        raise SourceError(
            f"{filename}: sha256 {digest.hexdigest()} does not match the index's {link.sha256}; "
            "the download is discarded. Retry; if it persists, the index or a proxy serves another file."
        )
    Path(part.name).replace(target)
    if sys.stderr.isatty():
        log.info(f"  {filename}: {human_size(target.stat().st_size)} in {log.format_seconds(time.monotonic() - start)}")
    return target


@contextmanager
def _progress(name: str, size: int) -> Iterator[Callable[[int], object]]:
    """A progress bar on a terminal (tqdm: rate, time left, the terminal's width); in a CI log,
    where bars turn into thousands of lines, nothing beyond the line ``fetch`` prints."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=size or None, desc=name, unit="B", unit_scale=True, unit_divisor=1024, leave=False) as bar:
        yield bar.update


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def wheel_tree(project: str, filename: str, cache: Path, only: str = "", suffix: str = "") -> Path:
    """The members of a PyPI wheel under ``only`` and ending with ``suffix`` (for example its C++
    headers, or its Python sources), unpacked once under ``cache/wheels``. The wheel itself is deleted
    afterwards: some (cuBLAS) are hundreds of MB."""
    tree = cache / "wheels" / (filename.removesuffix(".whl") + (f"-only{suffix}" if suffix else ""))
    stamp = tree / ".sparkbuild-unpacked"
    if stamp.is_file():
        return tree
    link = index_links(project, suffix=".whl").get(filename)
    if link is None:
        raise SourceError(f"PyPI has no {filename} for {project}; check the name on {simple_index()}{project}/")
    archive = fetch(link, cache / "downloads")
    with _staged(tree) as staging:
        with zipfile.ZipFile(archive) as wheel:
            members = [name for name in wheel.namelist() if name.startswith(only) and name.endswith(suffix)]
            if not members:
                raise SourceError(f"{filename} has nothing under {only!r} ending with {suffix!r}")
            # zipfile drops absolute and '..' parts of member names, so nothing lands outside staging.
            wheel.extractall(staging, members)  # noqa: S202
        (staging / stamp.name).write_text(f"{filename} {only} {suffix}\n", encoding="utf-8")
    archive.unlink()
    return tree


def _distance(name: str, wanted: str) -> int:
    numbers = [int(n) for n in re.findall(r"\d+", name)]
    goal = [int(n) for n in re.findall(r"\d+", wanted)]
    return sum(abs(a - b) * 1000 ** (3 - i) for i, (a, b) in enumerate(zip(numbers, goal, strict=False)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _unpack(archive: Path, tree: Path, top: str, stamp: tuple[str, str]) -> None:
    with _staged(tree, top) as staging:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        if not (staging / top / "CMakeLists.txt").is_file():
            raise SourceError(f"{archive}: no {top}/CMakeLists.txt inside; not a vLLM source archive")
        # The stamp is inside before the rename: a tree with a stamp is always whole.
        (staging / top / stamp[0]).write_text(stamp[1], encoding="utf-8")


def unpack_matching(archive: Path, tree: Path, top: str, patterns: tuple[str, ...]) -> int:
    """Only the members of ``archive`` under ``top/`` whose path below it matches one of ``patterns``
    (``*`` within a folder, ``**/`` any folders), unpacked as ``tree``; returns how many files."""
    wanted = re.compile("|".join(f"(?:{glob_regex(p)})" for p in patterns))
    count = 0
    # One pass over the stream ("r|*"): a compressed archive read by seeking is decompressed again
    # from its start for each seek back.
    with _staged(tree) as staging, tarfile.open(archive, "r|*") as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(f"{top}/") and wanted.fullmatch(member.name[len(top) + 1 :]):
                tar.extract(member, staging, filter="data")
                count += 1
        if not count:
            raise SourceError(f"{archive}: nothing under {top}/ matches {', '.join(patterns)}")
        for child in (staging / top).iterdir():
            child.rename(staging / child.name)
        (staging / top).rmdir()
    return count


@contextmanager
def _staged(tree: Path, top: str = "") -> Iterator[Path]:
    """A temporary folder next to ``tree`` whose ``top`` subfolder (default: itself) becomes ``tree``
    when the block succeeds, so a half-unpacked tree never exists; on failure ``tree`` is left as is."""
    tree.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=tree.parent, prefix=".unpack-"))
    aside: Path | None = None
    try:
        yield staging
        if tree.exists():
            # A half tree of an older sparkbuild, or one a concurrent run just finished: set it aside first.
            aside = Path(tempfile.mkdtemp(dir=tree.parent, prefix=".old-"))
            tree.rename(aside / tree.name)
        (staging / top).rename(tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def tree_version(tree: Path) -> str | None:
    """The vLLM version of a source tree: PKG-INFO for an sdist, else ``git describe`` of a checkout."""
    pkg_info = tree / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    if (tree / ".git").exists():
        described = cmd.run(["git", "-C", tree, "describe", "--tags", "--abbrev=0"], capture=True, check=False)
        if described.returncode == 0:
            return described.stdout.strip().removeprefix("v")
    return None


def project_sdist(project: str, version: str, cache: Path, marker: str) -> Path:
    """The unpacked sdist of any PyPI ``project`` at ``version`` (sha256 from the index), checked to
    contain ``marker``; downloaded and unpacked once under ``cache/sources``."""
    stem = f"{re.sub(r'[-_.]+', '_', project).lower()}-{version}"
    tree = cache / "sources" / stem
    stamp = tree / ".sparkbuild-unpacked"
    if stamp.is_file():
        return tree
    link = index_links(project, suffix=".tar.gz").get(f"{stem}.tar.gz")
    if link is None:
        raise SourceError(f"PyPI has no sdist {stem}.tar.gz of {project}; see {simple_index()}{project}/")
    archive = fetch(link, cache / "sdists")
    with _staged(tree, stem) as staging:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        if not (staging / stem / marker).exists():
            raise SourceError(f"{archive}: no {stem}/{marker} inside; not the {project} source it should be")
        (staging / stem / stamp.name).write_text(archive.name + "\n", encoding="utf-8")
    return tree
