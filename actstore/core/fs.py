"""Reading local files safely: only regular files, never blocking, never larger than allowed.

A store may be handed to actstore by someone else, so a path inside it may be a named pipe (an open
would block), a device or a directory, or a file far larger than it should be.  These helpers open a
file non-blocking, check its type and size on the open descriptor, and read it in blocks.  The local
backend (:mod:`actstore.core.storage.local`) reads through them, as do the readers that open a local
store's files themselves (:mod:`actstore.core.chunks`, :mod:`actstore.core.store_tables`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import xxhash

from actstore.core.errors import CorruptStoreError


def open_regular_file(path: str, max_bytes: int | None) -> tuple[int, os.stat_result]:
    """A read-only descriptor of a local regular file and its ``fstat``; anything but a regular file
    (checked on the open descriptor, which ``O_NONBLOCK`` lets us get even for a named pipe without a
    writer) and, with ``max_bytes``, a file larger than that are refused.  The caller closes it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStoreError(
                f"{path}: not a regular file ({_file_kind(st.st_mode)}); refusing to read it"
            )
        if max_bytes is not None and st.st_size > max_bytes:
            raise CorruptStoreError(
                f"{path}: {st.st_size} bytes, more than the {max_bytes} such a file may have; "
                "refusing to read it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


@contextmanager
def checked_local_file(path: str, max_bytes: int | None, where: str) -> Iterator[BinaryIO]:
    """A local regular file (checked as by :func:`open_regular_file`) opened for reading, unbuffered;
    missing is a :class:`CorruptStoreError` naming ``where``."""
    try:
        fd, _ = open_regular_file(path, max_bytes)
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptStoreError(f"{where}: missing") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        yield f  # type: ignore[misc]


def file_hash(f: BinaryIO, algorithm: str, block: int = 1 << 20) -> str:
    """The ``algorithm`` (``"sha256"`` or ``"xxh3"``: XXH3-128) hex digest of what remains of ``f``, read
    in blocks into one reused buffer (a whole-file read of a large table allocated and faulted in all
    of it: about 30% more CPU)."""
    if algorithm not in ("sha256", "xxh3"):
        raise ValueError(f"unknown hash {algorithm!r}")
    digest: Any = hashlib.sha256() if algorithm == "sha256" else xxhash.xxh3_128()
    buf = bytearray(block)
    view = memoryview(buf)
    while n := f.readinto(buf):  # type: ignore[attr-defined]
        digest.update(view[:n])
    return digest.hexdigest()


def pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    """Exactly ``n`` bytes at ``offset`` of an open file (a file that ends sooner is an error)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            raise CorruptStoreError(
                f"{path}: ends at {offset + got} bytes, {n - got} short of what its index says"
            )
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_local_file(path: str, max_bytes: int | None) -> bytes:
    """A local file's bytes, refusing anything but a regular file and, with ``max_bytes``, a file
    larger than that (:func:`open_regular_file`)."""
    fd, st = open_regular_file(path, max_bytes)
    size = int(st.st_size)
    try:  # plain descriptor reads: a query may read many chunk files
        # read at most one byte past the size seen (never reserve a max_bytes buffer: 8 GiB limits exist)
        want = size + 1 if max_bytes is None else min(size, max_bytes) + 1
        parts = [os.read(fd, want)]
        got = len(parts[0])
        while parts[-1] and (max_bytes is None or got <= max_bytes):  # short reads, or a file that grew
            step = max(want - got, 1 << 16)  # (never the whole max_bytes at once: os.read reserves it)
            parts.append(os.read(fd, step if max_bytes is None else min(step, max_bytes + 1 - got)))
            got += len(parts[-1])
        data = parts[0] if len(parts) == 2 and not parts[1] else b"".join(parts)
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:  # grew while we read it
        raise CorruptStoreError(f"{path}: more than {max_bytes} bytes; refusing to read it")
    return data


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def check_regular_file(path: str, max_bytes: int | None = None) -> None:
    """Refuse (:class:`CorruptStoreError`) a path that exists and is not a regular file (a named pipe
    would block the reader that opens it) or, with ``max_bytes``, is larger than that; a missing
    path passes (the caller handles it)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(st.st_mode):
        raise CorruptStoreError(f"{path}: not a regular file ({_file_kind(st.st_mode)}); refusing to read it")
    if max_bytes is not None and st.st_size > max_bytes:
        raise CorruptStoreError(
            f"{path}: {st.st_size} bytes, more than the {max_bytes} it may have; refusing to read it"
        )
