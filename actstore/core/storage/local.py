"""A store in a local directory.

Atomic writes go to a temporary file beside the target (``<target>.tmp-<random>``), flushed to
disk, then renamed over it (``os.replace``).  Reads open files non-blocking and check their type on
the open descriptor (:mod:`actstore.core.fs`), so a named pipe or a device planted in a store is
refused, never waited on.

The writer lock is the file ``.actstore-writer.lock`` in the root, opened without following links
and locked with ``flock(LOCK_EX | LOCK_NB)``: the kernel makes taking it atomic and drops it when
the holder dies, however it dies.  The record is written after the lock is taken; release deletes
the file, then unlocks it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import xxhash

from actstore.core.errors import StorageError
from actstore.core.fs import open_regular_file, pread_exact, read_local_file
from actstore.core.storage.base import LockPolicy, LockSlot, LockState, StoreLocation, check_range
from actstore.core.tables import digest as object_digest

T = TypeVar("T")


class LocalLocation(StoreLocation):
    """A store root in a directory of this machine (``fs`` is fsspec's local file system)."""

    def paths_open_directly(self) -> bool:
        return True

    def lists_cheaply(self) -> bool:
        return True

    def probe(self) -> None:
        return None

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """Opened non-blocking (opening a named pipe cannot hang), its type checked on the descriptor."""
        return read_local_file(self.path(rel), max_bytes)

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        path = self.path(rel)
        fd, _ = open_regular_file(path, None)
        try:
            return pread_exact(fd, length, offset, path)
        finally:
            os.close(fd)

    def read_if_regular(self, rel: str, max_bytes: int) -> bytes | None:
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

    def _entries(self, rel: str) -> list[str]:
        p = self.path(rel)
        return list(self.fs.ls(p, detail=False)) if self.fs.exists(p) else []

    def walk_files(self, rel: str) -> list[str]:
        # scandir by hand (os.walk + relpath cost about a third of verify's CPU per segment); a link,
        # to a directory too, is listed as an entry, never followed
        out: list[str] = []
        todo = [("", self.path(rel))]
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

    def tree_bytes(self, rel: str) -> int:
        return sum(
            os.path.getsize(os.path.join(here, f))
            for here, _, files in os.walk(self.path(rel))
            for f in files
        )

    def free_bytes(self) -> int | None:
        """Free bytes of the file system the store is (or would be) written to."""
        p = Path(self.path(""))
        while not p.exists() and p != p.parent:
            p = p.parent
        return shutil.disk_usage(p).free

    def root_is_non_directory(self) -> bool:
        return os.path.lexists(self.root) and not os.path.isdir(self.root)

    def root_is_link(self) -> bool:
        return os.path.islink(self.root)

    def first_special_entry(self, names: list[str]) -> str | None:
        root = self.root
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return "."
        for top in names:
            path = os.path.join(root, top)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                continue
            if not stat.S_ISDIR(st.st_mode):
                return top
            for here, dirs, files in os.walk(path, followlinks=False):
                for n in dirs + files:
                    st = os.lstat(os.path.join(here, n))
                    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                        return os.path.relpath(os.path.join(here, n), root)
        return None

    def _put_atomic(self, rel: str, data: bytes) -> None:
        target = self.path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def _put_stream_atomic(self, rel: str, produce: Callable[[BinaryIO], T]) -> tuple[T, str, int, str]:
        """``f`` is a temporary file beside the target, hashed from the page cache, then renamed: the
        bytes are never all in memory."""
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

    def remove_tree(self, rel: str) -> None:
        path = self.path(rel)
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)  # does not follow symbolic links
        else:
            os.unlink(path)

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def zarr_store(self, rel: str, *, read_only: bool) -> Any:
        import zarr.storage

        return zarr.storage.LocalStore(self.path(rel), read_only=read_only)

    @contextmanager
    def zarr_group_writer(
        self, rel: str, digests: dict[str, str] | None = None, algorithm: str = "sha256"
    ) -> Iterator[Any]:
        """With ``digests`` (a segment: tens of MB), built in zarr's memory store, then each object
        written to its file by plain descriptor writes on this thread and hashed from memory (zarr's
        local store handed every file to its event loop and a worker thread, and the digests re-read
        every file: 60-70% of an import's writer thread, benchmarks/HISTORY.md); the folder ``rel`` is
        replaced.  Without (the weights: hundreds of MB), written in place."""
        import zarr
        import zarr.storage

        if digests is None:
            yield zarr.open_group(store=self.zarr_store(rel, read_only=False), mode="w")
            return
        objects: dict[str, Any] = {}
        yield zarr.open_group(store=zarr.storage.MemoryStore(objects), mode="w")
        self.remove_tree(rel)
        root = self.path(rel)
        os.makedirs(root, exist_ok=True)
        folders: set[str] = set()
        for key in objects:  # every folder of the group, parents first: one mkdir each
            d = posixpath.dirname(key)
            while d and d not in folders:
                folders.add(d)
                d = posixpath.dirname(d)
        for d in sorted(folders, key=lambda d: d.count("/")):
            with contextlib.suppress(FileExistsError):
                os.mkdir(posixpath.join(root, d))

        def put(key: str) -> str:  # (hashing and the writes release the GIL: two at once)
            data = objects[key].as_buffer_like()
            fd = os.open(
                posixpath.join(root, key),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o644,
            )
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            return object_digest(data, algorithm)

        with ThreadPoolExecutor(max_workers=2) as pool:
            digests.update(zip(objects, pool.map(put, list(objects))))

    def lock_slot(self, name: str, policy: LockPolicy, max_record: int) -> LockSlot:
        return LocalLockSlot(self, name, policy, max_record)


