"""One writer per store: an exclusive lock held for a whole ingest (create, ``--overwrite``, ``--resume``).

The lock is the object ``.actstore-writer.lock`` inside the store root.  It holds a JSON record
naming its holder (host, pid, process start, wall-clock start, a random token), so a second
writer fails with one line saying who writes the store.  Readers never look at it.

The store's backend takes the lock object (:meth:`StoreLocation.lock_slot`): a local directory
with ``flock`` on the lock file, which the kernel drops when the holder dies, however it dies
(:mod:`actstore.core.storage.local`); S3 with conditional PUTs, ``If-None-Match: *`` to create the
record and ``If-Match: <ETag>`` to replace or delete it (:mod:`actstore.core.storage.s3`).  This
module is the policy the backend asks (:class:`WriterLock`): a record left by a dead holder
(SIGKILL, power loss) is detected by host and pid: on the same host, with the pid gone (or reused,
seen from its start time in ``/proc``), the next writer takes over and logs it; a record from
another host is refused, since this host cannot tell whether that writer still runs.

Several processes under one lock (``actstore ingest --procs N``): the launcher takes the lock
and passes its token to the ranks in ``ACTSTORE_WRITER_LOCK``; a rank checks that the record
still carries that token and runs under it (:func:`under_launcher`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

from actstore.core.errors import StorageError, StoreLockedError
from actstore.core.lock_holder import Holder
from actstore.core.progress import say_nothing
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation

LOCK_NAME = ".actstore-writer.lock"
LOCK_ENV = "ACTSTORE_WRITER_LOCK"  # token of the lock a launcher holds for its ranks
_MAX_RECORD = 64 * 1024


def held_message(loc: StoreLocation, holder: Holder | None) -> str:
    who = holder.describe() if holder else "another writer (its record is not readable yet)"
    return f"{loc.url} is being written by another ingest: {who}; wait for it to finish, or stop it"


# --------------------------------------------------------------------------------------- the lock


class WriterLock:
    """The exclusive writer lock of one store.  Use :func:`writer_lock`.

    The store's backend takes and lets go of the lock object (:meth:`StoreLocation.lock_slot`); this
    class is the :class:`~actstore.core.storage.base.LockPolicy` it asks: what a record means, and
    whose record may be replaced."""

    def __init__(self, loc: StoreLocation, command: str, log: Callable[[str], None]) -> None:
        self.loc = loc
        self.holder = Holder.me(command)
        self.log = log
        self._slot = loc.lock_slot(LOCK_NAME, self, _MAX_RECORD)

    @property
    def token(self) -> str:
        return self.holder.token

    def inheritable_fds(self) -> tuple[int, ...]:
        """File descriptors a child process may inherit so the lock outlives this one (local stores)."""
        return self._slot.inheritable_fds()

    def acquire(self) -> None:
        self._slot.acquire(self.holder.to_json())

    def release(self) -> None:
        self._slot.release()

    def holds(self) -> bool:
        return self._slot.held()

    # ---- the policy (LockPolicy)
    def complete(self, record: bytes) -> bool:
        return Holder.from_json(record) is not None

    def mine(self, record: bytes | None) -> bool:
        holder = None if record is None else Holder.from_json(record)
        return holder is not None and holder.token == self.holder.token

    def refuse_held(self, record: bytes | None) -> NoReturn:
        raise StoreLockedError(held_message(self.loc, None if record is None else Holder.from_json(record)))

    def judge(self, record: bytes, *, free: bool) -> None:
        """A record is there: take over only from a holder proven dead (``free``: the storage says no
        writer holds the lock; otherwise only a holder on this host can be proven dead)."""
        where = self._slot.where
        previous = Holder.from_json(record)
        if previous is None:
            raise StorageError(
                f"{where} holds something that is not an actstore lock record; "
                "delete it if no ingest writes this store"
            )
        if previous.token == self.holder.token:
            return
        if not previous.same_machine():
            if free:
                raise StoreLockedError(
                    f"{self.loc.url} has a writer lock from {previous.describe()}; this host cannot tell "
                    f"whether that ingest still runs: if it does not, delete {where}"
                )
            raise StoreLockedError(
                f"{held_message(self.loc, previous)} (if that ingest no longer runs, delete {where})"
            )
        if previous.alive():
            raise StoreLockedError(held_message(self.loc, previous))
        self.log(
            f"taking over the writer lock of {self.loc.url} from {previous.describe()}: that process is gone"
        )


def active_writer(url: str | os.PathLike[str] | StoreLocation) -> str | None:
    """The one-line "being written by ..." message when a writer holds the lock on ``url`` now (a
    record left by a dead one does not count), else None; takes and creates nothing."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    state, record = WriterLock(loc, "", say_nothing)._slot.state()
    if state == "free":
        return None
    holder = None if record is None else Holder.from_json(record)
    if state == "unknown" and (holder is None or (holder.same_machine() and not holder.alive())):
        return None
    return held_message(loc, holder)


def read_holder(url: str | os.PathLike[str] | StoreLocation) -> Holder | None:
    """The record of the lock on ``url`` (None when there is none or it is unreadable); takes nothing."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    record = WriterLock(loc, "", say_nothing)._slot.read()
    return None if record is None else Holder.from_json(record)


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
    log: Callable[[str], None] = say_nothing,
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
