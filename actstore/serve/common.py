"""What the explorer's views share: validated parameters, JSON-safe values, SQL over the store."""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actstore.core.errors import NotFoundError, QueryError
from actstore.core.store import StoreReader
from actstore.query.select.selection import Selection

#: Limits of the explorer's own statements (a SQL console statement has the console's limits).
SQL_TIMEOUT = 20.0
MAX_PAGE_SIZE = 500
RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,120}$")
RELATION_ID = re.compile(r"^[^\x00-\x1f]{1,200}$")
TABLE = re.compile(r"^[A-Za-z0-9_]{1,100}$")


def jsonable(v: Any) -> Any:
    """``v`` with numpy scalars and arrays as Python values and non-finite floats as None."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return jsonable(v.tolist())
    if isinstance(v, np.generic):
        return jsonable(v.item())
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, bytes):
        return v.hex()
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)


def sql(
    store: StoreReader, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Rows of one read-only statement of the explorer's (parameters bound, never pasted)."""
    return store.sql(
        query, list(params) if isinstance(params, list | tuple) else params, timeout=SQL_TIMEOUT
    ).to_pylist()  # type: ignore[arg-type]


#: How long the explorer trusts its listing of a store's table files (a run recorded meanwhile shows
#: up after this many seconds).
LISTING_SECONDS = 2.0
_META: weakref.WeakKeyDictionary[StoreReader, dict[Any, Any]] = weakref.WeakKeyDictionary()
_META_LOCK = threading.Lock()


def _meta(store: StoreReader) -> dict[Any, Any]:
    with _META_LOCK:
        return _META.setdefault(store, {})


def table_files(store: StoreReader) -> dict[str, list[str]]:
    """``store.table_files()``, listed again at most every :data:`LISTING_SECONDS`."""
    meta = _meta(store)
    now = time.monotonic()
    got = meta.get("files")
    if got is None or now - got[0] > LISTING_SECONDS:
        got = meta["files"] = (now, store.table_files())
    return dict(got[1])


def signature(store: StoreReader, *tables: str) -> tuple[Any, ...]:
    """The files of ``tables`` (all tables when none is named): a view computed from them can be kept
    while this stays the same (a table file is written once and never changed)."""
    listed = table_files(store)
    names = tables or tuple(sorted(listed))
    return tuple((n, tuple(listed.get(n) or ())) for n in names)


def kept(store: StoreReader, name: str, tables: tuple[str, ...], build: Callable[[], Any]) -> Any:
    """``build()`` once per store and state of ``tables``' files (kept while they stay the same)."""
    meta = _meta(store)
    key = (name, signature(store, *tables))
    if key not in meta:
        meta[key] = build()
    return meta[key]


def has_table(store: StoreReader, name: str) -> bool:
    return bool(table_files(store).get(name))


def columns(store: StoreReader, name: str) -> list[str]:
    """The columns of table ``name`` (the union over its files' Parquet schemas, in order; [] when the
    store has no such table), kept while its files stay the same."""
    files = tuple(table_files(store).get(name) or ())
    if not files:
        return []
    meta = _meta(store)
    key = ("columns", name, files)
    if key not in meta:
        out: list[str] = []
        for rel in files:
            out += [n for n in store.file_schema(rel).names if n not in out]
        meta[key] = out
    return list(meta[key])


def cached_rows(store: StoreReader, name: str, query: str | None = None) -> list[dict[str, Any]]:
    """The rows of a small table (``probe_runs``, ``runs``), or of ``query`` over table ``name``,
    kept while the table's files stay the same ([] when the store lacks the table)."""
    files = tuple(table_files(store).get(name) or ())
    if not files:
        return []
    meta = _meta(store)
    key = ("rows", name, query, files)
    if key not in meta:
        meta[key] = sql(store, query or f'SELECT * FROM "{name}"')
    return [dict(r) for r in meta[key]]


