"""The public facade: the store as researchers use it, on top of the core, ``query`` and ``ingest``.

:class:`Store` is the core :class:`actstore.store.Store` (manifest, arrays, weights, tables, SQL)
plus the methods that need the query layer.  ``actstore.open`` returns one.  The layers below
never import this module (docs/architecture.md; enforced by import-linter, ``make lint``).

The query layer is imported when a method needs it, not when this module is: ``import actstore``
(and the command line's ``--help``) does not load torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from actstore.fs import locate
from actstore.store import Store as CoreStore

if TYPE_CHECKING:
    from query.selection import Selection


class Store(CoreStore):
    """A read-only view of a store (see :class:`actstore.store.Store`), with selections of its rows."""

    def select(self, where: str | None = None, *, query: str | None = None,
               params: dict[str, Any] | list[Any] | None = None) -> Selection:
        """The target rows whose example matches ``where`` (one SQL expression over ``examples``) or
        whose ``example_id`` the SELECT ``query`` returns; all rows when both are None.
        ``params``: values for the placeholders of ``where`` / ``query`` (bound by DuckDB)::

            store.select("relation_id = $rel AND split = 'val'", params={"rel": "P17"})
        """
        from query.selection import Selection

        return Selection.from_sql(self, where=where, query=query, params=params)


def open_store(url: str | os.PathLike[str]) -> Store:
    """Open an existing store (local path or URL) for reading."""
    return Store(locate(url))


def tokenizer_for_store(store: CoreStore, name: str | None = None) -> Any:
    """The tokenizer of ``store``'s model, or ``name``'s (a folder, a hub name, or one of actstore's
    model aliases such as ``tiny-llama`` or ``smollm2-135m``).

    A store holds its model's tokenizer since it was ingested (:func:`query.store_tokenizer.
    tokenizer_for_store` reads it).  The aliases, and stores written before tokenizers were saved
    whose manifest names an alias, are resolved through the model registry of ``ingest``, which is
    why this lives in the facade and not in ``query``.
    """
    from ingest.alias_tokenizer import alias_tokenizer
    from query.store_tokenizer import check_vocabulary
    from query.store_tokenizer import tokenizer_for_store as from_store

    weight_hash = str(store.manifest.model.get("weight_hash") or "")
    key = name.strip() if name is not None and name.strip() else None
    if key is None and not store.has_tokenizer():
        key = str(store.manifest.model.get("name") or "").strip() or None
        if key is not None:
            tok = alias_tokenizer(key, weight_hash)
            if tok is not None:
                return check_vocabulary(store, tok, key)
        return from_store(store)  # the error naming what is missing
    if key is not None and not os.path.isdir(os.path.expanduser(key)):
        tok = alias_tokenizer(key, weight_hash)
        if tok is not None:
            return check_vocabulary(store, tok, key)
    return from_store(store, key)
