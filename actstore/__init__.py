"""actstore: an activation store and query engine for interpretability research on language models.

>>> import actstore
>>> s = actstore.open("/tmp/s")                        # a store written by ``actstore ingest``
>>> s.sql("SELECT relation_name, count(*) FROM examples GROUP BY 1")
>>> s.select("relation_id = 'P17'").features("attn_head", layers=[3, 4])
"""

from __future__ import annotations

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
from actstore.store import Store, open_store

__version__ = "0.1.0"

open = open_store  # noqa: A001  (``actstore.open(path)`` is the documented entry point)

__all__ = [
    "FORMAT_VERSION",
    "ActstoreError",
    "CorruptStoreError",
    "FormatVersionError",
    "Geometry",
    "Manifest",
    "QueryError",
    "ReadOnlySQLError",
    "StorageError",
    "Store",
    "StoreExistsError",
    "StoreMismatchError",
    "StoreNotFoundError",
    "__version__",
    "open",
]
