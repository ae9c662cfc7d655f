"""actstore: an activation store and query engine for interpretability research on language models.

>>> import actstore, tempfile
>>> path = tempfile.mkdtemp() + "/store"
>>> s = actstore.ingest_corpus(path, model="tiny-llama", dataset="demo")  # or `actstore ingest`
>>> s = actstore.open(path)
>>> s.sql("SELECT count(*) AS n FROM examples WHERE relation_id = ?", ["city_country"]).to_pylist()
[{'n': 72}]
>>> sel = s.select().relations(["city_country", "country_capital"]).sample(100, seed=0)  # lazy
>>> train, test = sel.split((0.8, 0.2), seed=1)
>>> train.features("attn_head", layers=[0, 1]).shape  # numpy [rows, layers, heads, d_model]
(80, 2, 4, 64)
>>> test.to_xarray("attn_head_token", layers=[1]).dims  # labelled dimensions and coordinates
('row', 'layer', 'head', 'source', 'd_model')
>>> len(actstore.FeatureDataset(train, "attn_head", layers=[1]))  # a torch Dataset, streamed
80

(``tests/integration/core/test_doctests.py`` runs these examples.)

docs/api.md describes the Python API.  This module is the facade (docs/architecture.md): it sits on
top of the store core, ``query`` and ``ingest`` and imports the heavy layers only when a function
needs them (``import actstore`` loads no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actstore.api import Store, ingest_corpus, open_store, write_corpus
from actstore.core._version import __version__
from actstore.core.errors import (
    ActstoreError,
    CorruptStoreError,
    EmptySelectionWarning,
    FormatVersionError,
    QueryError,
    ReadOnlySQLError,
    StorageError,
    StoreExistsError,
    StoreMismatchError,
    StoreNotFoundError,
)
from actstore.core.manifest import FORMAT_VERSION, Geometry, Manifest

open = open_store  # noqa: A001  (``actstore.open(path)`` is the documented entry point)

if TYPE_CHECKING:
    from actstore.query.select.feature_dataset import FeatureDataset
    from actstore.query.select.selection import Selection


def __getattr__(name: str) -> Any:
    """``actstore.Selection`` and ``actstore.FeatureDataset``, imported on first use (they load torch;
    ``import actstore`` does not)."""
    if name == "Selection":
        from actstore.query.select.selection import Selection

        return Selection
    if name == "FeatureDataset":
        from actstore.query.select.feature_dataset import FeatureDataset

        return FeatureDataset
    raise AttributeError(f"module 'actstore' has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "ActstoreError",
    "CorruptStoreError",
    "EmptySelectionWarning",
    "FeatureDataset",
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
    "ingest_corpus",
    "open",
    "write_corpus",
]
