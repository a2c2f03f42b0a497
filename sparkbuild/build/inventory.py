"""What a build made, file by file: an image's file system read from its tar stream, the wheels in it,
each ELF library's defined dynamic symbols, the installed packages.

Pure: it reads the streams and files it is given (``sparkbuild reproduce`` streams ``docker
export``), so two inventories are compared (``compare``) without Docker. A file is read once, as it
streams past, and kept as its size and sha256; only what the comparison reads again is kept whole:
the installers' records (``*.dist-info/METADATA`` and ``RECORD``, dpkg's ``status``) and the wheels
under ``/wheels`` (each spooled to a temporary file, read member by member, then dropped).
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import struct
import tarfile
import tempfile
import zipfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from sparkbuild.errors import BuildError

# Where the Spark stages put the wheels they make (``dockerfiles/spark/*``): a wheel there is one
# the build made; any other ``.whl`` in an image is compared as a file.
WHEEL_FOLDER = "wheels/"
ELF_MAGIC = b"\x7fELF"
ZIP_MAGIC = b"PK\x03\x04"
CHUNK = 1 << 20
# A wheel up to this size is read in memory; a larger one (vLLM's: hundreds of MB) spills to disk.
WHEEL_IN_MEMORY = 64 << 20
# Installer records larger than this are not kept (none comes near: torch's RECORD is about 2 MB).
RECORD_LIMIT = 64 << 20

_KINDS = {
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.CONTTYPE: "file",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}


@dataclass(frozen=True)
class Pyc:
    """A compiled Python file's header (PEP 552) and what follows it: ``flags`` 0 is a timestamp
    pyc (``stamp``: the source's mtime and size), 1 or 3 a hash pyc (``stamp``: the source's hash)."""

    flags: int
    stamp: str
    code_sha256: str

    @property
    def timestamped(self) -> bool:
        return self.flags == 0

    @classmethod
    def of(cls, head: bytes, code_sha256: str) -> Pyc | None:
        if len(head) < 16:
            return None
        (flags,) = struct.unpack_from("<I", head, 4)
        return cls(flags=flags, stamp=head[8:16].hex(), code_sha256=code_sha256)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One path of a file system as its tar stream has it. ``sha256`` and ``size`` of a hard link
    are its target's: a hard link is compared as the file it links to."""

    path: str
    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    mtime: float
    sha256: str | None = None
    link: str | None = None
    magic: bytes = b""
    pyc: Pyc | None = None

    @property
    def elf(self) -> bool:
        return self.magic.startswith(ELF_MAGIC)

    @property
    def compared_kind(self) -> str:
        return "file" if self.kind == "hardlink" else self.kind

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"kind": self.kind, "mode": oct(self.mode), "owner": f"{self.uid}:{self.gid}", "size": self.size}
        if self.sha256 is not None:
            found["sha256"] = self.sha256
        if self.link is not None:
            found["link"] = self.link
        return found


@dataclass(frozen=True)
class Symbols:
    """The defined symbols of an ELF file's dynamic symbol table (``nm -D --defined-only``'s names),
    sorted, and the sha256 of their lines: one hash per library, as timothystewart6/vllm-gb10 compares."""

    names: tuple[str, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256("\n".join(self.names).encode()).hexdigest()


def elf_symbols(stream: IO[bytes]) -> Symbols | None:
    """The defined dynamic symbols of the ELF file ``stream`` (seekable); None where it is not an ELF
    file pyelftools can read (its bytes are still compared). pyelftools reads the table (the library
    check-binary already uses); an ELF file without a dynamic symbol table (an object, a static
    executable) has an empty one."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    try:
        table = ELFFile(stream).get_section_by_name(".dynsym")
        if not isinstance(table, SymbolTableSection):
            return Symbols(())
        names = {s.name for s in table.iter_symbols() if s.name and s["st_shndx"] != "SHN_UNDEF"}
    except (ELFError, struct.error, ValueError):
        return None
    return Symbols(tuple(sorted(names)))


def elf_sections(stream: IO[bytes], wanted: Collection[str] | None = None) -> dict[str, bytes]:
    """The bytes of each section of the ELF file ``stream`` (those named in ``wanted``, else all) by
    name (none for a section that has none in the file, like ``.bss``); empty where pyelftools cannot
    read it."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    found: dict[str, bytes] = {}
    try:
        for section in ELFFile(stream).iter_sections():
            name = section.name or f"#{len(found)}"
            if wanted is None or name in wanted:
                found[name] = b"" if section["sh_type"] == "SHT_NOBITS" else section.data()
    except (ELFError, struct.error, ValueError):
        return {}
    return found


@dataclass(frozen=True, kw_only=True)
class Member:
    """One member of a wheel (a zip): its size, sha256, the time the zip records for it, and for an
    ELF member its defined dynamic symbols."""

    name: str
    size: int
    sha256: str
    date_time: tuple[int, int, int, int, int, int]
    symbols: Symbols | None = None

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "size": self.size,
            "sha256": self.sha256,
            "date_time": "{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}".format(*self.date_time),
        }
        if self.symbols is not None:
            found["symbols"] = len(self.symbols.names)
            found["symbols_sha256"] = self.symbols.sha256
        return found