def relations_index(store: StoreReader) -> dict[str, dict[str, Any]]:
    """relation_id -> {relation_name, prompts} (kept while the examples table's files stay the same)."""
    rows = cached_rows(
        store,
        "examples",
        "SELECT relation_id, any_value(relation_name) AS relation_name, count(*) AS prompts FROM examples GROUP BY 1",
    )
    return {str(r["relation_id"]): r for r in rows}


def example_ids(store: StoreReader) -> np.ndarray:
    """Every example id of the store, sorted (int64; kept while the examples' files stay the same)."""
    files = tuple(table_files(store).get("examples") or ())
    meta = _meta(store)
    key = ("example_ids", files)
    if key not in meta:
        t = store.sql("SELECT example_id FROM examples ORDER BY 1", timeout=SQL_TIMEOUT)
        meta[key] = np.asarray(t.column(0).to_numpy(), dtype=np.int64)
    return meta[key]  # type: ignore[no-any-return]


def int_param(value: str | None, what: str, *, low: int, high: int, default: int | None = None) -> int:
    """A whole number ``low <= n <= high`` from a URL; a one-line 400 otherwise."""
    if value is None or value == "":
        if default is None:
            raise QueryError(f"{what} is required")
        return default
    text = str(value).strip()
    if not re.fullmatch(r"-?\d{1,19}", text):
        raise QueryError(f"{what} must be a whole number, not {text[:40]!r}")
    n = int(text)
    if not low <= n <= high:
        raise QueryError(f"{what} {n} is out of range ({low}..{high})")
    return n


def example_id(store: StoreReader, value: str) -> int:
    """An example id of the store; 400 when not a number, 404 when the store has no such example."""
    ex = int_param(value, "example_id", low=-(2**63), high=2**63 - 1)
    ids = example_ids(store)
    i = int(np.searchsorted(ids, ex))
    if i >= ids.size or int(ids[i]) != ex:
        raise NotFoundError(f"example {ex} is not in the store")
    return ex


def layer_head(store: StoreReader, layer: str | None, head: str | None) -> tuple[int, int]:
    g = store.geometry
    return (
        int_param(layer, "layer", low=0, high=g.n_layers - 1),
        int_param(head, "head", low=0, high=g.n_heads - 1),
    )


def relation_id(store: StoreReader, value: str) -> str:
    if not isinstance(value, str) or not RELATION_ID.match(value):
        raise QueryError("relation must be 1 to 200 printable characters")
    if value not in relations_index(store):
        raise NotFoundError(f"relation {value[:60]!r} is not in the store")
    return value


def run_param(value: str | None) -> str | None:
    """A run id from a URL (None when not given); a run id is letters, digits and ``._:-``."""
    if value is None or value == "":
        return None
    if not RUN_ID.match(value):
        raise QueryError(f"run must be a run id (letters, digits, ._:-), not {value[:40]!r}")
    return value


def table_name(store: StoreReader, value: str) -> str:
    if not isinstance(value, str) or not TABLE.match(value):
        raise QueryError("a table name is letters, digits and _")
    if value not in table_files(store):
        raise NotFoundError(f"no table {value!r} in the store")
    return value


def latest_run(store: StoreReader, table: str, run: str | None = None, where: str = "") -> str | None:
    """``run`` when table ``table`` holds it (404 otherwise), else the table's newest run (by the
    ``runs`` table's start time; None when the table is absent or empty)."""
    if run is not None:
        if run not in runs_of(store, table):  # (none when the table is absent or has no run_id)
            raise NotFoundError(f"no run {run!r} in table {table}")
        return run
    runs = (
        _runs_of(store, table, where)
        if where and "run_id" in columns(store, table)
        else runs_of(store, table)
    )
    return runs[0] if runs else None


def runs_of(store: StoreReader, table: str) -> list[str]:
    """The run ids of ``table``, newest first (kept while its files and the runs table's stay the same)."""
    if "run_id" not in columns(store, table):  # (none when the table is absent)
        return []
    listed = table_files(store)
    key = ("runs", table, tuple(listed.get(table) or ()), tuple(listed.get("runs") or ()))
    meta = _meta(store)
    if key not in meta:
        meta[key] = _runs_of(store, table)
    return list(meta[key])


