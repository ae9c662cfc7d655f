"""A store on an object store reached through fsspec (``s3://``, ``memory://``, ``gs://``, ...).

A PUT is atomic per object, so an object is written in one request (``pipe_file``): readers see the
old object or the whole new one.  Network, credential and bucket failures become one-line errors
(:meth:`ObjectLocation.io`).  Zarr gets an ``asynchronous=True`` twin of the filesystem.

:class:`ObjectLocation` serves any fsspec URL for reading and writing; it takes no writer lock
(:class:`~actstore.core.storage.s3.S3Location` and
:class:`~actstore.core.storage.memory.MemoryLocation` do).
"""

from __future__ import annotations

import atexit
import hashlib
import io
import posixpath
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, TypeVar

import fsspec
from zarr.core.sync import sync

from actstore.core.errors import ActstoreError, CorruptStoreError, StorageError, StoreNotFoundError
from actstore.core.storage.base import LockPolicy, LockSlot, LockState, StoreLocation, check_range
from actstore.core.tables import digest as object_digest
from actstore.core.tables import xxh3

T = TypeVar("T")


class ObjectLocation(StoreLocation):
    """A store root on an object store, through its fsspec filesystem ``fs``."""

    @property
    def endpoint(self) -> str:
        """Where an object store is served (``AWS_ENDPOINT_URL``, else the provider's default)."""
        return str(self.options.get("client_kwargs", {}).get("endpoint_url") or "the default AWS endpoint")

    def paths_open_directly(self) -> bool:
        return False

    def lists_cheaply(self) -> bool:
        return False  # each listing is a request

    @contextmanager
    def io(self) -> Iterator[None]:
        try:
            yield
        except ActstoreError:
            raise
        except Exception as e:
            mapped = _object_store_error(self, e)
            if mapped is None:
                raise
            raise mapped from None

    def probe(self) -> None:
        try:
            with self.io():
                self.fs.ls(self.root, detail=False)  # one LIST of the store's own prefix
        except StoreNotFoundError:
            raise  # the bucket does not exist
        except FileNotFoundError:
            pass  # no store there yet

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """At most ``max_bytes + 1`` bytes are fetched (one ranged GET)."""
        if max_bytes is None:
            with self.io():
                data: bytes = self.fs.cat_file(self.path(rel))
        else:
            data = self._ranged(self.path(rel), 0, max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise CorruptStoreError(f"{self.url}/{rel}: larger than {max_bytes} bytes; refusing to read it")
        return data

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """One ranged GET (a range the object does not hold all of costs a HEAD more)."""
        check_range(offset, length)
        path = self.path(rel)
        if length:
            data = self._ranged(path, offset, offset + length)
        else:
            with self.io():
                if not self.fs.isfile(path):
                    raise FileNotFoundError(path)
            data = b""
        if len(data) != length:
            raise CorruptStoreError(
                f"{self.url}/{rel}: ends before byte {offset + length}, the end of a read of {length} bytes "
                f"from {offset}"
            )
        return data

    def _ranged(self, path: str, start: int, end: int) -> bytes:
        """The bytes the object holds in ``[start, end)`` (fewer where it ends sooner), in one ranged GET;
        a server refuses (416) a range that starts at or past the object's end, read here as no bytes."""
        try:
            with self.io():
                data: bytes = self.fs.cat_file(path, start=start, end=end)
        except StorageError:
            with self.io():
                if start < int(self.fs.size(path)):
                    raise
            return b""
        return data

    def read_if_regular(self, rel: str, max_bytes: int) -> bytes | None:
        try:
            with self.io():
                info = self.fs.info(self.path(rel))
                if info.get("type") != "file" or int(info.get("size") or 0) > max_bytes:
                    return None
                data: bytes = self.fs.cat_file(self.path(rel))
            return data
        except FileNotFoundError:
            return None

    def _entries(self, rel: str) -> list[str]:
        """One LIST request (no existence check before it)."""
        with self.io():
            try:
                return list(self.fs.ls(self.path(rel), detail=False))
            except FileNotFoundError:
                return []

    def walk_files(self, rel: str) -> list[str]:
        base = self.path(rel)
        with self.io():
            try:
                found = self.fs.find(base, detail=False)
            except FileNotFoundError:
                return []
        prefix = base.rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))

    def tree_bytes(self, rel: str) -> int:
        return int(self.fs.du(self.path(rel)))

    def free_bytes(self) -> int | None:
        return None

    def root_is_non_directory(self) -> bool:
        return False  # a prefix, never an object

    def root_is_link(self) -> bool:
        return False

    def first_special_entry(self, names: list[str]) -> str | None:
        return None  # objects only: no links, pipes or devices

    def _put_atomic(self, rel: str, data: bytes) -> None:
        with self.io():
            self.fs.pipe_file(self.path(rel), data)

    def _put_stream_atomic(self, rel: str, produce: Callable[[BinaryIO], T]) -> tuple[T, str, int, str]:
        """Gathered in memory, then uploaded once (an exception from ``produce`` uploads nothing)."""
        buf = io.BytesIO()
        out = produce(buf)
        data = buf.getvalue()
        self.write_bytes_atomic(rel, data)
        return out, hashlib.sha256(data).hexdigest(), len(data), xxh3(data)

    def remove_tree(self, rel: str) -> None:
        p = self.path(rel)
        with self.io():
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)

    def makedirs(self, rel: str) -> None:
        return None  # prefixes need no folders

    def zarr_store(self, rel: str, *, read_only: bool) -> Any:
        import zarr.storage

        return zarr.storage.FsspecStore(self._async_fs(), path=self.path(rel), read_only=read_only)

    @contextmanager
    def zarr_group_writer(
        self, rel: str, digests: dict[str, str] | None = None, algorithm: str = "sha256"
    ) -> Iterator[Any]:
        """Built in memory; its objects are uploaded together on exit (concurrent PUTs instead of
        zarr's many small sequential requests)."""
        import zarr
        import zarr.storage

        objects: dict[str, Any] = {}
        yield zarr.open_group(store=zarr.storage.MemoryStore(objects), mode="w")
        payload = {posixpath.join(self.path(rel), key): buf.to_bytes() for key, buf in objects.items()}
        if digests is not None:
            digests.update(
                {
                    key: object_digest(payload[posixpath.join(self.path(rel), key)], algorithm)
                    for key in objects
                }
            )
        with self.io():
            self.fs.pipe(payload)

    def lock_slot(self, name: str, policy: LockPolicy, max_record: int) -> LockSlot:
        return NoLockSlot(self, name, policy, max_record)

    def _async_fs(self) -> Any:
        """An ``asynchronous=True`` twin of ``fs`` for zarr, which runs it on zarr's own event loop
        (sharing fsspec's loop-bound instance fails with "attached to a different loop")."""
        afs = self.__dict__.get("_afs")
        if afs is None:
            proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
            if getattr(self.fs, "async_impl", False):
                afs = fsspec.filesystem(proto, asynchronous=True, **self.options)
                _ASYNC_FILESYSTEMS.append(afs)
            else:
                from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

                afs = AsyncFileSystemWrapper(self.fs, asynchronous=True)
            object.__setattr__(self, "_afs", afs)  # frozen dataclass: a cache, not state
        return afs


