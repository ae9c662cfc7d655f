"""The prompts of a store, paged: of a relation or all, in example order, or searched by text with a
bounded cost per request (:func:`search_page`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.serve.common import (
    MAX_PAGE_SIZE,
    SQL_TIMEOUT,
    columns,
    example_ids,
    id_ranges,
    jsonable,
    kept,
    sql,
)

#: A text search reads the examples of at most this many example ids per request (in blocks of
#: SEARCH_BLOCK, stopping once a page is full), and says where to go on: its cost is bounded by it,
#: not by the store's size.
SEARCH_BUDGET = 100_000
SEARCH_BLOCK = 25_000


def prompts_page(
    store: StoreReader, rel: str | None, text: str | None, page: int, size: int, after: int | None = None
) -> dict[str, Any]:
    """One page of prompts of a relation (or all), in example order.  With ``text``: the prompts
    containing it (case-insensitive), found by :func:`search_page` from ``after`` on."""
    if len(text or "") > 200:
        raise QueryError("search text is at most 200 characters")
    size = min(size, MAX_PAGE_SIZE)
    if text:
        return search_page(store, rel, text, after, size)
    ids = example_ids(store) if rel is None else relation_ids(store).get(rel, np.zeros(0, np.int64))
    return jsonable(
        {
            "total": int(ids.size),
            "page": page,
            "size": size,
            "rows": examples_by_id(store, ids[page * size : (page + 1) * size]),
        }
    )


def relation_ids(store: StoreReader) -> dict[str, np.ndarray]:
    """relation_id -> its example ids, sorted (read once, kept while the examples' files stay the same):
    a page of a relation's prompts is then a slice of ids, read by their id range."""

    def build() -> dict[str, np.ndarray]:
        t = store.sql("SELECT relation_id, example_id FROM examples ORDER BY 2", timeout=SQL_TIMEOUT)
        rel = t.column(0).to_numpy(zero_copy_only=False).astype(str)
        ids = np.asarray(t.column(1).to_numpy(), dtype=np.int64)
        return {str(r): ids[rel == r] for r in np.unique(rel)}

    return kept(store, "relation_ids", ("examples",), build)  # type: ignore[no-any-return]


def examples_by_id(store: StoreReader, ids: np.ndarray) -> list[dict[str, Any]]:
    """The prompt columns of examples ``ids`` (sorted), read from their id ranges only."""
    if ids.size == 0:
        return []
    cols = _prompt_columns(store)
    return sql(
        store,
        f"SELECT {', '.join(cols)} FROM examples WHERE {id_ranges(ids)} "
        "AND list_contains(?, example_id) ORDER BY example_id",
        [[int(i) for i in ids.tolist()]],
    )


def _prompt_columns(store: StoreReader) -> list[str]:
    have = columns(store, "examples")
    return [c for c in ("example_id", "relation_id", "text", "subject", "object") if c in have]


def search_page(
    store: StoreReader, rel: str | None, text: str, after: int | None, size: int
) -> dict[str, Any]:
    """Up to ``size`` prompts containing ``text`` after example id ``after``, reading at most
    :data:`SEARCH_BUDGET` example ids' rows.  ``next``: the id to go on after (None at the end);
    ``matched``: the matches among the ids searched; ``total``: every match, when this request
    searched the whole store from its start."""
    ids = example_ids(store)
    start = 0 if after is None else int(np.searchsorted(ids, after, side="right"))
    cols = _prompt_columns(store)
    cond, params = "contains(lower(text), lower(?))", [text]
    if rel is not None:
        cond, params = cond + " AND relation_id = ?", [text, rel]
    rows: list[dict[str, Any]] = []
    matched, pos, stop = 0, start, min(ids.size, start + SEARCH_BUDGET)
    while pos < stop and len(rows) <= size:
        end = min(stop, pos + SEARCH_BLOCK)
        got = sql(
            store,
            f"SELECT {', '.join(cols)}, count(*) OVER () AS n_matched FROM examples "
            f"WHERE example_id BETWEEN ? AND ? AND {cond} ORDER BY example_id LIMIT ?",
            [int(ids[pos]), int(ids[end - 1]), *params, size + 1 - len(rows)],
        )
        matched += int(got[0]["n_matched"]) if got else 0
        rows += [{k: v for k, v in r.items() if k != "n_matched"} for r in got]
        pos = end
    full = len(rows) > size
    rows = rows[:size]
    if full:
        nxt: int | None = int(rows[-1]["example_id"])
    else:
        nxt = int(ids[pos - 1]) if pos < ids.size else None
    whole = start == 0 and pos >= ids.size
    return jsonable(
        {
            "total": matched if whole else None,
            "matched": matched,
            "searched": int(pos - start),
            "of": int(ids.size),
            "after": after,
            "next": nxt,
            "size": size,
            "rows": rows,
        }
    )
