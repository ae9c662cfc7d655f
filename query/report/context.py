"""What a report section is made of, and what it reads the store through.

A section is a title and a list of *blocks* (heading, note, table, figure, grid of figures, TokenScore
examples); the templates (``templates/blocks.html.j2``) turn blocks into HTML with autoescaping, so no
section module writes markup or escapes text itself.  :class:`ReportContext` gives the sections the
store's result tables, a DuckDB connection, and the run order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.figure import Figure as MplFigure

from actstore.core.errors import CorruptStoreError, QueryError, StorageError
from actstore.core.sql import run_sql
from actstore.core.store import StoreReader
from actstore.query.analyses import plotting

log = logging.getLogger("actstore.query.report")

SECTION_IDS: dict[str, str] = {
    "summary": "section-summary",
    "probes": "section-probes",
    "headscore": "section-headscore",
    "tokenscore": "section-tokenscore",
    "predictors": "section-predictors",
    "shortcuts": "section-shortcuts",
    "maps": "section-maps",
    "maps_dynamic": "section-maps-dynamic",
    "maps_ablation": "section-maps-ablation",
    "tracing": "section-tracing",
    "patching": "section-patching",
    "lens": "section-lens",
    "agreement": "section-agreement",
    "tables": "section-tables",
}

#: What reading a result table can legitimately raise: a file missing or unreadable (the store's
#: damage, :class:`CorruptStoreError`), a statement the table's columns do not support
#: (:class:`QueryError`), or an object store out of reach (:class:`StorageError`).
READ_ERRORS: tuple[type[Exception], ...] = (CorruptStoreError, QueryError, StorageError)


@dataclass(frozen=True)
class ReportOptions:
    """How much the report shows (every limit keeps the file small on big stores)."""

    max_runs: int = 3  # most recent runs shown per analysis
    max_relations: int = 24  # heatmaps per run
    token_errors: int = 6  # TokenScore examples: errors ...
    token_correct: int = 4  # ... and correct predictions
    preview_rows: int = 5  # rows shown for tables without a dedicated section
    dpi: int = 80


# ----------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Heading:
    kind: ClassVar[str] = "heading"
    text: str


@dataclass(frozen=True)
class Note:
    kind: ClassVar[str] = "note"
    text: str


@dataclass(frozen=True)
class Omitted:
    """Why a section's content is missing (a table it reads could not be read)."""

    kind: ClassVar[str] = "omitted"
    text: str


@dataclass(frozen=True)
class Table:
    """Rows of a table; cells are formatted by the template's ``cell`` filter (:func:`fmt`)."""

    kind: ClassVar[str] = "table"
    rows: list[dict[str, Any]]
    columns: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    cls: str = "data"

    def header(self, column: str) -> str:
        return self.headers.get(column, column)


@dataclass(frozen=True)
class Figure:
    """A PNG embedded as a ``data:`` URI, with its caption."""

    kind: ClassVar[str] = "figure"
    src: str
    alt: str


@dataclass(frozen=True)
class Grid:
    """Blocks laid out side by side (figures of one run)."""

    kind: ClassVar[str] = "grid"
    items: list[Block]


@dataclass(frozen=True)
class TokenSpan:
    text: str
    colour: str
    title: str


@dataclass(frozen=True)
class TokenExample:
    """One prompt with its tokens coloured by TokenScore."""

    kind: ClassVar[str] = "tokens"
    example_id: object
    label: str  # "correct", "error" or ""
    gold: object | None
    predicted: object | None
    details: list[str]
    spans: list[TokenSpan]


@dataclass(frozen=True)
class TokenLegend:
    kind: ClassVar[str] = "token_legend"
    negative: str
    positive: str


@dataclass(frozen=True)
class Links:
    """A line of links (text, href): the explorer's views of the store, when one serves it."""

    kind: ClassVar[str] = "links"
    items: list[tuple[str, str]]


Block = Heading | Note | Omitted | Table | Figure | Grid | TokenExample | TokenLegend | Links


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    blocks: list[Block]

    @property
    def id(self) -> str:
        return SECTION_IDS.get(self.key, f"section-{self.key.replace('_', '-')}")


# ----------------------------------------------------------------------------------- context
@dataclass
class ReportContext:
    store: StoreReader
    opts: ReportOptions
    files: dict[str, list[str]]
    con: duckdb.DuckDBPyConnection
    run_started: dict[str, float] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def has(self, name: str) -> bool:
        return bool(self.files.get(name))

    def sql(self, query: str, params: Sequence[Any] | None = None) -> pa.Table:
        """One read-only SELECT over the store's tables; ``params`` bound by DuckDB (``?`` placeholders)."""

        return run_sql(self.store, query, self.con, params=params)

    def columns(self, name: str) -> list[str]:
        """Column names of a table of the store ([] when it is absent)."""
        if not self.has(name):
            return []
        return self.sql(f'SELECT * FROM "{name}" LIMIT 0').column_names

    def table(self, name: str, files: list[str] | None = None) -> pa.Table | None:
        """A whole result table, or the given files of it (None when absent); marks it as shown."""
        if not self.has(name):
            return None
        self.used.add(name)
        return self.store.table(name, files=self.files[name] if files is None else files)

    def run_file(self, name: str, run: str) -> list[str]:
        """The file of ``run`` in result table ``name`` (``tables/<name>/<run>.parquet``), if there is one."""
        want = f"tables/{name}/{run}.parquet"
        return [f for f in self.files.get(name, []) if f == want]

    def latest_runs(self, t: pa.Table) -> list[str]:
        """The table's run ids, newest first, at most ``max_runs`` ([""] when it has no run_id)."""
        if "run_id" not in t.column_names:
            return [""]
        runs = sorted(
            {str(r) for r in t.column("run_id").to_pylist()},
            key=lambda r: (self.run_started.get(r, 0.0), r),
            reverse=True,
        )
        return runs[: self.opts.max_runs]

    def latest_run(self, t: pa.Table) -> tuple[str, pa.Table]:
        """The newest run of ``t`` and its rows."""
        run = self.latest_runs(t)[0]
        return run, of_run(t, run)