def _runs_of(store: StoreReader, table: str, where: str = "") -> list[str]:
    """The run ids of ``table``'s rows that ``where`` keeps, newest first (by the runs table's start)."""
    started = "r.started" if "started" in columns(store, "runs") else "NULL"
    join = "LEFT JOIN runs r USING (run_id)" if started != "NULL" else ""
    rows = sql(
        store,
        f'SELECT t.run_id FROM (SELECT DISTINCT run_id FROM "{table}" {where}) t {join} '
        f"ORDER BY {started} DESC NULLS LAST, t.run_id DESC",
    )
    return [str(r["run_id"]) for r in rows]


def grid(
    rows: list[dict[str, Any]], value: str, n_rows: int, n_cols: int, row: str = "layer", col: str = "head"
) -> list[list[float | None]]:
    """A [n_rows][n_cols] grid of ``value`` from long rows (None where absent or not finite)."""
    out: list[list[float | None]] = [[None] * n_cols for _ in range(n_rows)]
    for r in rows:
        i, j, v = r.get(row), r.get(col), r.get(value)
        if isinstance(i, int) and isinstance(j, int) and 0 <= i < n_rows and 0 <= j < n_cols:
            if v is not None and math.isfinite(float(v)):
                out[i][j] = float(v)
    return out


def store_rows(store: StoreReader) -> Any:
    """Every target row of the store as a selection's rows table (example_id, row, segment, seg_row,
    src_start, n_src, subject span, relation_id; in store order), read once and kept while the
    examples' and targets' files stay the same: a selection of given ids is then cut from it in
    memory (:func:`rows_selection`) instead of by a statement each."""

    listed = table_files(store)
    key = ("store_rows", tuple(listed.get("examples") or ()), tuple(listed.get("targets") or ()))
    meta = _meta(store)
    if key not in meta:
        meta[key] = Selection.from_sql(store).rows
    return meta[key]


def rows_selection(store: StoreReader, ids: Sequence[int] | np.ndarray) -> Any:
    """The Selection of the target rows of examples ``ids`` (in store order), cut from :func:`store_rows`."""

    rows = store_rows(store)
    keep = pc.is_in(rows.column("example_id"), value_set=pa.array(np.asarray(ids, dtype=np.int64)))
    return Selection(store, rows.filter(keep))


def id_ranges(ids: Sequence[int] | np.ndarray, gap: int = 64) -> str:
    """A condition on ``example_id`` covering ``ids`` by a few ranges (ids closer than ``gap`` share a
    range), so that DuckDB reads only the row groups of those ranges; whole numbers only, never text
    from a request."""
    a = np.unique(np.asarray(ids, dtype=np.int64))
    if a.size == 0:
        return "FALSE"
    cut = np.flatnonzero(np.diff(a) > gap) + 1
    parts = [(int(p[0]), int(p[-1])) for p in np.split(a, cut)]
    if len(parts) > 64:  # too many ranges to be worth it: one range over them all
        parts = [(int(a[0]), int(a[-1]))]
    return "(" + " OR ".join(f"example_id BETWEEN {lo} AND {hi}" for lo, hi in parts) + ")"


def example_texts(store: StoreReader, ids: Sequence[int] | np.ndarray) -> dict[int, dict[str, Any]]:
    """example_id -> {example_id, relation_id, text} for ``ids`` (read from their id ranges only)."""
    want = [int(i) for i in np.asarray(ids, dtype=np.int64).tolist()]
    rows = sql(
        store,
        f"SELECT example_id, relation_id, text FROM examples WHERE {id_ranges(want)} "
        "AND list_contains(?, example_id)",
        [want],
    )
    return {int(r["example_id"]): r for r in rows}


