"""DuckDB over a store's tables, read-only and confined to the store.

Every table becomes a view before the connection is locked down: external access is then
switched off (with the store's own directory the only one allowed), extensions cannot be
installed or loaded, and the configuration is locked.  Only SELECT statements (including
``WITH``) and EXPLAIN/DESCRIBE/SUMMARIZE-style reads are accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from actstore.errors import QueryError, ReadOnlySQLError

if TYPE_CHECKING:
    from actstore.store import Store

ALLOWED_STATEMENTS = {"SELECT", "EXPLAIN"}


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def connect(store: Store) -> duckdb.DuckDBPyConnection:
    """A locked-down in-memory DuckDB connection with one view per store table."""
    con = duckdb.connect(
        ":memory:",
        config={"autoinstall_known_extensions": False, "autoload_known_extensions": False, "threads": 2},
    )
    loc = store.location
    if loc.is_local:
        store.check_table_shards()  # a corrupt shard is an error, never silently wrong rows
        con.execute("SET allowed_directories = ?", [[loc.root.rstrip("/") + "/"]])
    for name, files in store.table_files().items():
        view = _quote(name)
        if files and loc.is_local:
            paths = ", ".join("'" + loc.path(f).replace("'", "''") + "'" for f in files)
            con.execute(f"CREATE VIEW {view} AS SELECT * FROM read_parquet([{paths}], union_by_name=true)")
        else:
            con.register(f"__arrow_{name}", store.table(name, files=files))
            con.execute(f"CREATE VIEW {view} AS SELECT * FROM {_quote('__arrow_' + name)}")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Reject anything but reads, naming the offending statement type."""
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_one_line(e)}") from None
    if len(statements) != 1:
        raise QueryError(f"SQL must be exactly one statement (got {len(statements)})")
    kind = statements[0].type.name
    if kind not in ALLOWED_STATEMENTS:
        raise ReadOnlySQLError(f"SQL is read-only: {kind} statements are not allowed (only SELECT)")


def run_sql(store: Store, query: str, con: duckdb.DuckDBPyConnection | None = None) -> pa.Table:
    """Execute a read-only query eagerly and return its result as Arrow."""
    con = con or connect(store)
    check_read_only(con, query)
    try:
        rel = con.sql(query)
        if rel is None:
            raise QueryError("SQL returned no result set")
        fetch = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table
        return fetch()
    except duckdb.PermissionException as e:
        raise ReadOnlySQLError(f"SQL may only read the store's tables: {_one_line(e)}") from None
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
