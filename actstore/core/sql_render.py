"""Query results as text for the command line: aligned table, CSV or JSON, every column type
printable and no control character reaching the terminal."""

from __future__ import annotations

import json

import pyarrow as pa

from actstore.core.errors import QueryError


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _is_plain(t: pa.DataType) -> bool:
    """A type pandas and the Arrow CSV writer both print as is."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_null(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_decimal(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_timestamp(t)
    )


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):  # LIST, ARRAY, STRUCT, MAP: as JSON
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def _as_text(table: pa.Table) -> pa.Table:
    """``table`` with every column that is not a plain scalar (LIST, STRUCT, MAP, UNION, INTERVAL, BLOB, ...)
    turned into text, lists and structs as JSON."""
    cols = [
        c if _is_plain(c.type) else pa.array([_text(v) for v in c.to_pylist()], pa.string())
        for c in table.columns
    ]
    return pa.Table.from_arrays(cols, names=table.column_names)


def _escape(text: str) -> str:
    """Control characters as escapes (``\\x1b``, ``\\n``): a table printed to a terminal cannot drive it."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


MAX_ROWS = 200  # a longer result prints its first and last MAX_ROWS // 2 rows
MAX_WIDTH = 60  # a longer value prints its first MAX_WIDTH - 3 characters and "..."


def _cell(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = _escape(str(value))
    return text if len(text) <= MAX_WIDTH else text[: MAX_WIDTH - 3] + "..."


def _aligned(table: pa.Table) -> str:
    """Columns right-aligned under their names (no pandas: it would double the CLI's start-up time)."""
    n = table.num_rows
    shown = (
        table
        if n <= MAX_ROWS
        else pa.concat_tables([table.slice(0, MAX_ROWS // 2), table.slice(n - MAX_ROWS // 2)])
    )
    cols = [[_cell(v) for v in c.to_pylist()] for c in shown.columns]
    names = [_cell(str(c)) for c in table.column_names]
    widths = [max([len(h), *map(len, col)]) for h, col in zip(names, cols)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(names, widths))]
    for i in range(shown.num_rows):
        if n > MAX_ROWS and i == MAX_ROWS // 2:
            lines.append("  ".join("...".rjust(w) for w in widths))
        lines.append("  ".join(col[i].rjust(w) for col, w in zip(cols, widths)))
    if n > MAX_ROWS:
        lines.append(f"[{n} rows x {table.num_columns} columns]")
    return "\n".join(lines)


def render(table: pa.Table, fmt: str) -> str:
    """A query result as text: ``table`` (aligned columns, for reading), ``csv`` or ``json``.

    Every result prints, LIST, STRUCT and MAP columns included (as JSON); a failure is a QueryError
    starting ``SQL error:``.
    """
    try:
        if fmt == "json":
            return json.dumps(table.to_pylist(), default=str)
        text = _as_text(table)
        if fmt == "csv":
            import io

            import pyarrow.csv as pacsv

            buf = io.BytesIO()
            pacsv.write_csv(text, buf)
            return buf.getvalue().decode("utf-8").rstrip("\n")
        if fmt != "table":
            raise QueryError(f"unknown output format {fmt!r} (table, csv, json)")
        return _aligned(text)
    except QueryError:
        raise
    except Exception as e:  # noqa: BLE001 - any printing failure is one line naming the format
        raise QueryError(
            f"SQL error: cannot print the result as {fmt}: {type(e).__name__}: {_one_line(e)}"
        ) from None