@dataclass(frozen=True, kw_only=True)
class Wheel:
    path: str
    sha256: str
    members: dict[str, Member]


def read_wheel(path: str, sha256: str, stream: IO[bytes]) -> Wheel:
    """Every member of the wheel ``stream`` (seekable), ELF members with their symbols."""
    try:
        archive = zipfile.ZipFile(stream)
    except zipfile.BadZipFile as exc:
        raise BuildError(f"{path}: not a wheel ({exc}); the build left a broken file in /wheels") from None
    members: dict[str, Member] = {}
    with archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            digest, symbols = _member(archive, info)
            members[info.filename] = Member(
                name=info.filename, size=info.file_size, sha256=digest, date_time=info.date_time, symbols=symbols
            )
    return Wheel(path=path, sha256=sha256, members=members)


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[str, Symbols | None]:
    """A member's sha256, and its symbols where it is ELF (read from a spooled copy: ELF is read by seeking)."""
    with archive.open(info) as data:
        head = data.read(4)
        if head != ELF_MAGIC:
            hashed = hashlib.sha256(head)
            for chunk in iter(lambda: data.read(CHUNK), b""):
                hashed.update(chunk)
            return hashed.hexdigest(), None
    with archive.open(info) as data, tempfile.SpooledTemporaryFile(max_size=WHEEL_IN_MEMORY) as copy:
        digest = _copy_hashing(data, copy)
        copy.seek(0)
        return digest, elf_symbols(copy)


def _copy_hashing(source: IO[bytes], sink: IO[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: source.read(CHUNK), b""):
        digest.update(chunk)
        sink.write(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True)
class Package:
    """An installed package: a Python distribution (its ``.dist-info`` folder, where its RECORD
    lists each installed file's hash) or a Debian package (dpkg's status)."""

    key: str
    name: str
    version: str
    where: str
    record: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "where": self.where}


@dataclass(kw_only=True)
class Inventory:
    """A file system: every path's entry, the installer records kept whole, the wheels under /wheels."""

    entries: dict[str, Entry] = field(default_factory=dict)
    records: dict[str, bytes] = field(default_factory=dict)
    wheels: dict[str, Wheel] = field(default_factory=dict)

    def packages(self) -> dict[str, Package]:
        """Every installed Python distribution and Debian package, by key (``python:SITE/NAME``, ``deb:NAME:ARCH``)."""
        found: dict[str, Package] = {}
        for path, data in sorted(self.records.items()):
            if path.endswith(".dist-info/METADATA"):
                package = _python_package(path, data, self.records.get(path.removesuffix("METADATA") + "RECORD", b""))
                if package is not None:
                    found[package.key] = package
            elif path == DPKG_STATUS:
                found.update(_debian_packages(data))
        return found


DPKG_STATUS = "var/lib/dpkg/status"


def kept(path: str) -> bool:
    """What the inventory keeps whole: the installers' records."""
    return path == DPKG_STATUS or path.endswith((".dist-info/METADATA", ".dist-info/RECORD"))


def normal(name: str) -> str:
    """A tar member's name as a path of the file system, without ``./`` or ``/`` around it."""
    name = name.removeprefix("./").strip("/")
    return name or "."


