"""One writer per store: an exclusive lock held for a whole ingest (create, ``--overwrite``, ``--resume``).

The lock is the object ``.actstore-writer.lock`` inside the store root.  It holds a JSON record
naming its holder (host, pid, process start, wall-clock start, a random token), so a second
writer fails with one line saying who writes the store.  Readers never look at it.

Local directories.  The lock file is opened without following symlinks and locked with
``flock(LOCK_EX | LOCK_NB)``: the kernel makes taking it atomic and drops it when the holder
dies, however it dies.  The record is written after the lock is taken.  A record left by a
dead holder (SIGKILL, power loss) is detected by host and pid: on the same host, with the pid
gone (or reused, seen from its start time in ``/proc``), the next writer takes over and logs
it; a record from another host whose lock is free is refused, since this host cannot tell
whether that writer still runs.  Release deletes the file, then unlocks it.

Object stores (S3).  The record is written with a conditional PUT (``If-None-Match: *``): the
first writer creates it, every later one gets 412 and reads who holds it.  A stale record
(same host, dead pid) is replaced with ``If-Match: <its ETag>``, and release deletes only the
ETag this writer wrote.  A server that ignores the conditions is caught by reading the record
back; the limits are in docs/security.md ("Writers").

Several processes under one lock (``actstore ingest --procs N``): the launcher takes the lock
and passes its token to the ranks in ``ACTSTORE_WRITER_LOCK``; a rank checks that the record
still carries that token and runs under it (:func:`under_launcher`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from fsspec.asyn import sync

from actstore.core.errors import ActstoreError, StorageError, StoreLockedError
from actstore.core.fs import StoreLocation, locate
from actstore.core.lock_holder import Holder

LOCK_NAME = ".actstore-writer.lock"
LOCK_ENV = "ACTSTORE_WRITER_LOCK"  # token of the lock a launcher holds for its ranks
_MAX_RECORD = 64 * 1024


class _Conflict(ActstoreError):
    """An S3 condition (If-None-Match, If-Match) failed: someone else's record is there."""


def _log_nothing(message: str) -> None:
    pass


def held_message(loc: StoreLocation, holder: Holder | None) -> str:
    who = holder.describe() if holder else "another writer (its record is not readable yet)"
    return f"{loc.url} is being written by another ingest: {who}; wait for it to finish, or stop it"


def _stale_elsewhere_message(loc: StoreLocation, holder: Holder) -> str:
    return (
        f"{loc.url} has a writer lock from {holder.describe()}; this host cannot tell whether that ingest "
        f"still runs: if it does not, delete {loc.path(LOCK_NAME)}"
    )


# --------------------------------------------------------------------------------------- the lock


