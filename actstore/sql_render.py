"""Query results as text for the command line: aligned table, CSV or JSON, every column type
printable and no control character reaching the terminal."""

from __future__ import annotations

import json

import pyarrow as pa

from actstore.errors import QueryError


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _is_plain(t: pa.DataType) -> bool:
    """A type pandas and the Arrow CSV writer both print as is."""
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)
                or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_decimal(t)
                or pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_timestamp(t))


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):  # LIST, ARRAY, STRUCT, MAP: as JSON
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def _as_text(table: pa.Table) -> pa.Table:
    """``table`` with every column that is not a plain scalar (LIST, STRUCT, MAP, UNION, INTERVAL, BLOB, ...)
    turned into text, lists and structs as JSON."""
    cols = [c if _is_plain(c.type) else pa.array([_text(v) for v in c.to_pylist()], pa.string())
            for c in table.columns]
    return pa.Table.from_arrays(cols, names=table.column_names)


def _escape(text: str) -> str:
    """Control characters as escapes (``\\x1b``, ``\\n``): a table printed to a terminal cannot drive it."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


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
        import pandas as pd

        df = text.to_pandas()
        df.columns = [_escape(str(c)) for c in df.columns]
        for i, t in enumerate(text.schema.types):
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                df.isetitem(i, df.iloc[:, i].map(lambda v: _escape(v) if isinstance(v, str) else v))
        with pd.option_context("display.max_rows", 200, "display.max_columns", 50, "display.width", 200,
                               "display.max_colwidth", 60):
            return str(df.to_string(index=False))
    except QueryError:
        raise
    except Exception as e:  # noqa: BLE001 - any printing failure is one line naming the format
        raise QueryError(f"SQL error: cannot print the result as {fmt}: {type(e).__name__}: {_one_line(e)}") from None
