"""Where a store's bytes live: a local directory or an fsspec URL (s3://, memory://, ...).

Everything above this module speaks in paths relative to the store root.  Local
directories get atomic writes through ``os.replace``; object stores get them for free,
since a PUT is atomic per object.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import os
import posixpath
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar

import fsspec
import xxhash
from zarr.core.sync import sync

from actstore.core.errors import ActstoreError, CorruptStoreError, StorageError, StoreNotFoundError
from actstore.core.tables import HASH_SUFFIX, needs_hash_file, sha256, xxh3

T = TypeVar("T")


@dataclass(frozen=True)
class StoreLocation:
    """A store root: ``url`` as the user gave it, ``fs`` its fsspec filesystem, ``root`` the path in ``fs``."""

    url: str
    fs: Any
    root: str
    options: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # fsspec options
    # files written under tables/ through this location (a count readers compare with their listing's)
    _table_writes: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    @property
    def endpoint(self) -> str:
        """Where an object store is served (``AWS_ENDPOINT_URL``, else the provider's default)."""
        return str(self.options.get("client_kwargs", {}).get("endpoint_url") or "the default AWS endpoint")

    @contextmanager
    def io(self) -> Iterator[None]:
        """Turn an object store's network, credential and bucket failures into one-line errors.

        ``FileNotFoundError`` of a missing object passes through (callers test for it); local
        filesystem errors pass through unchanged.
        """
        try:
            yield
        except ActstoreError:
            raise
        except Exception as e:
            if self.is_local:
                raise
            mapped = _object_store_error(self, e)
            if mapped is None:
                raise
            raise mapped from None

    def probe(self) -> None:
        """Fail early, with one line, when an object store's endpoint, credentials or bucket are wrong."""
        if self.is_local:
            return
        try:
            with self.io():
                self.fs.ls(self.root, detail=False)  # one LIST of the store's own prefix
        except StoreNotFoundError:
            raise  # the bucket does not exist
        except FileNotFoundError:
            pass  # no store there yet

    def tables_written(self) -> int:
        """How many files were written under ``tables/`` through this location (a store's listing of
        its result tables is stale when this grew since it was made)."""
        return self._table_writes[0]

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        with self.io():
            return bool(self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """The bytes of the file ``rel``; a special file (a named pipe, a device, a directory) or, with
        ``max_bytes``, a larger file is refused with :class:`CorruptStoreError` instead of read.

        Locally the file is opened non-blocking (opening a named pipe cannot hang) and its type
        checked on the open descriptor; on an object store at most ``max_bytes + 1`` bytes are
        fetched (one ranged GET).
        """
        if self.is_local:
            return read_local_file(self.path(rel), max_bytes)
        with self.io():
            if max_bytes is None:
                data: bytes = self.fs.cat_file(self.path(rel))
            else:
                data = self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise CorruptStoreError(f"{self.url}/{rel}: larger than {max_bytes} bytes; refusing to read it")
        return data

    def read_if_regular(self, rel: str, max_bytes: int) -> bytes | None:
        """The bytes of ``rel`` when it is a regular file of at most ``max_bytes``; None for anything
        else (missing, locally a symbolic link, a pipe, a directory, a larger file).  Takes nothing,
        never blocks on a named pipe (``O_NONBLOCK``), never raises for what it finds there."""
        if self.is_local:
            try:
                fd = os.open(self.path(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                return None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                os.close(fd)
                return None
            with os.fdopen(fd, "rb", closefd=True) as f:
                data = f.read(max_bytes + 1)
            return None if len(data) > max_bytes else data
        try:
            with self.io():
                info = self.fs.info(self.path(rel))
                if info.get("type") != "file" or int(info.get("size") or 0) > max_bytes:
                    return None
                remote: bytes = self.fs.cat_file(self.path(rel))
            return remote
        except FileNotFoundError:
            return None

    def walk_files(self, rel: str) -> list[str]:
        """Every non-directory entry below ``rel`` (recursively), as paths relative to ``rel``, sorted;
        empty when ``rel`` does not exist.  Locally, links and special files are listed too (so that
        a check can refuse them); nothing is opened."""
        base = self.path(rel)
        out: list[str] = []
        if self.is_local:
            # scandir by hand (os.walk + relpath cost about a third of verify's CPU per segment); a link,
            # to a directory too, is listed as an entry, never followed
            todo = [("", base)]
            while todo:
                prefix, folder = todo.pop()
                try:
                    with os.scandir(folder) as entries:
                        for e in entries:
                            name = prefix + e.name
                            if e.is_dir(follow_symlinks=False):
                                todo.append((name + "/", e.path))
                            else:
                                out.append(name)
                except OSError:  # gone or unreadable: nothing listed there (as os.walk)
                    continue
            return sorted(out)
        with self.io():
            try:
                found = self.fs.find(base, detail=False)
            except FileNotFoundError:
                return []
        prefix = base.rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` so that readers see either the old object or the whole new one.

        A non-segment table file (:func:`actstore.core.tables.needs_hash_file`) gets its ``.sha256``
        companion written first, so a reader that sees the table also sees its hash, whichever
        writer (ingest, an analysis, a notebook) adds the file.
        """

        if needs_hash_file(rel):
            self.write_bytes_atomic(rel + HASH_SUFFIX, sha256(data).encode())
        if rel.startswith("tables/"):
            self._table_writes[0] += 1
        target = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            with self.io():
                self.fs.pipe_file(target, data)

    def write_stream_atomic(self, rel: str, produce: Callable[[BinaryIO], T]) -> tuple[T, str, int, str]:
        """Write the bytes ``produce(f)`` writes to the binary file ``f`` as object ``rel``, atomically
        (as :meth:`write_bytes_atomic`: readers see the old object or the whole new one); returns what
        ``produce`` returned, the SHA-256, the size and the XXH3-128 (:func:`actstore.core.tables.xxh3`).  Locally ``f`` is a temporary file beside the
        target (hashed from the page cache, then renamed): the bytes are never all in memory.  On an
        object store they are gathered in memory and uploaded once."""

        if needs_hash_file(rel):
            raise ValueError(f"{rel}: a table with a .sha256 companion is written by write_bytes_atomic")
        if not self.is_local:
            buf = io.BytesIO()
            out = produce(buf)
            data = buf.getvalue()
            self.write_bytes_atomic(rel, data)
            return out, hashlib.sha256(data).hexdigest(), len(data), xxh3(data)
        target = self.path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                out = produce(f)
                f.flush()
                os.fsync(f.fileno())
            digest, fast, size = hashlib.sha256(), xxhash.xxh3_128(), 0
            with open(tmp, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    fast.update(block)
                    size += len(block)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return out, digest.hexdigest(), size, fast.hexdigest()

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        p = self.path(rel)
        with self.io():
            if self.is_local:
                if not self.fs.exists(p):
                    return []
                entries = self.fs.ls(p, detail=False)
            else:  # one LIST request instead of an existence check plus the listing
                try:
                    entries = self.fs.ls(p, detail=False)
                except FileNotFoundError:
                    return []
            return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def remove_tree(self, rel: str) -> None:
        p = self.path(rel)
        with self.io():
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)

    def makedirs(self, rel: str) -> None:
        if self.is_local:
            os.makedirs(self.path(rel), exist_ok=True)

    def zarr_store(self, rel: str, *, read_only: bool) -> Any:
        """A zarr v3 store object for the group at ``rel``."""
        import zarr.storage

        if self.is_local:
            return zarr.storage.LocalStore(self.path(rel), read_only=read_only)
        return zarr.storage.FsspecStore(self._async_fs(), path=self.path(rel), read_only=read_only)

    @contextmanager
    def zarr_group_writer(self, rel: str, digests: dict[str, str] | None = None) -> Iterator[Any]:
        """A new, empty zarr group at ``rel`` to fill inside the ``with`` block.

        Locally the group is written in place.  On an object store it is built in memory and
        its objects are uploaded together on exit (concurrent PUTs instead of zarr's many
        small sequential requests); the bytes are the same either way.  ``digests``, when
        given, receives the SHA-256 of every object written, keyed by its path below ``rel``.
        """
        import zarr
        import zarr.storage

        if self.is_local:
            yield zarr.open_group(store=self.zarr_store(rel, read_only=False), mode="w")
            if digests is not None:  # hashed from the page cache, just after writing
                for key in self.walk_files(rel):
                    digests[key] = hashlib.sha256(
                        read_local_file(posixpath.join(self.path(rel), key), None)
                    ).hexdigest()
            return
        objects: dict[str, Any] = {}
        yield zarr.open_group(store=zarr.storage.MemoryStore(objects), mode="w")
        payload = {posixpath.join(self.path(rel), key): buf.to_bytes() for key, buf in objects.items()}
        if digests is not None:
            digests.update(
                {
                    key: hashlib.sha256(payload[posixpath.join(self.path(rel), key)]).hexdigest()
                    for key in objects
                }
            )
        with self.io():
            self.fs.pipe(payload)

    def _async_fs(self) -> Any:
        """An ``asynchronous=True`` twin of ``fs`` for zarr, which runs it on zarr's own event loop
        (sharing fsspec's loop-bound instance fails with "attached to a different loop")."""
        afs = self.__dict__.get("_afs")
        if afs is None:
            proto = _protocols(self.fs)[0]
            if getattr(self.fs, "async_impl", False):
                afs = fsspec.filesystem(proto, asynchronous=True, **self.options)
                _ASYNC_FILESYSTEMS.append(afs)
            else:
                from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

                afs = AsyncFileSystemWrapper(self.fs, asynchronous=True)
            object.__setattr__(self, "_afs", afs)  # frozen dataclass: a cache, not state
        return afs


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


_ASYNC_FILESYSTEMS: list[Any] = []


@atexit.register
def _close_async_filesystems() -> None:
    """Close the HTTP sessions of zarr's async filesystems (else aiohttp warns at exit)."""
    if not _ASYNC_FILESYSTEMS:
        return

    for afs in _ASYNC_FILESYSTEMS:
        creator = getattr(afs, "_s3creator", None)
        if creator is not None:
            try:
                sync(creator.__aexit__(None, None, None))
            except Exception:
                pass
    _ASYNC_FILESYSTEMS.clear()


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def locate(url: str | os.PathLike[str]) -> StoreLocation:
    """Resolve a store URL or path.  S3 settings come from the standard AWS environment variables."""
    text = os.fspath(url)
    if "://" not in text:
        text = os.path.abspath(text)
        fs = fsspec.filesystem("file")
        return StoreLocation(url=text, fs=fs, root=text)
    options: dict[str, Any] = {}
    if text.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        # Other writers (ranks, a running ingest) add objects: never answer from a stale listing.
        options["use_listings_cache"] = False
        options["skip_instance_cache"] = True
        # One GET per object read: with s3fs's default (10), every whole-object read first asks the
        # object's size (a HEAD) to decide whether to fetch its parts concurrently.
        options["max_concurrency"] = 1
    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except ImportError as e:
        raise StorageError(f"{text}: no filesystem for this URL scheme ({e})") from None
    except ValueError as e:
        raise StorageError(f"{text}: not a store URL ({e})") from None
    return StoreLocation(url=text, fs=fs, root=root.rstrip("/"), options=options)


def _object_store_error(loc: StoreLocation, e: BaseException) -> ActstoreError | None:
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