class WriterLock:
    """The exclusive writer lock of one store.  Use :func:`writer_lock`."""

    def __init__(self, loc: StoreLocation, command: str, log: Callable[[str], None]) -> None:
        self.loc = loc
        self.holder = Holder.me(command)
        self.log = log
        self._fd: int | None = None  # local: the open, flock-ed lock file
        self._etag: str | None = None  # object store: the ETag of the record this writer put
        self._created_dirs: list[str] = []

    @property
    def token(self) -> str:
        return self.holder.token

    def inheritable_fds(self) -> tuple[int, ...]:
        """File descriptors a child process may inherit so the lock outlives this one (local stores)."""
        return () if self._fd is None else (self._fd,)

    # ---- local
    def _acquire_local(self) -> None:
        root = self.loc.root
        missing: list[str] = []
        d = root
        while not os.path.lexists(d):
            missing.append(d)
            d = os.path.dirname(d)
        os.makedirs(root, exist_ok=True)
        self._created_dirs = missing  # deepest first: removed on release when still empty
        path = self.loc.path(LOCK_NAME)
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
                    import fcntl

                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise StoreLockedError(
                        held_message(self.loc, self._read_record_local(fd, settle=True))
                    ) from None
                try:  # the path may have been unlinked (released) between our open and our flock
                    now = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    os.close(fd)
                    continue
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)
                    continue
                previous = self._read_record_local(fd, settle=False)
                if previous is not None:
                    self._check_stale(previous)
                elif os.fstat(fd).st_size:
                    raise StorageError(
                        f"{path} holds something that is not an actstore lock record; "
                        "delete it if no ingest writes this store"
                    )
                data = self.holder.to_json()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                self._fd = fd
                return
            except BaseException:
                if self._fd != fd:
                    os.close(fd)
                raise
        raise StoreLockedError(held_message(self.loc, None))

    @staticmethod
    def _read_record_local(fd: int, *, settle: bool) -> Holder | None:
        """The record in the open lock file; with ``settle``, wait briefly for a holder that has just
        taken the lock and not yet written its record."""
        for _ in range(20 if settle else 1):
            holder = Holder.from_json(os.pread(fd, _MAX_RECORD, 0))
            if holder is not None or not settle:
                return holder
            time.sleep(0.05)
        return None

    def _check_stale(self, previous: Holder) -> None:
        """The lock was free but a record was left: take over only from a holder proven dead."""
        if previous.token == self.holder.token:
            return
        if not previous.same_machine():
            raise StoreLockedError(_stale_elsewhere_message(self.loc, previous))
        if previous.alive():
            raise StoreLockedError(held_message(self.loc, previous))
        self.log(
            f"taking over the writer lock of {self.loc.url} from {previous.describe()}: that process is gone"
        )

    def _release_local(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        path = self.loc.path(LOCK_NAME)
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

    # ---- object store
    def _s3(self, op: str, **kwargs: Any) -> dict[str, Any]:
        """One S3 call on the lock object; a failed condition (412) raises :class:`_Conflict`."""
        bucket, key, _ = self.loc.fs.split_path(self.loc.path(LOCK_NAME))
        with self.loc.io():
            try:
                result: dict[str, Any] = self.loc.fs.call_s3(op, Bucket=bucket, Key=key, **kwargs)
            except Exception as e:
                if isinstance(e, FileExistsError) or _precondition_failed(e):
                    raise _Conflict(op) from None
                raise
        return result

    def _read_record_s3(self) -> tuple[Holder | None, str | None]:
        """(record, ETag) of the lock object in one GET; (None, None) when there is none."""

        bucket, key, _ = self.loc.fs.split_path(self.loc.path(LOCK_NAME))
        fs = self.loc.fs

        async def get() -> tuple[bytes, str | None]:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                data: bytes = await resp["Body"].read(_MAX_RECORD)
            finally:
                resp["Body"].close()
            return data, resp.get("ETag")

        try:
            with self.loc.io():
                data, etag = sync(fs.loop, get)
        except FileNotFoundError:
            return None, None
        return Holder.from_json(data), etag

    def _acquire_s3(self) -> None:
        data = self.holder.to_json()
        for _ in range(20):
            try:
                put = self._s3("put_object", Body=data, IfNoneMatch="*")
            except _Conflict:  # a record exists: who holds it, and is it stale?
                previous, etag = self._read_record_s3()
                if etag is None:
                    continue  # released in between: try again
                if previous is None:
                    raise StorageError(
                        f"{self.loc.url}/{LOCK_NAME} holds something that is not an actstore lock "
                        "record; delete it if no ingest writes this store"
                    ) from None
                if not previous.same_machine():
                    raise StoreLockedError(
                        f"{held_message(self.loc, previous)} (if that ingest no longer runs, delete "
                        f"{self.loc.url}/{LOCK_NAME})"
                    ) from None
                self._check_stale(previous)
                try:
                    put = self._s3("put_object", Body=data, IfMatch=etag)
                except _Conflict:
                    continue  # another writer replaced it first
            self._etag = put.get("ETag")
            mine, _ = self._read_record_s3()  # a server that ignored the condition overwrote the record
            if mine is None or mine.token != self.holder.token:
                self._etag = None
                raise StoreLockedError(held_message(self.loc, mine))
            return
        raise StoreLockedError(held_message(self.loc, None))

    def _release_s3(self) -> None:
        etag, self._etag = self._etag, None
        if etag is None:
            return
        try:
            self._s3("delete_object", IfMatch=etag)
        except _Conflict:
            return  # no longer ours: leave it
        except FileNotFoundError:
            return
        except StorageError:  # a server without conditional deletes: delete it if the record is still ours
            current, _ = self._read_record_s3()
            if current is not None and current.token == self.holder.token:
                self._s3("delete_object")

    # ---- both
    def acquire(self) -> None:
        if self.loc.is_local:
            self._acquire_local()
        elif self.loc.fs.__class__.__name__ == "S3FileSystem":
            self._acquire_s3()
        else:
            raise StorageError(
                f"{self.loc.url}: actstore can lock stores only in local directories and on S3"
            )

    def release(self) -> None:
        if self.loc.is_local:
            self._release_local()
        else:
            self._release_s3()

    def holds(self) -> bool:
        return self._fd is not None or self._etag is not None


def _precondition_failed(e: BaseException) -> bool:
    cur: BaseException | None = e
    while cur is not None:
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return True
        cur = cur.__cause__ or cur.__context__
    return False


def active_writer(url: str | os.PathLike[str] | StoreLocation) -> str | None:
    """The one-line "being written by ..." message when a writer holds the lock on ``url`` now (a
    record left by a dead one does not count), else None; takes and creates nothing."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    if not loc.is_local:
        holder = read_holder(loc)
        if holder is None or (holder.same_machine() and not holder.alive()):
            return None
        return held_message(loc, holder)
    try:
        fd = os.open(loc.path(LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return held_message(loc, WriterLock._read_record_local(fd, settle=True))
        return None  # free: nobody writes (the shared lock goes with the descriptor)
    finally:
        os.close(fd)


def read_holder(url: str | os.PathLike[str] | StoreLocation) -> Holder | None:
    """The record of the lock on ``url`` (None when there is none or it is unreadable); takes nothing."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    if loc.is_local:
        data = loc.read_if_regular(LOCK_NAME, _MAX_RECORD)
        return None if data is None else Holder.from_json(data)
    probe = WriterLock(loc, "", _log_nothing)
    return probe._read_record_s3()[0]


# --------------------------------------------------------------------------------------- holding it

# Locks this thread holds or runs under, by store URL: nested users (run_ingest, then
# ingest_prompts) share one, and the outermost releases it.  Per thread: two threads of one process
# ingesting one store are two writers, and the second is refused like another process.
_HELD = threading.local()


def _held() -> dict[str, int]:
    if not hasattr(_HELD, "urls"):
        _HELD.urls = {}
    urls: dict[str, int] = _HELD.urls
    return urls


def holding(url: str) -> bool:
    """Whether this thread holds (or runs under) the writer lock of ``url``."""
    return _held().get(url, 0) > 0


@contextlib.contextmanager
def _registered(url: str) -> Iterator[None]:
    held = _held()
    held[url] = held.get(url, 0) + 1
    try:
        yield
    finally:
        held[url] -= 1
        if not held[url]:
            del held[url]


class _Terminated(SystemExit):
    pass


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (torchrun stopping a rank, ``kill``) unwinds the stack like an exception, so ``finally``
    blocks release the lock; the previous handler is put back after."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def unwind(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block is done (taking or letting go of the lock is short)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def writer_lock(
    url: str | os.PathLike[str] | StoreLocation,
    *,
    command: str = "actstore ingest",
    log: Callable[[str], None] = _log_nothing,
) -> Iterator[WriterLock | None]:
    """Hold the writer lock of a store for the ``with`` block (re-entrant within a thread).

    Yields the lock this call took, or None when this process already holds the lock (or runs
    under a launcher's, see :func:`under_launcher`).  Raises :class:`StoreLockedError`, with one
    line naming the holder, when another writer has it.
    """
    loc = url if isinstance(url, StoreLocation) else locate(url)
    if holding(loc.url):
        with _registered(loc.url):
            yield None
        return
    lock = WriterLock(loc, command, log)
    with _sigterm_unwinds():
        try:
            with _signals_deferred():  # (a signal inside would leave a record with no holder to remove it;
                lock.acquire()  # one that arrived meanwhile is raised on leaving, and released below)
            with _registered(loc.url):
                yield lock
        finally:
            with _signals_deferred():
                lock.release()  # nothing when it was not taken


@contextlib.contextmanager
def under_launcher(url: str | os.PathLike[str] | StoreLocation, token: str) -> Iterator[None]:
    """Run under the lock a launcher holds (``token`` from ``ACTSTORE_WRITER_LOCK``): checked, not taken."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    holder = read_holder(loc)
    if holder is None or holder.token != token:
        who = f"it is held by {holder.describe()}" if holder else "no lock is held"
        raise StoreLockedError(
            f"{loc.url}: this process was started to run under the writer lock of its launcher "
            f"({LOCK_ENV}), but {who}"
        )
    with _registered(loc.url):
        yield


@contextlib.contextmanager
def held_by_peer(url: str | os.PathLike[str] | StoreLocation) -> Iterator[None]:
    """Run under a lock another process of the same job holds for this one (rank 0 of a torchrun
    group, which said so over the process group)."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    with _registered(loc.url):
        yield