def _chunk_groups(
    store: StoreReader, rows: pa.Table, chunk_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the segment of each of ``rows``, its chunk, the rows of each chunk): a chunk is ``chunk_rows``
    (default: the store's) consecutive rows of a segment, which its arrays store together (one read each)."""
    seg = rows.column("segment").to_numpy().astype(np.int64)
    at = rows.column("seg_row").to_numpy().astype(np.int64) // max(1, chunk_rows or store.manifest.chunk_rows)
    key = seg * (int(at.max(initial=0)) + 1) + at
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    return seg, inverse.reshape(-1), counts


def store_chunks(store: StoreReader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_chunk_groups` of every target row (:func:`store_rows`), kept with them."""
    rows = store_rows(store)
    return kept(store, "chunk_groups", ("examples", "targets"), lambda: _chunk_groups(store, rows))  # type: ignore[no-any-return]


def block_sample(
    store: StoreReader,
    n: int,
    seed: int = 0,
    relations: list[str] | None = None,
    chunk_rows: int | None = None,
) -> Any:
    """At most ``n`` rows (of ``relations``) as a Selection: all of them when there are so few, else
    ``n`` drawn at random from whole chunks (``chunk_rows`` rows of a segment) taken in a random
    order, from segments taken in a random order until they hold ``4 n`` rows, until the chunks hold
    ``n`` rows: a sample reads about ``n / chunk_rows`` chunks rather than one chunk per row, and its
    texts lie in a few row groups (a cluster sample: each row is as likely to be drawn as any other,
    but rows of one chunk, neighbours in store order, are drawn together).  The work is O(rows) numpy
    (the segment test; every row's chunk is kept) plus the reads of those chunks."""

    rows = store_rows(store)
    if relations:
        keep = pc.is_in(rows.column("relation_id"), value_set=pa.array(relations, pa.string()))
        rows = rows.filter(pc.fill_null(keep, False))
    if rows.num_rows <= n:
        return Selection(store, rows)
    if relations or chunk_rows:
        seg, chunk, counts = _chunk_groups(store, rows, chunk_rows)
    else:  # every row: the chunks are kept
        seg, chunk, counts = store_chunks(store)
    rng = np.random.default_rng(seed)
    # segments in a random order until they hold 4n rows (the texts of a sample then lie in a few row
    # groups of the examples table), then their chunks in a random order until they hold n rows
    segs, seg_rows = np.unique(seg, return_counts=True)
    order = rng.permutation(segs.size)
    m = int(np.searchsorted(np.cumsum(seg_rows[order]), 4 * n)) + 1
    pool = np.flatnonzero(np.isin(seg, segs[order[:m]]))
    chunks = np.unique(chunk[pool])
    corder = rng.permutation(chunks)
    k = int(np.searchsorted(np.cumsum(counts[corder]), n)) + 1
    taken = np.zeros(counts.size, dtype=bool)
    taken[corder[:k]] = True
    cand = pool[taken[chunk[pool]]]
    pick = np.sort(rng.choice(cand, size=n, replace=False))
    return Selection(store, rows.take(pa.array(pick)))


def document_positions(
    store: StoreReader, doc: int, columns: str, limit: int, start: int = 0
) -> tuple[list[dict[str, Any]], bool]:
    """``limit`` positions of corpus document ``doc`` from its ``start``-th (``columns`` of the positions
    table, in row order) and whether it has more; a 404 of one line where there is no such document or
    no token at ``start``."""
    pos = sql(
        store,
        f"SELECT {columns} FROM positions WHERE document = ? ORDER BY row LIMIT ? OFFSET ?",
        [doc, limit + 1, start],
    )
    if not pos:
        there = start and sql(store, "SELECT count(*) AS n FROM positions WHERE document = ?", [doc])[0]["n"]
        raise NotFoundError(
            f"document {doc} has {there} tokens: none from {start}"
            if there
            else f"no document {doc} in the store"
        )
    return pos[:limit], len(pos) > limit
