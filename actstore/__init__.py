"""actstore: an activation store and query engine for interpretability research on language models.

>>> import actstore
>>> s = actstore.open("/tmp/s")                        # a store written by ``actstore ingest``
>>> s.sql("SELECT relation_name, count(*) FROM examples GROUP BY 1")
>>> s.sql("SELECT count(*) AS n FROM examples WHERE relation_id = ?", ["P17"])
>>> s.select("relation_id = 'P17'").features("attn_head", layers=[3, 4])

This module is the facade (docs/architecture.md): it sits on top of the store core, ``query`` and
``ingest`` and imports the heavy layers only when a function needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actstore._version import __version__
from actstore.api import Store, open_store
from actstore.errors import (
    ActstoreError,
    CorruptStoreError,
    FormatVersionError,
    QueryError,
    ReadOnlySQLError,
    StorageError,
    StoreExistsError,
    StoreMismatchError,
    StoreNotFoundError,
)
from actstore.manifest import FORMAT_VERSION, Geometry, Manifest

open = open_store  # noqa: A001  (``actstore.open(path)`` is the documented entry point)

if TYPE_CHECKING:
    from query.selection import Selection


def __getattr__(name: str) -> Any:
    """``actstore.Selection``, imported on first use (it loads torch; ``import actstore`` does not)."""
    if name == "Selection":
        from query.selection import Selection

        return Selection
    raise AttributeError(f"module 'actstore' has no attribute {name!r}")

__all__ = [
    "FORMAT_VERSION",
    "ActstoreError",
    "CorruptStoreError",
    "FormatVersionError",
    "Geometry",
    "Manifest",
    "QueryError",
    "ReadOnlySQLError",
    "Selection",
    "StorageError",
    "Store",
    "StoreExistsError",
    "StoreMismatchError",
    "StoreNotFoundError",
    "__version__",
    "open",
]
