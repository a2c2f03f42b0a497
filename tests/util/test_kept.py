"""Results kept under the cache (sparkbuild/util/kept.py): read back as written, each folder held to
its newest entries (a read makes an entry newest again), and an entry that is not one is made again,
said, not trusted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkbuild.util import kept


def test_an_entry_reads_back_as_written_and_a_missing_one_is_none(tmp_path: Path) -> None:
    data = {"out": "line", "reports": [{"path": "/x/_C.abi3.so", "codes": ["sm_121a"]}]}
    kept.write(tmp_path, "k1", data)
    assert kept.read(tmp_path, "k1") == data
    assert kept.read(tmp_path, "k2") is None
    assert kept.read(tmp_path / "never-made", "k1") is None


def test_the_folder_keeps_its_newest_entries_a_read_one_counting_as_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept, "KEEP", 3)
    for i in range(3):
        path = kept.write(tmp_path, f"k{i}", i)
        os.utime(path, (1000 + i, 1000 + i))  # written in this order, a second apart
    assert kept.read(tmp_path, "k0") == 0  # read: the newest now
    kept.write(tmp_path, "k3", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k0.json.gz", "k2.json.gz", "k3.json.gz"]


def test_an_entry_that_is_not_one_is_made_again_and_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "k1.json.gz").write_text("{not gzip")
    assert kept.read(tmp_path, "k1") is None
    assert "k1.json.gz: not a kept result" in capsys.readouterr().err
