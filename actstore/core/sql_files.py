"""The store's checked table files as a read-only file system that DuckDB reads Parquet through.

A store's :class:`~actstore.core.sql_session.SQLSession` (local stores) lets DuckDB read the table files
itself, so that its Parquet reader prunes row groups by their statistics, reads only the columns a
statement needs, and pushes a ``ORDER BY ... LIMIT`` (Top-N) bound into the scan as it runs: a page
of a statement that sorts 10^6 rows then decodes the texts of a few row groups instead of all of
them (pyarrow's dataset scan, which the store's other connections use, materialises every row of the
projected columns first).

DuckDB itself still has no file access: ``enable_external_access`` is off and the one allowed
"directory" is :data:`PROTOCOL` ``://``, a Python file system (:class:`CheckedFiles`, registered with
the database) that serves exactly the files the session has put on its list, each a table file whose
hash (XXH3 or SHA-256) and Parquet footer were checked before (the store's ``check_table_shards``), for reading only:
opening for writing, listing, making or removing anything is refused, and any other path (``..``,
another file of the store, the user's files) is "not found".  A store's tables become views of its
own database, ``read_parquet`` over these paths.
"""

from __future__ import annotations

import datetime
import io
import os
import threading
from collections.abc import Sequence
from typing import Any

import fsspec
import pyarrow as pa

PROTOCOL = "actstore-table"
PREFIX = PROTOCOL + "://"
GLOB_CHARACTERS = set("*?[]{}")


class _ReadOnlyFile(io.RawIOBase):
    """A local file opened for reading, its position kept per thread and read with ``pread``: DuckDB
    reads one open file from several threads (a seek, then a read, each a call into Python), which
    on one shared position would interleave and read the wrong bytes."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.name = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._size = os.fstat(self._fd).st_size
        self._at = threading.local()

    def _pos(self) -> int:
        return int(getattr(self._at, "pos", 0))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos(), io.SEEK_END: self._size}[whence]
        self._at.pos = max(0, base + offset)
        return int(self._at.pos)

    def tell(self) -> int:
        return self._pos()

    def read(self, size: int | None = -1) -> bytes:
        pos = self._pos()
        n = self._size - pos if size is None or size < 0 else size
        data = os.pread(self._fd, max(0, n), pos)
        self._at.pos = pos + len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise PermissionError("the store's table files are read-only")


class CheckedFiles(fsspec.AbstractFileSystem):
    """A read-only file system of the local files on its list (:meth:`allow`), addressed as
    ``actstore-table:///absolute/path``; nothing else exists on it."""

    protocol = PROTOCOL
    root_marker = "/"
    cachable = False  # one per database: fsspec would otherwise hand every caller the same instance
    auto_mkdir = False

    def __init__(self) -> None:
        super().__init__()
        self._allowed: set[str] = set()
        self._lock = threading.Lock()

    def allow(self, paths: Sequence[str]) -> None:
        """Put local files (absolute paths, each already checked) on the list."""
        with self._lock:
            self._allowed.update(os.fspath(p) for p in paths)

    def allowed(self, path: str) -> bool:
        return path in self._allowed

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = str(path)
        return text[len(PREFIX) :] if text.startswith(PREFIX) else text

    def _file(self, path: Any) -> str:
        p = self._strip_protocol(path)
        if not isinstance(p, str) or p not in self._allowed:
            raise FileNotFoundError(f"{PREFIX}{p}: not a checked table file of the store")
        return p

    # ---- reading
    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode != "rb":
            raise PermissionError(f"the store's table files are read-only (mode {mode!r})")
        return _ReadOnlyFile(self._file(path))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        p = self._file(path)
        st = os.stat(p)
        return {"name": p, "size": st.st_size, "type": "file", "mtime": st.st_mtime}

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._strip_protocol(path) in self._allowed

    def isfile(self, path: str) -> bool:
        return self.exists(path)

    def isdir(self, path: str) -> bool:
        return False

    def size(self, path: str) -> int:
        return int(self.info(path)["size"])

    def modified(self, path: str) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> list[str]:  # type: ignore[override]
        """A path on the list matches itself; no pattern matches anything (nothing is listed)."""
        p = self._strip_protocol(path)
        return [p] if isinstance(p, str) and p in self._allowed else []

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        return []

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        return {} if kwargs.get("detail") else []

    def walk(self, path: str, maxdepth: int | None = None, topdown: bool = True, **kwargs: Any) -> Any:
        return iter(())

    # ---- writing: refused
    mkdir = makedirs = rm = rm_file = rmdir = mv = cp_file = copy = touch = _refuse
    pipe = pipe_file = put = put_file = created = _refuse


def quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def readable(paths: Sequence[str]) -> bool:
    """Whether DuckDB can be given these paths as they are (a glob character would make one a pattern)."""
    return all(not (GLOB_CHARACTERS & set(p)) for p in paths)


def view_source(paths: Sequence[str], schemas: Sequence[pa.Schema]) -> str:
    """``read_parquet`` of a table's files (absolute local paths) on :class:`CheckedFiles`; columns that
    some files lack read as NULL (``union_by_name``, only when the files' schemas differ: it reads every
    footer when the view is bound)."""
    files = ", ".join(quote(PREFIX + p) for p in paths)
    same = all(s.equals(schemas[0]) for s in schemas[1:])
    return f"read_parquet([{files}]{'' if same else ', union_by_name = true'})"
