"""The SQL console and the features projection.

SQL goes through the store's own sandbox (:func:`actstore.core.sql.run_sql` by way of
``StoreReader.sql``: one read-only SELECT, no file access, memory and time limits, one-line errors),
exactly as ``actstore sql``; the console pages a statement by wrapping it as a subquery
(:func:`actstore.core.sql.subquery`, which checks it first) with LIMIT/OFFSET bound as parameters.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import QueryError
from actstore.core.sql import subquery
from actstore.core.store import StoreReader
from actstore.serve.common import MAX_PAGE_SIZE, block_sample, example_texts, jsonable

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


def run_page(store: StoreReader, query: str, page: int, size: int, limits: ConsoleLimits) -> dict[str, Any]:
    """One page of a statement's result: its columns, rows and whether more follow."""
    inner = _checked(query)
    size = min(size, MAX_PAGE_SIZE)
    t = store.sql(
        f"SELECT * FROM {inner} AS q LIMIT ? OFFSET ?",
        [size + 1, page * size],
        memory_limit=limits.memory_limit,
        timeout=limits.timeout,
    )
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
    from actstore.query.features import HEAD_KINDS

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
    x = sel.features(kind, layers=[layer], heads=None if head is None else [head])
    x = x.reshape(x.shape[0], -1).astype(np.float64)
    x = x - x.mean(0)
    # PCA through the n x n Gram matrix (n <= 5000 rows, F up to tens of thousands of features):
    # its eigenvectors scaled by sqrt(eigenvalue) are the coordinates on the principal axes.
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # a 5000 x 5000 eigh at most; BLAS threads only contend on a busy CPU
        lam, vec = np.linalg.eigh(x @ x.T)
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
