"""The read-only file system DuckDB reads a store's checked table files through
(actstore.core.sql_files): only the files on its list exist, for reading only, and threads sharing
one open file each read at their own position (DuckDB's threads do: with one shared position a seek
and a read of two threads interleaved and read the wrong bytes)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from actstore.core.sql_files import PREFIX, CheckedFiles


@pytest.fixture()
def files(tmp_path: Path) -> tuple[CheckedFiles, Path, Path]:
    listed = tmp_path / "listed.bin"
    listed.write_bytes(os.urandom(1 << 20))
    other = tmp_path / "other.txt"
    other.write_text("not on the list\n")
    fs = CheckedFiles()
    fs.allow([str(listed)])
    return fs, listed, other


def test_only_listed_files_exist_and_only_for_reading(files: tuple[CheckedFiles, Path, Path]) -> None:
    fs, listed, other = files
    data = listed.read_bytes()
    with fs.open(PREFIX + str(listed), "rb") as f:
        assert f.read() == data
    assert fs.info(PREFIX + str(listed))["size"] == len(data) == fs.size(str(listed))
    assert fs.exists(PREFIX + str(listed)) and fs.glob(PREFIX + str(listed)) == [str(listed)]
    for path in (str(other), str(listed.parent / ".." / listed.parent.name / listed.name), str(listed) + "*"):
        assert not fs.exists(PREFIX + path) and fs.glob(PREFIX + path) == []
        with pytest.raises(FileNotFoundError):
            fs.open(PREFIX + path, "rb")
    assert fs.ls(PREFIX + str(listed.parent)) == [] and fs.find(PREFIX + str(listed.parent)) == []
    for mode in ("wb", "ab", "r+b"):
        with pytest.raises(PermissionError):
            fs.open(PREFIX + str(listed), mode)
    for write in (fs.rm, fs.mkdir, fs.touch, fs.rm_file):
        with pytest.raises(PermissionError):
            write(PREFIX + str(listed))
    with pytest.raises(PermissionError):
        fs.mv(PREFIX + str(listed), PREFIX + str(other))
    assert listed.read_bytes() == data and other.read_text() == "not on the list\n"


def test_threads_sharing_one_open_file_read_at_their_own_positions(
    files: tuple[CheckedFiles, Path, Path],
) -> None:
    fs, listed, _ = files
    data = listed.read_bytes()
    f = fs.open(PREFIX + str(listed), "rb")
    errors: list[int] = []
    start = threading.Barrier(4)

    def work(k: int) -> None:
        start.wait()
        for i in range(400):
            at = (k * 7919 + i * 104_729) % (len(data) - 4096)
            f.seek(at)
            time.sleep(0)  # another thread runs here, as between DuckDB's two calls (a seek, a read)
            if f.tell() != at or f.read(4096) != data[at : at + 4096] or f.tell() != at + 4096:
                errors.append(at)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.seek(-10, os.SEEK_END)
    assert f.read() == data[-10:] and f.read(5) == b""
    f.close()
    assert errors == []
