"""StoreLocation.read_if_regular: the one reader of small marker files (lock record, ``.creating``,
a manifest checked before it is trusted) that never blocks, never follows a link and never raises
for what it finds."""

from __future__ import annotations

import os
from pathlib import Path

from actstore.core.lock import LOCK_NAME, read_holder
from actstore.core.storage import locate


def test_only_a_small_regular_file_is_read(tmp_path: Path) -> None:
    loc = locate(tmp_path)
    (tmp_path / "small").write_bytes(b"x" * 10)
    (tmp_path / "large").write_bytes(b"x" * 11)
    os.symlink(tmp_path / "small", tmp_path / "link")
    os.mkfifo(tmp_path / "pipe")  # no writer: a blocking open would hang here
    (tmp_path / "dir").mkdir()
    assert loc.read_if_regular("small", 10) == b"x" * 10
    for rel in ("large", "link", "pipe", "dir", "missing"):
        assert loc.read_if_regular(rel, 10) is None, rel


def test_read_holder_ignores_what_is_not_a_lock_record(tmp_path: Path) -> None:
    assert read_holder(tmp_path) is None  # no lock file
    (tmp_path / LOCK_NAME).write_bytes(b'{"kind": "something else"}')
    assert read_holder(tmp_path) is None
    (tmp_path / LOCK_NAME).unlink()
    os.mkfifo(tmp_path / LOCK_NAME)
    assert read_holder(tmp_path) is None