# ----------------------------------------------------------------------------------- data helpers
def fmt(v: object, digits: int = 3) -> str:
    """A cell value: floats rounded, NaN/None as a dash, lists shortened."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float | np.floating):
        f = float(v)
        if not math.isfinite(f):
            return "–"
        if f != 0 and (abs(f) >= 1e7 or abs(f) < 10**-digits):
            return f"{f:.{digits}g}"
        if abs(f) >= 100:
            return f"{f:,.0f}" if f == int(f) or abs(f) >= 1e4 else f"{f:.1f}"
        return f"{f:.{digits}f}"
    if isinstance(v, list | tuple):
        s = ", ".join(fmt(x, digits) for x in v[:8])
        return f"[{s}{', …' if len(v) > 8 else ''}]"
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "…"


def floats(t: pa.Table, column: str) -> np.ndarray:
    """A column as float64 ([rows]), None as NaN."""
    return np.asarray(
        [np.nan if x is None else float(x) for x in t.column(column).to_pylist()], dtype=np.float64
    )


def strings(t: pa.Table, column: str, missing: str = "") -> np.ndarray:
    """A column as strings ([rows]); ``missing`` in every row when the table lacks the column."""
    if column not in t.column_names:
        return np.full(t.num_rows, missing)
    return np.asarray([str(x) for x in t.column(column).to_pylist()])


def grid_mean(
    t: pa.Table, value: str, row: str = "layer", col: str = "head"
) -> tuple[np.ndarray, list[Any], list[Any]]:
    """Mean of ``value`` per (row, col) cell of a long table: the grid [n_rows, n_cols] (NaN: no finite
    value), and the sorted distinct row and column labels."""
    r = np.asarray(t.column(row).to_pylist())
    c = np.asarray(t.column(col).to_pylist())
    v = floats(t, value)
    rows, ri = np.unique(r, return_inverse=True)
    cols, ci = np.unique(c, return_inverse=True)
    s = np.zeros((rows.size, cols.size))
    n = np.zeros_like(s)
    ok = np.isfinite(v)
    np.add.at(s, (ri[ok], ci[ok]), v[ok])
    np.add.at(n, (ri[ok], ci[ok]), 1)
    with np.errstate(invalid="ignore"):
        return s / n, rows.tolist(), cols.tolist()


def missing(t: pa.Table, *cols: str) -> list[str]:
    return [c for c in cols if c not in t.column_names]


def where_equal(t: pa.Table, column: str, value: object) -> pa.Table:
    """The rows of ``t`` whose ``column`` equals ``value`` (all rows when there is no such column)."""
    if column not in t.column_names:
        return t
    return t.filter(pc.equal(t.column(column), pa.scalar(value, t.schema.field(column).type)))


def of_run(t: pa.Table, run: str) -> pa.Table:
    return where_equal(t, "run_id", run) if run else t


def pick(t: pa.Table, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of ``t`` as dicts, with those of ``columns`` that it has."""
    return t.select([c for c in columns if c in t.column_names]).to_pylist()


def run_label(run: str) -> str:
    return f"run {run}" if run else "all runs"


def table_block(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    headers: dict[str, str] | None = None,
    cls: str = "data",
) -> Table:
    """A table of ``rows`` (columns: those given, else the first row's keys)."""
    cols = list(columns) if columns is not None else (list(rows[0]) if rows else [])
    return Table(list(rows), cols, dict(headers or {}), cls)


def figure_block(fig: MplFigure, alt: str, dpi: int, suptitle: str | None = None) -> Figure:
    """A matplotlib figure (with its ``suptitle``, when given) laid out tight, as an embedded PNG block."""
    if suptitle is not None:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    return Figure(plotting.data_uri(plotting.png_bytes(fig, dpi)), alt)


def heatmap_block(
    grid: np.ndarray,
    *,
    rows: Sequence[object],
    cols: Sequence[object],
    title: str,
    dpi: int,
    diverging: bool = True,
) -> Figure:
    """A [rows, cols] layer x head heatmap block (diverging around 0 unless told otherwise)."""
    return figure_block(
        plotting.heatmap(grid, rows=rows, cols=cols, title=title, diverging=diverging), title, dpi
    )
