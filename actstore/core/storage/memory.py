"""A store in fsspec's in-process memory file system (``memory://name``): for tests and throwaway
stores.  Reads and writes are :class:`ObjectLocation`'s (fsspec's memory file system is shared by
the whole process); the writer lock is held in this process."""

from __future__ import annotations

import threading

from actstore.core.storage.base import LockPolicy, LockSlot, LockState
from actstore.core.storage.objects import ObjectLocation

_HELD: dict[str, bytes] = {}  # the memory locks held in this process: path -> record
_GUARD = threading.Lock()


class MemoryLocation(ObjectLocation):
    """A store root in fsspec's ``MemoryFileSystem``."""

    def lists_cheaply(self) -> bool:
        return True  # a dictionary, not a request

    def lock_slot(self, name: str, policy: LockPolicy, max_record: int) -> LockSlot:
        return MemoryLockSlot(self, name, policy, max_record)


class MemoryLockSlot(LockSlot):
    """The lock object, with this process's table of held locks as the kernel lock of a local store:
    a record in the object whose lock is not held is a dead writer's."""

    def __init__(self, loc: MemoryLocation, name: str, policy: LockPolicy, max_record: int) -> None:
        super().__init__(loc, name, policy, max_record)
        self._held = False

    def held(self) -> bool:
        return self._held

    def acquire(self, record: bytes) -> None:
        with _GUARD:
            if self.key in _HELD:
                self.policy.refuse_held(_HELD[self.key])
            left = self.read()
            if left is not None:
                self.policy.judge(left, free=True)
            self.loc.fs.pipe_file(self.key, record)
            _HELD[self.key] = record
            self._held = True

    def release(self) -> None:
        with _GUARD:
            if not self._held:
                return
            self._held = False
            del _HELD[self.key]
            if self.loc.fs.exists(self.key):
                self.loc.fs.rm(self.key)

    def state(self) -> tuple[LockState, bytes | None]:
        with _GUARD:
            record = _HELD.get(self.key)
        return ("free", None) if record is None else ("held", record)
