"""What the explorer's views share: validated parameters, JSON-safe values, SQL over the store."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from actstore.core.errors import NotFoundError, QueryError
from actstore.core.store import StoreReader

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


def has_table(store: StoreReader, name: str) -> bool:
    return bool(store.table_files().get(name))


def columns(store: StoreReader, name: str) -> list[str]:
    """The columns of table ``name`` ([] when the store has no such table)."""
    if not has_table(store, name):
        return []
    return list(store.sql(f'SELECT * FROM "{name}" LIMIT 0').column_names)


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
    if not sql(store, "SELECT 1 FROM examples WHERE example_id = ? LIMIT 1", [ex]):
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
    if not sql(store, "SELECT 1 FROM examples WHERE relation_id = ? LIMIT 1", [value]):
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
    if value not in store.table_files():
        raise NotFoundError(f"no table {value!r} in the store")
    return value


def latest_run(store: StoreReader, table: str, run: str | None = None, where: str = "") -> str | None:
    """``run`` when table ``table`` holds it (404 otherwise), else the table's newest run (by the
    ``runs`` table's start time; None when the table is absent or empty)."""
    if not has_table(store, table) or "run_id" not in columns(store, table):
        if run is not None:
            raise NotFoundError(f"no run {run!r} in table {table}")
        return None
    if run is not None:
        if not sql(store, f'SELECT 1 FROM "{table}" WHERE run_id = ? LIMIT 1', [run]):
            raise NotFoundError(f"no run {run!r} in table {table}")
        return run
    started = "r.started" if has_table(store, "runs") and "started" in columns(store, "runs") else "NULL"
    join = "LEFT JOIN runs r USING (run_id)" if started != "NULL" else ""
    rows = sql(
        store,
        f'SELECT t.run_id FROM (SELECT DISTINCT run_id FROM "{table}" {where}) t {join} '
        f"ORDER BY {started} DESC NULLS LAST, t.run_id DESC LIMIT 1",
    )
    return str(rows[0]["run_id"]) if rows else None


def runs_of(store: StoreReader, table: str) -> list[str]:
    """The run ids of ``table``, newest first."""
    if not has_table(store, table) or "run_id" not in columns(store, table):
        return []
    started = "r.started" if has_table(store, "runs") and "started" in columns(store, "runs") else "NULL"
    join = "LEFT JOIN runs r USING (run_id)" if started != "NULL" else ""
    rows = sql(
        store,
        f'SELECT t.run_id FROM (SELECT DISTINCT run_id FROM "{table}") t {join} '
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
