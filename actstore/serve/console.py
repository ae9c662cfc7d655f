"""The SQL console and the features projection.

SQL goes through the store's own sandbox (:func:`actstore.core.sql.run_sql` by way of
``StoreReader.sql``: one read-only SELECT, no file access, memory and time limits, one-line errors),
exactly as ``actstore sql``; the console pages a statement by wrapping it as a subquery
(:func:`actstore.core.sql.subquery`, which checks it first) with LIMIT/OFFSET bound as parameters.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from threadpoolctl import threadpool_limits

from actstore.core.errors import QueryError
from actstore.core.sql import subquery
from actstore.core.store import StoreReader
from actstore.query.select.features import HEAD_KINDS
from actstore.query.select.weights import weights
from actstore.serve.common import MAX_PAGE_SIZE, block_sample, example_texts, jsonable, signature

MAX_QUERY_CHARS = 20_000


@dataclass(frozen=True)
class ConsoleLimits:
    """What one console statement may use (``actstore serve --sql-memory / --sql-timeout / --max-download-rows``)."""

    memory_limit: str = "1GB"
    timeout: float = 30.0
    max_download_rows: int = 1_000_000


def _checked(query: str) -> str:
    if not isinstance(query, str) or not query.strip():
        raise QueryError("SQL: no statement given")
    if len(query) > MAX_QUERY_CHARS:
        raise QueryError(f"SQL: a statement is at most {MAX_QUERY_CHARS} characters")
    return subquery(query)


#: Pages of a console statement read at once when its columns are all scalars (a window): the other
#: pages of that window are then cut from it, without running the statement again.
PAGES_AHEAD = 10
Cache = Callable[[Any, Callable[[], Any]], Any]


def _scalar_columns(store: StoreReader, inner: str, limits: ConsoleLimits) -> bool:
    """Whether every column of the statement's result is a scalar (no list, struct, map or binary
    column, whose rows can be large): LIMIT 0 gives the schema without reading rows."""
    t = store.sql(
        f"SELECT * FROM {inner} AS q LIMIT 0", memory_limit=limits.memory_limit, timeout=limits.timeout
    )
    nested = (pa.types.is_nested, pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary)
    return not any(f(field.type) for field in t.schema for f in nested)


def run_page(
    store: StoreReader, query: str, page: int, size: int, limits: ConsoleLimits, cache: Cache | None = None
) -> dict[str, Any]:
    """One page of a statement's result: its columns, rows and whether more follow.  With ``cache``
    (``cache(key, build)``), a statement of scalar columns is read :data:`PAGES_AHEAD` pages at a time
    and the window kept, so that paging on through it does not run the statement again (a statement
    that sorts every row costs that sort once a window)."""
    inner = _checked(query)
    size = min(size, MAX_PAGE_SIZE)

    def rows(first: int, n: int) -> pa.Table:
        return store.sql(
            f"SELECT * FROM {inner} AS q LIMIT ? OFFSET ?",
            [n, first * size],
            memory_limit=limits.memory_limit,
            timeout=limits.timeout,
        )

    if cache is not None and cache(
        ("sql-scalar", inner, signature(store)), lambda: _scalar_columns(store, inner, limits)
    ):
        first = page - page % PAGES_AHEAD
        window = cache(
            ("sql-window", inner, size, first, limits, signature(store)),
            lambda: rows(first, PAGES_AHEAD * size + 1),
        )
        t = window.slice((page - first) * size, size + 1)
    else:
        t = rows(page, size + 1)
    more = t.num_rows > size
    t = t.slice(0, size)
    return jsonable(
        {
            "columns": t.column_names,
            "types": [str(f.type) for f in t.schema],
            "rows": [[_cell(v) for v in row.values()] for row in t.to_pylist()],
            "page": page,
            "size": size,
            "more": more,
        }
    )


def _cell(v: Any) -> Any:
    if isinstance(v, dict | list):
        return jsonable(v)
    return jsonable(v) if v is None or isinstance(v, bool | int | float | str) else str(v)


def run_download(store: StoreReader, query: str, fmt: str, limits: ConsoleLimits) -> tuple[bytes, str]:
    """The whole result (at most ``max_download_rows`` rows) as CSV or Parquet bytes, and its media type."""
    if fmt not in ("csv", "parquet"):
        raise QueryError(f"download format must be csv or parquet, not {fmt[:20]!r}")
    inner = _checked(query)
    t = store.sql(
        f"SELECT * FROM {inner} AS q LIMIT ?",
        [limits.max_download_rows + 1],
        memory_limit=limits.memory_limit,
        timeout=limits.timeout,
    )
    if t.num_rows > limits.max_download_rows:
        raise QueryError(f"the result has more than {limits.max_download_rows} rows: add a LIMIT or a WHERE")
    if fmt == "parquet":
        import pyarrow.parquet as pq

        buf = pa.BufferOutputStream()
        pq.write_table(t, buf)
        return buf.getvalue().to_pybytes(), "application/vnd.apache.parquet"
    text = io.StringIO()
    w = csv.writer(text)
    w.writerow(t.column_names)
    for row in t.to_pylist():
        w.writerow(["" if v is None else v for v in row.values()])
    return text.getvalue().encode("utf-8"), "text/csv; charset=utf-8"


# ----------------------------------------------------------------------------------- features
def _centred_gram(store: StoreReader, sel: Any, kind: str, layer: int, head: int | None) -> np.ndarray:
    """The n x n Gram matrix X X^T of the rows' centred features (PCA through it: its eigenvectors
    scaled by sqrt(eigenvalue) are the coordinates on the principal axes).  For ``attn_head``,
    x = [z_h W_O,h]_h is linear in the stored z, so X X^T = Z (blockdiag W_O,h W_O,h^T) Z^T over
    the centred z: n x H d_head numbers read and multiplied instead of n x H d_model."""
    if kind != "attn_head":
        x = sel.features(kind, layers=[layer], heads=None if head is None else [head])
        x = x.reshape(x.shape[0], -1).astype(np.float64)
        x = x - x.mean(0)
        return x @ x.T  # type: ignore[no-any-return]

    heads = list(range(store.geometry.n_heads)) if head is None else [head]
    z = sel.features("z", layers=[layer], heads=heads)[:, 0].astype(np.float64)  # [n, h, d_head]
    z = z - z.mean(0)
    w = weights(store).layers("W_O", [layer])[0].numpy().astype(np.float64)  # [H, d_head, d_model]
    zm = np.stack([z[:, i] @ (w[h] @ w[h].T) for i, h in enumerate(heads)], axis=1)  # [n, h, d_head]
    return zm.reshape(len(z), -1) @ z.reshape(len(z), -1).T  # type: ignore[no-any-return]


PROJECTABLE = ("z", "attn_head", "attn", "attn_entity", "mlp", "mlp_group", "resid")


def features_projection(
    store: StoreReader,
    kind: str,
    layer: int,
    head: int | None,
    relations: list[str] | None,
    n: int,
    seed: int,
) -> dict[str, Any]:
    """PCA (2-D) of one kind's features at one layer (one head, or all heads concatenated) over a
    sample of at most ``n`` rows of the chosen relations; each point with its prompt."""

    if kind not in PROJECTABLE:
        raise QueryError(f"kind must be one of {', '.join(PROJECTABLE)}, not {kind[:30]!r}")
    top = store.geometry.n_layers + (1 if kind == "resid" else 0)
    if not 0 <= layer < top:
        raise QueryError(f"layer {layer} is out of range for {kind} (0..{top - 1})")
    if head is not None and kind not in HEAD_KINDS:
        raise QueryError(f"{kind} has no heads")
    sel = block_sample(store, n, seed, relations)
    if len(sel) < 3:
        raise QueryError("the selection has fewer than 3 rows")

    with threadpool_limits(1):  # a 5000 x 5000 eigh at most; BLAS threads only contend on a busy CPU
        lam, vec = np.linalg.eigh(_centred_gram(store, sel, kind, layer, head))
    lam, vec = np.clip(lam[::-1], 0, None), vec[:, ::-1]
    xy = vec[:, :2] * np.sqrt(lam[:2])
    var = lam / max(float(lam.sum()), 1e-30)
    ids = sel.example_ids
    texts = example_texts(store, ids)
    points = [
        {
            "example_id": int(i),
            "x": float(a),
            "y": float(b),
            "relation_id": texts[int(i)]["relation_id"],
            "text": (texts[int(i)]["text"] or "")[:200],
        }
        for i, (a, b) in zip(ids, xy)
    ]
    return jsonable(
        {"kind": kind, "layer": layer, "head": head, "n": len(points), "explained": var[:2], "points": points}
    )