class LocalLockSlot(LockSlot):
    """The lock file, locked with ``flock``; a waiter that opened the file just before its holder
    released it (unlinked it) sees so from the inode and opens it again."""

    def __init__(self, loc: LocalLocation, name: str, policy: LockPolicy, max_record: int) -> None:
        super().__init__(loc, name, policy, max_record)
        self.where = self.key
        self._fd: int | None = None  # the open, flock-ed lock file
        self._created_dirs: list[str] = []

    def held(self) -> bool:
        return self._fd is not None

    def inheritable_fds(self) -> tuple[int, ...]:
        return () if self._fd is None else (self._fd,)

    def acquire(self, record: bytes) -> None:
        import fcntl

        root = self.loc.root
        missing: list[str] = []
        d = root
        while not os.path.lexists(d):
            missing.append(d)
            d = os.path.dirname(d)
        os.makedirs(root, exist_ok=True)
        self._created_dirs = missing  # deepest first: removed on release when still empty
        path = self.where
        for _ in range(20):
            try:
                fd = os.open(
                    path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644
                )
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise StorageError(
                        f"{path} is a symbolic link, not actstore's lock file; refusing to use it"
                    ) from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise StorageError(f"{path} is not a regular file; refusing to use it as the writer lock")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    busy = False
                except BlockingIOError:
                    busy = True
                if busy:
                    self.policy.refuse_held(self._settled(fd))
                try:  # the path may have been unlinked (released) between our open and our flock
                    now = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    os.close(fd)
                    continue
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)
                    continue
                previous = os.pread(fd, self.max_record, 0)
                if previous:  # a record left by a holder that is gone (the lock was free)
                    self.policy.judge(previous, free=True)
                os.ftruncate(fd, 0)
                os.pwrite(fd, record, 0)
                os.fsync(fd)
                self._fd = fd
                return
            except BaseException:
                if self._fd != fd:
                    os.close(fd)
                raise
        self.policy.refuse_held(None)

    def _settled(self, fd: int) -> bytes | None:
        """The record in the open lock file, waiting briefly for a holder that has just taken the lock
        and not yet written its record."""
        for _ in range(20):
            data = os.pread(fd, self.max_record, 0)
            if self.policy.complete(data):
                return data
            time.sleep(0.05)
        return None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        path = self.where
        try:
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)  # before unlocking: a waiter that then gets the old inode sees it is gone
        except OSError:
            pass
        finally:
            os.close(fd)
        for d in self._created_dirs:  # directories this lock created, when nothing else was put there
            try:
                os.rmdir(d)
            except OSError:
                break

    def state(self) -> tuple[LockState, bytes | None]:
        """``held`` when another descriptor has the lock (a shared ``flock`` is refused), else ``free``."""
        import fcntl

        try:
            fd = os.open(self.where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return "free", None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "free", None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return "held", self._settled(fd)
            return "free", None  # (the shared lock goes with the descriptor)
        finally:
            os.close(fd)
