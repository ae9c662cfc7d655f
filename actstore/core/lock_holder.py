"""Who holds a writer lock: the record written into it (host, pid, pid namespace, process start,
token, command) and the liveness check that decides whether a record left behind is stale."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass

RECORD_KIND = "actstore-writer-lock"


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where unknown): containers sharing a host name
    but not pids are different hosts for the liveness check."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return text[text.rindex(")") + 2 :].split()[0] == "Z"
    except (OSError, ValueError, IndexError):
        return False


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock when it is taken."""

    host: str
    pid: int
    pid_ns: int  # pid namespace inode (0: unknown)
    proc_start: int | None  # the process's start in clock ticks since boot (None: unknown)
    started: float  # wall clock, seconds since the epoch
    token: str
    command: str

    @classmethod
    def me(cls, command: str) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_ns=_pid_namespace(),
            proc_start=_process_start(os.getpid()),
            started=time.time(),
            token=secrets.token_hex(16),
            command=command,
        )

    def to_json(self) -> bytes:
        return json.dumps({"kind": RECORD_KIND, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder | None:
        """The record, or None for anything that is not a complete actstore lock record."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("kind") != RECORD_KIND:
                return None
            host, pid, ns, start, started, token, command = (
                d["host"],
                d["pid"],
                d["pid_ns"],
                d["proc_start"],
                d["started"],
                d["token"],
                d["command"],
            )
            if not (isinstance(host, str) and isinstance(token, str) and isinstance(command, str)):
                return None
            if any(type(v) is not int for v in (pid, ns)) or not 0 < pid < 2**31:
                return None
            if start is not None and type(start) is not int:
                return None
            if type(started) not in (int, float):
                return None
            return cls(host[:200], pid, ns, start, float(started), token[:64], command[:200])
        except (ValueError, KeyError, TypeError, RecursionError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        what = f" ({self.command})" if self.command else ""
        return f"pid {self.pid} on host {self.host}, since {when}{what}"

    def same_machine(self) -> bool:
        mine = _pid_namespace()
        return self.host == socket.gethostname() and (self.pid_ns == mine or 0 in (self.pid_ns, mine))

    def alive(self) -> bool:
        """Whether the holder process still runs (only meaningful on :meth:`same_machine`)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        if _zombie(self.pid):
            return False
        now = _process_start(self.pid)
        return self.proc_start is None or now is None or now == self.proc_start  # else: the pid was reused
