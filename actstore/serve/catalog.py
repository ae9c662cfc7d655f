"""The stores an explorer serves: one per name, opened read-only once, with a lock each.

A name is the store folder's base name made URL-safe (letters, digits, ``.``, ``_``, ``-``); two
stores of the same base name get ``-2``, ``-3``.  A folder that is not a store itself is searched one
level down for stores (``actstore serve runs/``).
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from actstore.core.errors import NotFoundError, StoreNotFoundError
from actstore.core.storage import locate
from actstore.core.store import StoreReader

MANIFEST = "manifest.json"
NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def _safe_name(url: str) -> str:
    base = url.rstrip("/").rsplit("/", 1)[-1] or "store"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:80].strip(".") or "store"
    return name


def _is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def discover(paths: Iterable[str]) -> list[str]:
    """The store locations named by ``paths``: each a store, or a local folder holding stores one level down."""
    out: list[str] = []
    for p in paths:
        if "://" not in p and os.path.isdir(p) and not _is_store(p):
            found = sorted(os.path.join(p, d) for d in os.listdir(p) if _is_store(os.path.join(p, d)))
            if not found:
                raise StoreNotFoundError(f"no actstore store at {p} nor in its sub-folders")
            out += found
        else:
            out.append(p)
    return out


class Kept(OrderedDict[Any, Any]):
    """A mapping that keeps its ``size`` most recently used entries (the trained probe episodes); safe
    to use from several threads at once (requests run in parallel)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self._lock = threading.RLock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if key in self:
                self.move_to_end(key)
                return self[key]
            return default

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            while len(self) > self.size:
                self.popitem(last=False)


@dataclass
class Served:
    """One store and its caches.  Requests to it run in parallel, each on threads of its own: the
    store's SQL statements each on a DuckDB cursor of their own (:class:`actstore.core.sql_session.SQLSession`),
    its arrays read by offset; the caches here are guarded by a lock held only to look up and store
    (a value is built outside it, so two requests for the same new view may both build it)."""

    name: str
    store: StoreReader
    lock: threading.RLock = field(default_factory=threading.RLock)  # the caches' lock
    cache: OrderedDict[Any, Any] = field(default_factory=OrderedDict)
    cache_size: int = 64
    #: trained probe episodes (about 2 MB each for SmolLM2 on FewRel): another query of one is explained
    #: without training it again
    episodes: Kept = field(default_factory=lambda: Kept(32))

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` (the store does not change under the explorer), least recently used dropped."""
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        value = build()
        with self.lock:
            self.cache[key] = value
            self.cache.move_to_end(key)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return value


class Catalog:
    """The served stores by name, in the order given."""

    def __init__(self, stores: dict[str, StoreReader]) -> None:
        if not stores:
            raise StoreNotFoundError("no store to serve")
        self._served = {n: Served(n, s) for n, s in stores.items()}

    @classmethod
    def open(cls, paths: Iterable[str]) -> Catalog:
        """Open every store named by ``paths`` (see :func:`discover`) read-only."""
        stores: dict[str, StoreReader] = {}
        for url in discover(paths):
            store = StoreReader(locate(url))
            name, n = _safe_name(store.url), 2
            while name in stores:
                name, n = f"{_safe_name(store.url)}-{n}", n + 1
            stores[name] = store
        return cls(stores)

    @property
    def names(self) -> list[str]:
        return list(self._served)

    def get(self, name: str) -> Served:
        """The store called ``name``; a :class:`NotFoundError` (404) for any other text."""
        if not isinstance(name, str) or not NAME.match(name) or name not in self._served:
            raise NotFoundError(f"no store named {name[:60]!r} is served (known: {', '.join(self.names)})")
        return self._served[name]

    def __iter__(self) -> Any:
        return iter(self._served.values())