class NoLockSlot(LockSlot):
    """An object store actstore cannot lock: its lock record can be read, never taken."""

    def acquire(self, record: bytes) -> None:
        raise StorageError(f"{self.loc.url}: actstore can lock stores only in local directories and on S3")

    def release(self) -> None:
        return None

    def held(self) -> bool:
        return False

    def state(self) -> tuple[LockState, bytes | None]:
        return "unknown", self.read()


_ASYNC_FILESYSTEMS: list[Any] = []


@atexit.register
def _close_async_filesystems() -> None:
    """Close the HTTP sessions of zarr's async filesystems (else aiohttp warns at exit)."""
    for afs in _ASYNC_FILESYSTEMS:
        creator = getattr(afs, "_s3creator", None)
        if creator is not None:
            try:
                sync(creator.__aexit__(None, None, None))
            except Exception:
                pass
    _ASYNC_FILESYSTEMS.clear()


def _object_store_error(loc: ObjectLocation, e: BaseException) -> ActstoreError | None:
    """The one-line error an object-store failure means, or None for a plain missing object."""
    text = " ".join(str(e).split()) or type(e).__name__
    chain = {cls.__name__ for x in _causes(e) for cls in type(x).__mro__}
    bucket = loc.root.split("/", 1)[0]
    if isinstance(e, FileNotFoundError):
        if "NoSuchBucket" in chain or "bucket does not exist" in text.lower():
            return StoreNotFoundError(f"{loc.url}: bucket {bucket!r} does not exist at {loc.endpoint}")
        return None
    if isinstance(e, PermissionError) or any(
        n in ("NoCredentialsError", "PartialCredentialsError") for n in chain
    ):
        return StorageError(
            f"{loc.url}: access denied by {loc.endpoint} ({text}); check AWS_ACCESS_KEY_ID, "
            f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's permissions"
        )
    network = (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ConnectionRefusedError",
        "TimeoutError",
        "FSTimeoutError",
        "HTTPClientError",
        "gaierror",
    )
    if isinstance(e, ConnectionError) or any(n in network for n in chain):
        return StorageError(
            f"{loc.url}: cannot reach the object store at {loc.endpoint} ({text}); "
            f"check AWS_ENDPOINT_URL and the network"
        )
    if isinstance(e, OSError) or "ClientError" in chain or "BotoCoreError" in chain:
        return StorageError(f"{loc.url}: object store error ({type(e).__name__}: {text})")
    return None


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (at most 10)."""
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(out) < 10:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out
