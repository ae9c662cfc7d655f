"""The storage interface: :class:`StoreLocation`, one store root on one kind of storage.

Everything above this package speaks in paths relative to the store root (``rel``) and never asks
which kind of storage it has.  What differs between backends is a method of this interface,
implemented per backend; where a caller must choose between two strategies, it asks a capability
named for what it means (:meth:`StoreLocation.paths_open_directly`, :meth:`StoreLocation.lists_cheaply`).

The contract every backend keeps (``tests/integration/storage/test_storage_conformance.py`` checks it):

- **Atomic commit.**  :meth:`~StoreLocation.write_bytes_atomic` and
  :meth:`~StoreLocation.write_stream_atomic` make an object appear whole or not at all: a reader
  sees the old object or the whole new one, never part of one; a write that fails leaves the old
  object as it was.
- **Missing objects.**  Reading a missing object (:meth:`~StoreLocation.read_bytes`,
  :meth:`~StoreLocation.read_range`) raises :class:`FileNotFoundError`; listing a missing folder
  lists nothing; :meth:`~StoreLocation.read_if_regular` returns None.
- **Damage.**  An object larger than a read allows, or shorter than a range read asks for, is a
  :class:`~actstore.core.errors.CorruptStoreError`.
- **One writer.**  :meth:`~StoreLocation.lock_slot` gives the exclusive writer lock of the store
  (:mod:`actstore.core.lock` decides who may take it over); a second writer is refused.

The backends (:func:`actstore.core.storage.locate` picks one from a URL): a local directory
(:mod:`.local`), S3 (:mod:`.s3`), fsspec's in-process memory file system (:mod:`.memory`), and any
other fsspec URL, which reads and writes but takes no writer lock (:mod:`.objects`).
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal, NoReturn, Protocol, TypeVar

from actstore.core.tables import HASH_SUFFIX, needs_hash_file, sha256

T = TypeVar("T")

LockState = Literal["free", "held", "unknown"]
"""What a backend can tell of its writer lock without taking it: ``free`` (no writer holds it),
``held`` (a live writer holds it: the storage itself says so) or ``unknown`` (a record is there, or
not, and only its content can tell whether its writer still runs)."""


def check_range(offset: int, length: int) -> None:
    """Refuse a byte range with a negative offset or length (:meth:`StoreLocation.read_range`)."""
    if offset < 0 or length < 0:
        raise ValueError(f"a byte range needs a non-negative offset and length (got {offset}, {length})")


class LockPolicy(Protocol):
    """What a lock slot asks of the lock's owner (:class:`actstore.core.lock.WriterLock`): what a lock
    record means.  The slot moves the bytes; the policy reads them and raises the errors."""

    def complete(self, record: bytes) -> bool:
        """Whether ``record`` is a whole lock record (a reader waits briefly for one)."""
        ...

    def mine(self, record: bytes | None) -> bool:
        """Whether ``record`` is the one this lock wrote."""
        ...

    def judge(self, record: bytes, *, free: bool) -> None:
        """A record is in the slot: return when this writer may replace it, else raise.  ``free``:
        the storage proves that no writer holds the lock now (a kernel lock), so the record is a
        dead writer's."""
        ...

    def refuse_held(self, record: bytes | None) -> NoReturn:
        """Raise: a live writer holds the lock (``record``: its record, when readable)."""
        ...


class LockSlot(ABC):
    """The writer lock object of one store, as one backend takes it.  Made by
    :meth:`StoreLocation.lock_slot`; the record's meaning is the :class:`LockPolicy`'s."""

    def __init__(self, loc: StoreLocation, name: str, policy: LockPolicy, max_record: int) -> None:
        self.loc, self.name, self.policy, self.max_record = loc, name, policy, max_record
        self.key = loc.path(name)  # the lock object's path in ``loc.fs``
        self.where = f"{loc.url}/{name}"  # how messages name the lock object (a path, or a URL)

    @abstractmethod
    def acquire(self, record: bytes) -> None:
        """Take the lock and leave ``record`` in it; raises (through the policy) when another
        writer has it."""

    @abstractmethod
    def release(self) -> None:
        """Let go of the lock, when this slot holds it (nothing otherwise)."""

    @abstractmethod
    def held(self) -> bool:
        """Whether this slot holds the lock now."""

    def inheritable_fds(self) -> tuple[int, ...]:
        """File descriptors a child process may inherit so that the lock outlives this process."""
        return ()

    def read(self) -> bytes | None:
        """The record in the slot (None when there is none or it cannot be read); takes nothing."""
        return self.loc.read_if_regular(self.name, self.max_record)

    @abstractmethod
    def state(self) -> tuple[LockState, bytes | None]:
        """Whether a writer holds the lock, as far as the storage can tell, and its record (when
        ``held`` or ``unknown``); takes and creates nothing."""


