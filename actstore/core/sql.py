"""DuckDB over a store's tables: read-only, without file access, bounded in memory and time.

Three layers, each enough on its own to stop a statement from writing:

1. **Statements.**  A query is parsed with DuckDB's own parser (``extract_statements``) and must be
   exactly one statement of type SELECT (``WITH``, ``FROM``-first, ``VALUES``, ``DESCRIBE``,
   ``SUMMARIZE`` and ``SHOW`` parse as SELECT).  Everything else is refused, EXPLAIN included:
   ``EXPLAIN ANALYZE`` executes the statement it explains.  A SELECT cannot contain another kind of
   statement (the grammar has no COPY or EXPLAIN subquery, and ``query()`` takes one SELECT).
   ``--where`` predicates are parsed as exactly one expression (:func:`predicate`).
2. **The connection.**  DuckDB gets no file access of its own (``enable_external_access = false``),
   no temporary directory (nothing spills, nothing is written), no extension loading, no Python
   replacement scans (a query cannot read the caller's variables), and a locked configuration.
   On a connection handed out (:func:`~actstore.core.sql_connect.connect`, ``format="relation"``) and for a store on an object
   store, every table is an Arrow dataset over the store's own Parquet files, read by pyarrow and
   registered with DuckDB, with no allowed directory or path at all.  A local store's own statements
   (:class:`~actstore.core.sql_session.SQLSession`, :func:`run_sql`) run on a database whose one allowed "directory" is a
   read-only Python file system serving exactly the store's table files whose hash and footer were
   checked (:mod:`actstore.core.sql_files`): DuckDB reads those Parquet files itself (row groups
   pruned, a Top-N bound pushed into the scan), and can neither write them nor open anything else.
3. **Limits.**  A memory limit (DuckDB's ``memory_limit``; with no temporary directory a query
   that needs more fails; and, as DuckDB does not count what scalar functions build, the process
   may grow by at most about twice the limit while the statement runs, see
   :data:`~actstore.core.sql_limits.GROWTH_FACTOR`) and a time limit (a timer thread interrupts the
   statement).  Defaults: :data:`~actstore.core.sql_limits.DEFAULT_MEMORY_LIMIT` and
   :data:`~actstore.core.sql_limits.DEFAULT_TIMEOUT`; per call (``Store.sql(..., memory_limit=,
   timeout=)``), per block of code (``with actstore.core.sql_limits.limits(...)``), or per command
   (``--sql-memory``, ``--sql-timeout``).

**Parameters.**  Values reach a statement as DuckDB parameters (``$name`` with a mapping, ``?`` or
``$1`` with a sequence: :func:`run_sql`'s ``params``, ``Store.sql(..., params=)``), never as text
pasted into it: the statement checked above is the statement that runs, and a value holding quotes,
semicolons or keywords is compared as data.

This module checks statements and runs them; the connection and the tables' views are
:mod:`actstore.core.sql_connect`'s, the connection a store keeps :mod:`actstore.core.sql_session`'s,
the limits :mod:`actstore.core.sql_limits`'s, and rendering results :mod:`actstore.core.sql_render`'s.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from actstore.core.dependencies import duckdb
from actstore.core.errors import QueryError, ReadOnlySQLError
from actstore.core.sql_connect import TableSource, connect, one_line, shared_database
from actstore.core.sql_limits import (
    GROWTH_FACTOR,
    GROWTH_SLACK,
    SQLLimits,
    _process_growth_cap,
    current_limits,
    size_bytes,
)
from actstore.core.sql_session import SQLSession

Params = Sequence[Any] | Mapping[str, Any]
"""SQL parameter values: a sequence for ``?`` / ``$1`` placeholders, a mapping for ``$name`` ones."""

ALLOWED_STATEMENTS = {"SELECT"}


_PARSER: list[duckdb.DuckDBPyConnection] = []  # a connection that only parses (json_serialize_sql)


def _parser() -> duckdb.DuckDBPyConnection:
    """The parsing connection (held under ``_PARSER_LOCK``): a cursor of the process's locked-down
    database, which the first statement needs anyway (a database of its own cost 15-40 ms more on a
    fresh process's first query)."""
    if not _PARSER:
        _PARSER.append(shared_database(current_limits(None).memory_limit).cursor())
    return _PARSER[0]


_PARSER_LOCK = threading.Lock()


def referenced_tables(query: str) -> set[str] | None:
    """Names a statement reads as tables (CTE names included), from DuckDB's parse tree, without
    binding it; None when that cannot be told (a table function such as ``query_table``), in which
    case every table is needed.  Parses are kept per statement text (a selection's statement is the
    same text each time: a parse is 2-6 ms)."""
    names = _referenced_tables(query)
    return None if names is None else set(names)


@functools.lru_cache(maxsize=512)
def _referenced_tables(query: str) -> frozenset[str] | None:

    with _PARSER_LOCK:
        try:
            row = _parser().execute("SELECT json_serialize_sql($q)", {"q": query}).fetchone()
        except duckdb.Error:
            return None
    tree = json.loads(row[0]) if row else {"error": True}
    if tree.get("error"):
        return None
    names: set[str] = set()
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "TABLE_FUNCTION":
                return None
            if kind == "BASE_TABLE" and isinstance(node.get("table_name"), str):
                names.add(node["table_name"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(names)


@functools.lru_cache(maxsize=512)
def where_tree(where: str) -> str | None:
    """DuckDB's parse tree (JSON text) of the WHERE clause of ``SELECT 1 FROM examples WHERE where``;
    None when it does not parse.  Kept per text (a selection's predicate is the same text each time)."""
    import duckdb

    with _PARSER_LOCK:
        try:
            row = (
                _parser()
                .execute("SELECT json_serialize_sql($q)", {"q": f"SELECT 1 FROM examples WHERE {where}"})
                .fetchone()
            )
        except duckdb.Error:
            return None
    tree: dict[str, Any] = json.loads(row[0]) if row else {"error": True}
    statements = tree.get("statements")
    if tree.get("error") or not isinstance(statements, list) or len(statements) != 1:
        return None
    return json.dumps(statements[0]["node"].get("where_clause"))


def _statement(query: str) -> duckdb.Statement:
    """The one statement ``query`` holds, parsed by DuckDB (nothing is bound or run)."""

    if not isinstance(query, str):
        raise QueryError(f"SQL must be a string (got {type(query).__name__})")
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {one_line(e)}") from None
    if len(statements) != 1:
        raise QueryError(f"SQL must be exactly one statement (got {len(statements)})")
    return statements[0]


def check_read_only(query: str) -> duckdb.Statement:
    """The parsed statement if it is one plain SELECT; otherwise an error naming its type."""
    stmt = _statement(query)
    kind = stmt.type.name
    if kind == "EXPLAIN":
        raise ReadOnlySQLError(
            "SQL is read-only: EXPLAIN statements are not allowed (EXPLAIN ANALYZE runs the "
            "statement it explains; only SELECT)"
        )
    if kind not in ALLOWED_STATEMENTS:
        raise ReadOnlySQLError(f"SQL is read-only: {kind} statements are not allowed (only SELECT)")
    return stmt


def subquery(query: str) -> str:
    """One SELECT statement as a parenthesised subquery, to be placed in a larger SELECT."""
    text = check_read_only(query).query.strip()
    while text.endswith(";"):
        text = text[:-1].rstrip()
    return "(\n" + text + "\n)"  # the newlines end a trailing -- comment inside the parentheses


def predicate(where: str) -> str:
    """A ``--where`` predicate, parsed as exactly one SQL expression, parenthesised for a WHERE clause.

    ``x = 1) UNION SELECT ...``, ``x = 1; DROP ...``, ``x = 1 ORDER BY 1`` and the like are refused
    by the parser; a trailing ``-- comment`` is fine (the parentheses are on their own lines).
    """
    if not isinstance(where, str):
        raise QueryError(f"the WHERE predicate must be a string (got {type(where).__name__})")

    try:
        duckdb.SQLExpression(where)
    except (duckdb.Error, ValueError, TypeError) as e:
        raise QueryError(
            f"SQL error: the WHERE predicate must be one SQL expression: {one_line(e)}"
        ) from None
    return "(\n" + where + "\n)"


def check_params(params: object) -> list[Any] | dict[str, Any] | None:
    """``params`` as DuckDB takes them: a list (``?``, ``$1``), a dict with string keys (``$name``), or None.
    A string or bytes is refused (it is a sequence, and would bind one character per placeholder)."""
    if params is None:
        return None
    if isinstance(params, Mapping):
        bad = [k for k in params if not isinstance(k, str)]
        if bad:
            raise QueryError(f"SQL parameter names must be strings (got {bad[0]!r})")
        return dict(params)
    if isinstance(params, (str, bytes, bytearray)) or not isinstance(params, Sequence):
        raise QueryError(f"SQL parameters must be a list or a dict of values (got {type(params).__name__})")
    return list(params)


def run_sql(
    store: TableSource,
    query: str,
    con: duckdb.DuckDBPyConnection | None = None,
    *,
    params: Params | None = None,
    memory_limit: str | None = None,
    timeout: float | None = None,
) -> pa.Table:
    """Execute one read-only SELECT eagerly, within the limits, and return its result as Arrow.

    ``params``: values bound to the statement's placeholders by DuckDB (see the module notes); the
    statement checked read-only is the one that runs.  ``memory_limit`` / ``timeout`` override the
    limits in force (:func:`limits`); the memory limit applies only when this call opens the
    connection (``con`` is None).  Without ``con``, a store that keeps a :class:`SQLSession`
    (``store.sql_session()``) runs the statement on its connection, else a new one is opened and closed.
    """
    stmt = check_read_only(query)
    bound = check_params(params)
    lim = current_limits(memory_limit, timeout)
    if con is not None:
        return _execute(con, stmt, bound, lim)
    session_of = getattr(store, "sql_session", None)
    session = session_of() if callable(session_of) else None
    if isinstance(session, SQLSession) and store.location.paths_open_directly():
        with session.cursor(store, lim.memory_limit, referenced_tables(stmt.query)) as con:
            return _execute(con, stmt, bound, lim)
    if isinstance(session, SQLSession):
        with session.lock:
            return _execute(
                session.connection(store, lim.memory_limit, referenced_tables(stmt.query)), stmt, bound, lim
            )
    own = connect(store, memory_limit=lim.memory_limit)
    try:
        return _execute(own, stmt, bound, lim)
    finally:
        own.close()


def relation(
    store: TableSource,
    query: str,
    params: Params | None = None,
    memory_limit: str | None = None,
    timeout: float | None = None,
) -> duckdb.DuckDBPyRelation:
    """One read-only SELECT as a lazy DuckDB relation over a new locked-down connection (the memory
    limit applies; the time limit does not, as nothing runs until the relation is read)."""
    stmt = check_read_only(query)
    con = connect(store, memory_limit=current_limits(memory_limit, timeout).memory_limit)
    try:
        return con.sql(stmt, params=check_params(params))
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {' '.join(str(e).split())}") from None


def _execute(
    con: duckdb.DuckDBPyConnection,
    stmt: duckdb.Statement,
    bound: list[Any] | dict[str, Any] | None,
    lim: SQLLimits,
) -> pa.Table:

    fired = threading.Event()
    timer = None
    if lim.timeout is not None:
        target = con

        def stop() -> None:
            fired.set()
            target.interrupt()

        timer = threading.Timer(lim.timeout, stop)
        timer.daemon = True
        timer.start()
    try:
        with _process_growth_cap(GROWTH_FACTOR * size_bytes(lim.memory_limit) + GROWTH_SLACK):
            return con.sql(stmt, params=bound).to_arrow_table()
    except duckdb.InterruptException:
        if fired.is_set():
            raise QueryError(
                f"SQL error: the query ran longer than the time limit of {lim.timeout:g} s and was "
                "stopped (raise it with --sql-timeout or timeout=)"
            ) from None
        raise QueryError("SQL error: the query was interrupted") from None
    except (duckdb.OutOfMemoryException, MemoryError):
        raise QueryError(
            f"SQL error: the query needs more memory than the limit of {lim.memory_limit} "
            "(raise it with --sql-memory or memory_limit=)"
        ) from None
    except duckdb.PermissionException as e:
        raise ReadOnlySQLError(f"SQL may only read the store's tables: {one_line(e)}") from None
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {one_line(e)}") from None
    finally:
        if timer is not None:
            timer.cancel()
            # Wait for the timer's thread to end: it holds the connection (``stop``), and a thread still
            # ending when the interpreter finalises would drop that last reference there, running
            # DuckDB's C++ destructor in a thread being stopped (SIGABRT after a successful command).
            timer.join()
