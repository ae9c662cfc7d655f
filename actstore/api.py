"""The public facade: the store as researchers use it, on top of the core, ``query`` and ``ingest``.

:class:`Store` is the core :class:`actstore.core.store.Store` (manifest, arrays, weights, tables, SQL)
plus the methods that need the query layer.  ``actstore.open`` returns one.  The layers below
never import this module (docs/architecture.md; enforced by import-linter, ``make lint``).

The query layer is imported when a method needs it, not when this module is: ``import actstore``
(and the command line's ``--help``) does not load torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from actstore.core.errors import ActstoreError, QueryError
from actstore.core.fs import locate
from actstore.core.sql import Params
from actstore.core.store import Store as CoreStore

if TYPE_CHECKING:
    import duckdb
    import pandas as pd
    import pyarrow as pa

    from actstore.query.selection import Selection


class Store(CoreStore):
    """A read-only view of a store (see :class:`actstore.core.store.Store`), with selections of its rows."""

    def select(
        self,
        where: str | None = None,
        *,
        query: str | None = None,
        params: dict[str, Any] | list[Any] | None = None,
    ) -> Selection:
        """The target rows whose example matches ``where`` (one SQL expression over ``examples``) or
        whose ``example_id`` the SELECT ``query`` returns; all rows when both are None.
        ``params``: values for the placeholders of ``where`` / ``query`` (bound by DuckDB)::

            store.select("relation_id = $rel AND split = 'val'", params={"rel": "P17"})
        """
        from actstore.query.selection import Selection

        return Selection.from_sql(self, where=where, query=query, params=params)

    @overload
    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: Literal["arrow"] = "arrow",
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> pa.Table: ...

    @overload
    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: Literal["pandas"],
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> pd.DataFrame: ...

    @overload
    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: Literal["relation"],
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> duckdb.DuckDBPyRelation: ...

    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: str = "arrow",
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> pa.Table | pd.DataFrame | duckdb.DuckDBPyRelation:
        """Run one read-only SELECT over the store's tables (:meth:`actstore.core.store.Store.sql`):
        ``format="arrow"`` (a ``pyarrow.Table``, the default) or ``"pandas"`` run it now, within the
        limits; ``"relation"`` returns a lazy ``duckdb.DuckDBPyRelation`` over the same locked-down
        connection, to refine before anything runs (``.filter()``, ``.aggregate()``, ``.limit()``)
        and read with ``.arrow()``, ``.df()`` or ``.fetchall()``.  A relation runs when read, under
        the connection's memory limit but without the time limit.  ``params`` are bound by DuckDB::

            store.sql("SELECT * FROM examples WHERE relation_id = ?", ["P17"], format="relation").limit(5).df()
        """
        if format != "relation":
            return super().sql(
                query,
                params,
                format=format,  # type: ignore[call-overload]
                memory_limit=memory_limit,
                timeout=timeout,
            )
        import duckdb

        from actstore.core.sql import check_params, check_read_only, connect, current_limits

        stmt = check_read_only(query)
        con = connect(self, memory_limit=current_limits(memory_limit, timeout).memory_limit)
        try:
            return con.sql(stmt, params=check_params(params))
        except duckdb.Error as e:
            raise QueryError(f"SQL error: {' '.join(str(e).split())}") from None


def open_store(url: str | os.PathLike[str]) -> Store:
    """Open an existing store (local path or URL) for reading."""
    return Store(locate(url))


def ingest_corpus(
    out: str | os.PathLike[str],
    *,
    model: str = "smollm2-135m",
    dataset: str = "demo",
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
    storage_dtype: str = "float16",
    batch_size: int = 16,
    segment_size: int = 256,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    **options: Any,
) -> Store:
    """Run ``model`` once over ``dataset`` and write a store at ``out`` (a path or URL); returns it, open.

    ``model``: an alias (``tiny-llama``, ``smollm2-135m``, ...) or a hub name / folder; ``dataset``: a
    name (``demo``, ``fewrel``, ``lre``, ...) or ``kind:PATH``.  ``options``: any other field of
    :class:`actstore.jobs.ingest.IngestRequest` (``template``, ``model_dtype``, ``padding_side``, ``threads``,
    ...).  The same as ``actstore ingest`` on the command line::

        store = actstore.ingest_corpus("/tmp/s", model="tiny-llama", dataset="demo", limit_per_relation=4)
    """
    from dataclasses import fields

    from actstore.jobs.ingest import IngestRequest, run_ingest

    known = {f.name for f in fields(IngestRequest)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ActstoreError(
            f"ingest_corpus() got unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    req = IngestRequest(
        model=model,
        dataset=dataset,
        out=os.fspath(out),
        relations=list(relations) if relations is not None else None,
        limit_per_relation=limit_per_relation,
        storage_dtype=storage_dtype,
        batch_size=batch_size,
        segment_size=segment_size,
        device=device,
        resume=resume,
        overwrite=overwrite,
        progress=progress,
        **options,
    )
    run_ingest(req)
    return open_store(out)


def tokenizer_for_store(store: CoreStore, name: str | None = None) -> Any:
    """The tokenizer of ``store``'s model, or ``name``'s (a folder, a hub name, or one of actstore's
    model aliases such as ``tiny-llama`` or ``smollm2-135m``).

    A store holds its model's tokenizer since it was ingested (:func:`actstore.query.store_tokenizer.
    tokenizer_for_store` reads it).  The aliases, and stores written before tokenizers were saved
    whose manifest names an alias, are resolved through the model registry of ``ingest``, which is
    why this lives in the facade and not in ``query``.
    """
    from actstore.ingest.alias_tokenizer import alias_tokenizer
    from actstore.query.store_tokenizer import check_vocabulary
    from actstore.query.store_tokenizer import tokenizer_for_store as from_store

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
