"""The prompts of a store, paged: of a relation or all, in example order, or searched by text with a
bounded cost per request (:func:`search_page`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.serve.common import MAX_PAGE_SIZE, columns, example_ids, jsonable, relations_index, sql

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
    cols = _prompt_columns(store)
    if rel is None:
        total, cond, params = int(example_ids(store).size), "TRUE", []
    else:
        total, cond, params = int(relations_index(store)[rel]["prompts"]), "relation_id = ?", [rel]
    rows = sql(
        store,
        f"SELECT {', '.join(cols)} FROM examples WHERE {cond} ORDER BY example_id LIMIT ? OFFSET ?",
        [*params, size, page * size],
    )
    return jsonable({"total": total, "page": page, "size": size, "rows": rows})


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