def read_tar(stream: IO[bytes], skip: Collection[str] = ()) -> Inventory:
    """The inventory of a file system's tar stream, read once, front to back (``r|``: no seeking);
    the paths of ``skip`` (not what is under them) are left out."""
    inventory = Inventory()
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if normal(member.name) not in skip:
                    _add(inventory, tar, member)
    except tarfile.TarError as exc:
        raise BuildError(f"the file system's tar stream could not be read: {exc}") from None
    return inventory


def _add(inventory: Inventory, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
    path = normal(member.name)
    kind = _KINDS.get(member.type, "other")
    sha256, size, magic, pyc, link = None, member.size, b"", None, None
    if member.issym():
        link = member.linkname
    elif member.islnk():
        link = normal(member.linkname)
        target = inventory.entries.get(link)
        if target is not None:
            sha256, size, magic, pyc = target.sha256, target.size, target.magic, target.pyc
    elif member.isfile():
        data = tar.extractfile(member)
        assert data is not None  # a regular file always has data
        sha256, magic, pyc = _read_file(inventory, path, data, member.size)
    inventory.entries[path] = Entry(
        path=path,
        kind=kind,
        mode=member.mode,
        uid=member.uid,
        gid=member.gid,
        size=size,
        mtime=float(member.mtime),
        sha256=sha256,
        link=link,
        magic=magic,
        pyc=pyc,
    )


def _read_file(inventory: Inventory, path: str, data: IO[bytes], size: int) -> tuple[str, bytes, Pyc | None]:
    """Hash a file as it streams past; keep what the comparison reads again (records, wheels)."""
    wheel = path.startswith(WHEEL_FOLDER) and path.endswith(".whl")
    head = data.read(16)
    digest = hashlib.sha256(head)
    # A .pyc's code after its 16-byte header, hashed apart: the header alone may differ.
    code = hashlib.sha256() if path.endswith(".pyc") else None
    if not (wheel or (kept(path) and size <= RECORD_LIMIT)):
        for chunk in _chunks(data):
            digest.update(chunk)
            if code is not None:
                code.update(chunk)
        return digest.hexdigest(), head[:4], None if code is None else Pyc.of(head, code.hexdigest())
    with tempfile.SpooledTemporaryFile(max_size=WHEEL_IN_MEMORY) as copy:
        copy.write(head)
        for chunk in _chunks(data):
            digest.update(chunk)
            copy.write(chunk)
        sha256 = digest.hexdigest()
        copy.seek(0)
        if wheel:
            inventory.wheels[path] = read_wheel(path, sha256, copy)
        else:
            inventory.records[path] = copy.read()
    return sha256, head[:4], None


def _chunks(data: IO[bytes]) -> Iterator[bytes]:
    yield from iter(lambda: data.read(CHUNK), b"")


def _python_package(path: str, metadata: bytes, record: bytes) -> Package | None:
    """A distribution from its METADATA's Name and Version headers and its RECORD's lines."""
    headers = metadata.split(b"\n\n", 1)[0].decode("utf-8", errors="replace")
    name = re.search(r"^Name:\s*(.+?)\s*$", headers, re.MULTILINE)
    version = re.search(r"^Version:\s*(.+?)\s*$", headers, re.MULTILINE)
    if name is None or version is None:
        return None
    site = path.rsplit("/", 2)[0]
    canonical = re.sub(r"[-_.]+", "-", name[1]).lower()
    rows = csv.reader(io.StringIO(record.decode("utf-8", errors="replace")))
    files = {row[0]: ",".join(row[1:]) for row in rows if row}
    return Package(key=f"python:{site}/{canonical}", name=name[1], version=version[1], where=site, record=files)


def _debian_packages(status: bytes) -> dict[str, Package]:
    """Each package dpkg's status file says is installed."""
    found: dict[str, Package] = {}
    for paragraph in status.decode("utf-8", errors="replace").split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", paragraph, re.MULTILINE))
        if "Package" not in fields or not fields.get("Status", "").endswith(" installed"):
            continue
        arch = fields.get("Architecture", "all")
        key = f"deb:{fields['Package']}:{arch}"
        found[key] = Package(key=key, name=f"{fields['Package']}:{arch}", version=fields.get("Version", ""), where="dpkg")
    return found
