"""The limits of one SQL statement: memory (DuckDB's ``memory_limit``, plus a cap on how far the
process may grow while the statement runs) and time; defaults, per call, and per block of code
(:func:`limits`).  Used by :mod:`actstore.core.sql`, which documents the whole sandbox."""

from __future__ import annotations

import re
import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from actstore.core.errors import QueryError

DEFAULT_MEMORY_LIMIT = "4GB"
DEFAULT_TIMEOUT = 600.0  # seconds

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def size_bytes(text: str) -> int:
    """``"512MB"`` -> 512_000_000 (DuckDB's units: KB/MB/GB powers of 1000, KiB/MiB/GiB of 1024)."""
    m = _SIZE.match(check_memory_limit(text))
    assert m is not None
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_memory_limit(text: str) -> str:
    """``text`` if it is a size DuckDB understands (``512MB``, ``4GB``, ``1.5GiB``), else a QueryError."""
    if not isinstance(text, str) or not _SIZE.match(text):
        raise QueryError(f"SQL memory limit {text!r} is not a size like 512MB or 4GB")
    return text.strip()


@dataclass(frozen=True)
class SQLLimits:
    """What one SQL statement may use.  ``timeout``: seconds, ``None`` for no time limit."""

    memory_limit: str = DEFAULT_MEMORY_LIMIT
    timeout: float | None = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        check_memory_limit(self.memory_limit)
        if self.timeout is not None and not self.timeout > 0:
            raise QueryError(f"SQL time limit must be a positive number of seconds (got {self.timeout!r})")


_LIMITS: ContextVar[SQLLimits | None] = ContextVar("actstore_sql_limits", default=None)  # None: the defaults


def current_limits(memory_limit: str | None = None, timeout: float | None = None) -> SQLLimits:
    """The limits in force (see :func:`limits`), with ``memory_limit`` / ``timeout`` overriding them."""
    lim = _LIMITS.get() or SQLLimits()
    if memory_limit is not None:
        lim = replace(lim, memory_limit=memory_limit)
    if timeout is not None:
        lim = replace(lim, timeout=None if timeout == 0 else timeout)  # a negative one is refused
    return lim


@contextmanager
def limits(memory_limit: str | None = None, timeout: float | None = None) -> Iterator[SQLLimits]:
    """Run every SQL statement inside the block with these limits (``timeout=0``: no time limit).

    >>> with actstore.core.sql_limits.limits(memory_limit="1GB", timeout=30):
    ...     len(store.select("relation_id = 'city_country'"))
    72
    """
    token = _LIMITS.set(current_limits(memory_limit, timeout))
    try:
        yield current_limits()
    finally:
        _LIMITS.reset(token)


# DuckDB's memory_limit covers its buffer manager (hash tables, sorts, materialised results), not the
# vectors a scalar function fills: range(1000000000) builds an 8 GB list whatever the limit.  So while a
# statement runs, the process's data segment (RLIMIT_DATA: heap and private mappings, Linux) may grow by
# at most GROWTH_FACTOR x the memory limit + GROWTH_SLACK (the result as Arrow, data in flight); an
# allocation past that fails and DuckDB ends the statement with its out-of-memory error.
GROWTH_FACTOR = 2
GROWTH_SLACK = 256 << 20


def _data_bytes() -> int | None:
    """The process's data segment in bytes (VmData), None where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _GrowthCap:
    """RLIMIT_DATA set to (data segment when the first statement started) + the sum of the running
    statements' allowances; restored when the last one ends.  A no-op without RLIMIT_DATA or /proc."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.budget = 0
        self.saved: tuple[int, int] | None = None

    def _apply(self) -> None:

        assert self.saved is not None
        soft, hard = self.saved
        cap = self.budget
        for other in (soft, hard):  # never looser than a limit the user set
            if other != resource.RLIM_INFINITY:
                cap = min(cap, other)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))

    def _enter(self, extra: int) -> bool:
        try:
            import resource
        except ImportError:
            return False
        with self.lock:
            if self.active == 0:
                now = _data_bytes()
                if now is None:
                    return False
                self.saved = resource.getrlimit(resource.RLIMIT_DATA)
                self.budget = now
            self.budget += extra
            self.active += 1
            self._apply()
        return True

    def _exit(self, extra: int) -> None:

        with self.lock:
            self.active -= 1
            self.budget -= extra
            if self.active == 0:
                assert self.saved is not None
                resource.setrlimit(resource.RLIMIT_DATA, self.saved)
                self.saved = None
            else:
                self._apply()

    @contextmanager
    def __call__(self, extra: int) -> Iterator[None]:
        entered = self._enter(extra)
        try:
            yield
        finally:
            if entered:
                self._exit(extra)


_process_growth_cap = _GrowthCap()