@dataclass(frozen=True)
class StoreLocation(ABC):
    """A store root: ``url`` as the user gave it, ``fs`` its fsspec filesystem, ``root`` the path in ``fs``.

    Made by :func:`actstore.core.storage.locate`; one subclass per backend.
    """

    url: str
    fs: Any
    root: str
    options: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # fsspec options
    # files written under tables/ through this location (a count readers compare with their listing's)
    _table_writes: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    # ------------------------------------------------------------------ the same on every backend

    def path(self, rel: str) -> str:
        """The path of ``rel`` in :attr:`fs`."""
        return posixpath.join(self.root, rel) if rel else self.root

    def os_path(self, rel: str) -> str | None:
        """The path of ``rel`` that this machine's file system opens (os, pyarrow, DuckDB), or None
        where the store's files are reached through this interface only."""
        return self.path(rel) if self.paths_open_directly() else None

    def tables_written(self) -> int:
        """How many files were written under ``tables/`` through this location (a store's listing of
        its result tables is stale when this grew since it was made)."""
        return self._table_writes[0]

    def exists(self, rel: str) -> bool:
        with self.io():
            return bool(self.fs.exists(self.path(rel)))

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` so that readers see either the old object or the whole new one; a write that
        fails leaves the old object.

        A non-segment table file (:func:`actstore.core.tables.needs_hash_file`) gets its ``.sha256``
        companion written first, so a reader that sees the table also sees its hash, whichever
        writer (ingest, an analysis, a notebook) adds the file.
        """
        if needs_hash_file(rel):
            self.write_bytes_atomic(rel + HASH_SUFFIX, sha256(data).encode())
        if rel.startswith("tables/"):
            self._table_writes[0] += 1
        self._put_atomic(rel, data)

    def write_stream_atomic(self, rel: str, produce: Callable[[BinaryIO], T]) -> tuple[T, str, int, str]:
        """Write the bytes ``produce(f)`` writes to the binary file ``f`` as object ``rel``, atomically
        (as :meth:`write_bytes_atomic`: readers see the old object or the whole new one, and an
        exception from ``produce`` leaves the old one); returns what ``produce`` returned, the
        SHA-256, the size and the XXH3-128 (:func:`actstore.core.tables.xxh3`) of what was written."""
        if needs_hash_file(rel):
            raise ValueError(f"{rel}: a table with a .sha256 companion is written by write_bytes_atomic")
        return self._put_stream_atomic(rel, produce)

    @contextmanager
    def io(self) -> Iterator[None]:
        """Turn a backend's network, credential and bucket failures into one-line errors
        (:class:`~actstore.core.errors.StorageError`, :class:`~actstore.core.errors.StoreNotFoundError`).
        ``FileNotFoundError`` of a missing object passes through (callers test for it); so do a
        local file system's errors."""
        yield

    # ------------------------------------------------------------------ capabilities

    @abstractmethod
    def paths_open_directly(self) -> bool:
        """Whether :meth:`path` names a file this machine opens itself, so that other readers (pyarrow,
        DuckDB, ``os``) may read the store's files in place; where not, bytes come through this
        interface (:meth:`read_bytes`, :meth:`zarr_store`) only."""

    @abstractmethod
    def lists_cheaply(self) -> bool:
        """Whether a listing costs a few system calls (list afresh each time) rather than a request
        (keep a listing until something was written)."""

    # ------------------------------------------------------------------ reads

    @abstractmethod
    def probe(self) -> None:
        """Fail early, with one line, when the storage cannot be reached (an object store's endpoint,
        credentials or bucket); a missing store is no error here."""

    @abstractmethod
    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """The bytes of the object ``rel``; a special file (a named pipe, a device, a directory) or,
        with ``max_bytes``, a larger object is refused with
        :class:`~actstore.core.errors.CorruptStoreError` instead of read.  Missing:
        :class:`FileNotFoundError`."""

    @abstractmethod
    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of ``rel`` from byte ``offset``; an object that ends sooner is a
        :class:`~actstore.core.errors.CorruptStoreError`.  Missing: :class:`FileNotFoundError`."""

    @abstractmethod
    def read_if_regular(self, rel: str, max_bytes: int) -> bytes | None:
        """The bytes of ``rel`` when it is a regular object of at most ``max_bytes``; None for anything
        else (missing, a symbolic link, a pipe, a directory, a larger object).  Never blocks on a
        named pipe, never raises for what it finds there."""

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``, sorted; empty when it does not exist."""
        return sorted(posixpath.basename(e.rstrip("/")) for e in self._entries(rel))

    @abstractmethod
    def _entries(self, rel: str) -> list[str]:
        """The paths (in :attr:`fs`) directly under ``rel``; empty when it does not exist."""

    @abstractmethod
    def walk_files(self, rel: str) -> list[str]:
        """Every non-directory entry below ``rel`` (recursively), as paths relative to ``rel``, sorted;
        empty when ``rel`` does not exist or is no folder.  Links and special files are listed too
        (so that a check can refuse them), never followed; nothing is opened."""

    @abstractmethod
    def tree_bytes(self, rel: str) -> int:
        """The bytes of the objects below ``rel`` (``""``: the whole store)."""

    @abstractmethod
    def free_bytes(self) -> int | None:
        """Free bytes where the store is written (None where the storage does not say)."""

    # ------------------------------------------------------------------ what is at the root

    @abstractmethod
    def root_is_non_directory(self) -> bool:
        """Whether something other than a directory (a file, a dangling link) is at the root."""

    @abstractmethod
    def root_is_link(self) -> bool:
        """Whether the root is a symbolic link."""

    @abstractmethod
    def first_special_entry(self, names: list[str]) -> str | None:
        """The first entry at or below the top-level ``names`` that is neither a regular object nor a
        folder (a symbolic link, a pipe, a socket, a device), as a path relative to the root; ``"."``
        when the root itself is no directory; None when there is none."""

    # ------------------------------------------------------------------ writes

    @abstractmethod
    def _put_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` as ``rel``, atomically (see :meth:`write_bytes_atomic`)."""

    @abstractmethod
    def _put_stream_atomic(self, rel: str, produce: Callable[[BinaryIO], T]) -> tuple[T, str, int, str]:
        """Write what ``produce`` writes as ``rel``, atomically (see :meth:`write_stream_atomic`)."""

    @abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Remove the object or folder ``rel`` with everything below it; nothing when it is absent.
        A symbolic link is removed itself, never followed."""

    @abstractmethod
    def makedirs(self, rel: str) -> None:
        """Make the folder ``rel`` where folders exist (nothing on an object store)."""

    # ------------------------------------------------------------------ zarr

    @abstractmethod
    def zarr_store(self, rel: str, *, read_only: bool) -> Any:
        """A zarr v3 store object for the group at ``rel``."""

    @abstractmethod
    def zarr_group_writer(
        self, rel: str, digests: dict[str, str] | None = None, algorithm: str = "sha256"
    ) -> AbstractContextManager[Any]:
        """A new, empty zarr group at ``rel`` to fill inside the ``with`` block; its objects are stored
        when the block ends (the bytes are the same on every backend).  ``digests``, when given,
        receives the hash (``algorithm``: ``"sha256"`` or ``"xxh3"``, XXH3-128) of every object
        written, keyed by its path below ``rel``."""

    # ------------------------------------------------------------------ the writer lock

    @abstractmethod
    def lock_slot(self, name: str, policy: LockPolicy, max_record: int) -> LockSlot:
        """The writer lock object ``name`` (in the root) of this store, its record read up to
        ``max_record`` bytes; taking it is :meth:`LockSlot.acquire`."""
