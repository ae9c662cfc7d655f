"""DuckDB over a store's tables: read-only, without file access, bounded in memory and time.

Three layers, each enough on its own to stop a statement from writing:

1. **Statements.**  A query is parsed with DuckDB's own parser (``extract_statements``) and must be
   exactly one statement of type SELECT (``WITH``, ``FROM``-first, ``VALUES``, ``DESCRIBE``,
   ``SUMMARIZE`` and ``SHOW`` parse as SELECT).  Everything else is refused, EXPLAIN included:
   ``EXPLAIN ANALYZE`` executes the statement it explains.  A SELECT cannot contain another kind of
   statement (the grammar has no COPY or EXPLAIN subquery, and ``query()`` takes one SELECT).
   ``--where`` predicates are parsed as exactly one expression (:func:`predicate`).
2. **The connection.**  Every table is an Arrow dataset over the store's own Parquet files, read by
   pyarrow and registered with DuckDB; DuckDB itself then gets no file access at all
   (``enable_external_access = false`` with no allowed directories or paths), no temporary
   directory (nothing spills, nothing is written), no extension loading, no Python replacement
   scans (a query cannot read the caller's variables), and a locked configuration.
3. **Limits.**  A memory limit (DuckDB's ``memory_limit``; with no temporary directory a query
   that needs more fails; and, as DuckDB does not count what scalar functions build, the process
   may grow by at most about twice the limit while the statement runs, see :data:`GROWTH_FACTOR`)
   and a time limit (a timer thread interrupts the statement).  Defaults:
   :data:`DEFAULT_MEMORY_LIMIT` and :data:`DEFAULT_TIMEOUT`; per call (``Store.sql(...,
   memory_limit=, timeout=)``), per block of code (``with actstore.sql.limits(...)``), or per
   command (``--sql-memory``, ``--sql-timeout``).

**Parameters.**  Values reach a statement as DuckDB parameters (``$name`` with a mapping, ``?`` or
``$1`` with a sequence: :func:`run_sql`'s ``params``, ``Store.sql(..., params=)``), never as text
pasted into it: the statement checked above is the statement that runs, and a value holding quotes,
semicolons or keywords is compared as data.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from actstore.errors import CorruptStoreError, QueryError, ReadOnlySQLError

if TYPE_CHECKING:  # duckdb and pyarrow.dataset are imported when a statement runs: the CLI starts fast
    import duckdb
    import pyarrow.dataset as pads

    from actstore.fs import StoreLocation

Params = Sequence[Any] | Mapping[str, Any]
"""SQL parameter values: a sequence for ``?`` / ``$1`` placeholders, a mapping for ``$name`` ones."""


class TableSource(Protocol):
    """What this module needs of a store (:class:`actstore.store.Store` is one): its location and
    its visible, checked table files.  A protocol, so the store imports this module and not back."""

    location: StoreLocation

    @property
    def url(self) -> str: ...

    def table_files(self) -> dict[str, list[str]]: ...

    def table(self, name: str, columns: list[str] | None = None, *, files: list[str] | None = None) -> pa.Table: ...

    def check_table_shards(self, names: Iterable[str] | None = None) -> None: ...

    def file_schema(self, rel: str) -> pa.Schema: ...

ALLOWED_STATEMENTS = {"SELECT"}
DEFAULT_MEMORY_LIMIT = "4GB"
DEFAULT_TIMEOUT = 600.0  # seconds
THREADS = 2

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_bytes(text: str) -> int:
    """``"512MB"`` -> 512_000_000 (DuckDB's units: KB/MB/GB powers of 1000, KiB/MiB/GiB of 1024)."""
    m = _SIZE.match(check_memory_limit(text))
    assert m is not None
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_memory_limit(text: str) -> str:
    """``text`` if it is a size DuckDB understands (``512MB``, ``4GB``, ``1.5GiB``), else a QueryError."""
    if not isinstance(text, str) or not _SIZE.match(text):
        raise QueryError(f"SQL memory limit {text!r} is not a size like 512MB or 4GB")
    return text.strip()


@dataclass(frozen=True)
class SQLLimits:
    """What one SQL statement may use.  ``timeout``: seconds, ``None`` for no time limit."""

    memory_limit: str = DEFAULT_MEMORY_LIMIT
    timeout: float | None = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        check_memory_limit(self.memory_limit)
        if self.timeout is not None and not self.timeout > 0:
            raise QueryError(f"SQL time limit must be a positive number of seconds (got {self.timeout!r})")


_LIMITS: ContextVar[SQLLimits | None] = ContextVar("actstore_sql_limits", default=None)  # None: the defaults


def current_limits(memory_limit: str | None = None, timeout: float | None = None) -> SQLLimits:
    """The limits in force (see :func:`limits`), with ``memory_limit`` / ``timeout`` overriding them."""
    lim = _LIMITS.get() or SQLLimits()
    if memory_limit is not None:
        lim = replace(lim, memory_limit=memory_limit)
    if timeout is not None:
        lim = replace(lim, timeout=None if timeout == 0 else timeout)  # a negative one is refused
    return lim


@contextmanager
def limits(memory_limit: str | None = None, timeout: float | None = None) -> Iterator[SQLLimits]:
    """Run every SQL statement inside the block with these limits (``timeout=0``: no time limit).

    >>> with actstore.sql.limits(memory_limit="1GB", timeout=30):
    ...     store.select("relation_id = 'P17'")
    """
    token = _LIMITS.set(current_limits(memory_limit, timeout))
    try:
        yield current_limits()
    finally:
        _LIMITS.reset(token)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _dataset(store: TableSource, files: list[str]) -> pads.Dataset:
    """A table's local files as one dataset; columns missing from a file read as NULL (``union_by_name``).
    Each file's schema comes from the store (read with its footer when its hash was checked)."""
    import pyarrow.dataset as pads

    paths = [store.location.path(f) for f in files]
    schemas = [store.file_schema(rel) for rel in files]
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive") if len(schemas) > 1 else schemas[0]
    except pa.ArrowException as e:
        raise CorruptStoreError(f"{store.url}: the files of one table have incompatible schemas ({_one_line(e)})"
                                ) from None
    return pads.dataset(paths, schema=schema, format="parquet")


def _new_connection(memory_limit: str) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection, locked down (see the module notes), with no table yet."""
    import duckdb

    con = duckdb.connect(":memory:", config={
        "autoinstall_known_extensions": False, "autoload_known_extensions": False,
        "allow_community_extensions": False, "threads": THREADS, "python_enable_replacements": False,
        "temp_directory": "", "max_temp_directory_size": "0B", "memory_limit": memory_limit,
    })
    try:
        con.execute("SET enable_external_access = false")  # no allowed directories or paths: none at all
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


def _register(con: duckdb.DuckDBPyConnection, store: TableSource, name: str, files: list[str]) -> None:
    """(Re)define view ``name`` over the table's ``files``.  Every file is checked first (its hash and
    Parquet footer: a corrupt shard is an error, never silently wrong rows), by the store's
    :meth:`file_schema` for a dataset and by :meth:`table` for a table read into memory."""
    loc = store.location
    source = f"__arrow_{name}"
    data: pa.Table | pads.Dataset
    if files and loc.is_local:  # scanned from the files (only the columns and row groups a statement reads)
        data = _dataset(store, files)
    else:  # an object store: read into memory once (cached by the store)
        data = store.table(name, files=files)
    with contextlib.suppress(Exception):
        con.unregister(source)
    con.register(source, data)
    # TEMP: the view belongs to this connection alone (sessions of several stores share one database).
    con.execute(f"CREATE OR REPLACE TEMP VIEW {_quote(name)} AS SELECT * FROM {_quote(source)}")


def connect(store: TableSource, *, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A locked-down in-memory DuckDB connection with one view per store table.

    DuckDB has no file access on it (the tables are Arrow datasets read by pyarrow), no
    temporary directory and the memory limit in force (:func:`limits`); the configuration is
    locked.  A time limit applies to statements run through :func:`run_sql` only.
    """
    con = _new_connection(current_limits(memory_limit).memory_limit)
    try:
        if store.location.is_local:
            store.check_table_shards()  # a corrupt shard is an error, never silently wrong rows
        for name, files in store.table_files().items():
            _register(con, store, name, files)
    except BaseException:
        con.close()
        raise
    return con


_PARSER: list[duckdb.DuckDBPyConnection] = []  # a bare connection that only parses (json_serialize_sql)
_PARSER_LOCK = threading.Lock()


def referenced_tables(query: str) -> set[str] | None:
    """Names a statement reads as tables (CTE names included), from DuckDB's parse tree, without
    binding it; None when that cannot be told (a table function such as ``query_table``), in which
    case every table is needed."""
    import duckdb

    with _PARSER_LOCK:
        if not _PARSER:
            _PARSER.append(duckdb.connect(":memory:"))
        try:
            row = _PARSER[0].execute("SELECT json_serialize_sql($q)", {"q": query}).fetchone()
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
    return names


_DATABASES: dict[tuple[int, str], duckdb.DuckDBPyConnection] = {}  # (pid, memory limit) -> locked database
_DATABASES_LOCK = threading.Lock()


def _database(memory_limit: str) -> duckdb.DuckDBPyConnection:
    """The process's locked-down in-memory database for this memory limit, made once (a new DuckDB
    database costs 15-40 ms; a connection to an existing one, :meth:`cursor`, a few microseconds)."""
    import os

    key = (os.getpid(), memory_limit)
    with _DATABASES_LOCK:
        db = _DATABASES.get(key)
        if db is None:
            db = _DATABASES[key] = _new_connection(memory_limit)
        return db


class SQLSession:
    """The SQL connection a store keeps (:meth:`actstore.store.Store.sql`) between statements.

    It is a connection to the process's locked-down in-memory database (one per memory limit), with
    the store's tables as views of its own (``TEMP``: other stores' sessions on the same database do
    not see them).  A table's view is made when a statement first reads that table, and made again
    when its files changed (a new result file, new segments after ``refresh``); tables a statement
    does not read are not opened (their files are checked, once).  Statements of one session run one at a time
    (``lock``).  Another memory limit, or a forked process, gets another connection.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._key: tuple[int, str] | None = None
        self._views: dict[str, tuple[str, ...]] = {}

    def connection(self, store: TableSource, memory_limit: str, tables: set[str] | None) -> duckdb.DuckDBPyConnection:
        """The connection, with current views of ``tables`` (all tables when None); hold ``lock``."""
        import os

        key = (os.getpid(), memory_limit)
        if self._con is None or self._key != key:
            if self._con is not None and self._key is not None and self._key[0] == key[0]:
                self._con.close()
            self._con = _database(memory_limit).cursor()
            self._key, self._views = key, {}
        con = self._con
        listed = store.table_files()
        for gone in [n for n in self._views if n not in listed]:
            con.execute(f"DROP VIEW IF EXISTS {_quote(gone)}")
            del self._views[gone]
        wanted = [n for n in listed if tables is None or n in tables]
        stale = [n for n in wanted if self._views.get(n) != tuple(listed[n])]
        # Every visible table file is checked (hash, Parquet footer; each file once per store), not only
        # those of the tables this statement reads: a damaged store fails every statement, as it says.
        store.check_table_shards()
        for name in stale:
            self._views.pop(name, None)
            _register(con, store, name, listed[name])
            self._views[name] = tuple(listed[name])
        return con

    def close(self) -> None:
        import os

        with self.lock:
            if self._con is not None and self._key is not None and self._key[0] == os.getpid():
                self._con.close()
            self._con, self._key, self._views = None, None, {}


def _statement(query: str) -> duckdb.Statement:
    """The one statement ``query`` holds, parsed by DuckDB (nothing is bound or run)."""
    import duckdb

    if not isinstance(query, str):
        raise QueryError(f"SQL must be a string (got {type(query).__name__})")
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_one_line(e)}") from None
    if len(statements) != 1:
        raise QueryError(f"SQL must be exactly one statement (got {len(statements)})")
    return statements[0]


def check_read_only(query: str) -> duckdb.Statement:
    """The parsed statement if it is one plain SELECT; otherwise an error naming its type."""
    stmt = _statement(query)
    kind = stmt.type.name
    if kind == "EXPLAIN":
        raise ReadOnlySQLError("SQL is read-only: EXPLAIN statements are not allowed (EXPLAIN ANALYZE runs the "
                               "statement it explains; only SELECT)")
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
    import duckdb

    try:
        duckdb.SQLExpression(where)
    except (duckdb.Error, ValueError, TypeError) as e:
        raise QueryError(f"SQL error: the WHERE predicate must be one SQL expression: {_one_line(e)}") from None
    return "(\n" + where + "\n)"


# DuckDB's memory_limit covers its buffer manager (hash tables, sorts, materialised results), not the
# vectors a scalar function fills: range(1000000000) builds an 8 GB list whatever the limit.  So while a
# statement runs, the process's data segment (RLIMIT_DATA: heap and private mappings, Linux) may grow by
# at most GROWTH_FACTOR x the memory limit + GROWTH_SLACK (the result as Arrow, data in flight); an
# allocation past that fails and DuckDB ends the statement with its out-of-memory error.
GROWTH_FACTOR = 2
GROWTH_SLACK = 256 << 20


def _data_bytes() -> int | None:
    """The process's data segment in bytes (VmData), None where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _GrowthCap:
    """RLIMIT_DATA set to (data segment when the first statement started) + the sum of the running
    statements' allowances; restored when the last one ends.  A no-op without RLIMIT_DATA or /proc."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.budget = 0
        self.saved: tuple[int, int] | None = None

    def _apply(self) -> None:
        import resource

        assert self.saved is not None
        soft, hard = self.saved
        cap = self.budget
        for other in (soft, hard):  # never looser than a limit the user set
            if other != resource.RLIM_INFINITY:
                cap = min(cap, other)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))

    def _enter(self, extra: int) -> bool:
        try:
            import resource
        except ImportError:
            return False
        with self.lock:
            if self.active == 0:
                now = _data_bytes()
                if now is None:
                    return False
                self.saved = resource.getrlimit(resource.RLIMIT_DATA)
                self.budget = now
            self.budget += extra
            self.active += 1
            self._apply()
        return True

    def _exit(self, extra: int) -> None:
        import resource

        with self.lock:
            self.active -= 1
            self.budget -= extra
            if self.active == 0:
                assert self.saved is not None
                resource.setrlimit(resource.RLIMIT_DATA, self.saved)
                self.saved = None
            else:
                self._apply()

    @contextmanager
    def __call__(self, extra: int) -> Iterator[None]:
        entered = self._enter(extra)
        try:
            yield
        finally:
            if entered:
                self._exit(extra)


_process_growth_cap = _GrowthCap()


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


def run_sql(store: TableSource, query: str, con: duckdb.DuckDBPyConnection | None = None, *,
            params: Params | None = None, memory_limit: str | None = None,
            timeout: float | None = None) -> pa.Table:
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
    if isinstance(session, SQLSession):
        with session.lock:
            return _execute(session.connection(store, lim.memory_limit, referenced_tables(stmt.query)), stmt,
                            bound, lim)
    own = connect(store, memory_limit=lim.memory_limit)
    try:
        return _execute(own, stmt, bound, lim)
    finally:
        own.close()


def _execute(con: duckdb.DuckDBPyConnection, stmt: duckdb.Statement, bound: list[Any] | dict[str, Any] | None,
             lim: SQLLimits) -> pa.Table:
    import duckdb

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
            raise QueryError(f"SQL error: the query ran longer than the time limit of {lim.timeout:g} s and was "
                             "stopped (raise it with --sql-timeout or timeout=)") from None
        raise QueryError("SQL error: the query was interrupted") from None
    except (duckdb.OutOfMemoryException, MemoryError):
        raise QueryError(f"SQL error: the query needs more memory than the limit of {lim.memory_limit} "
                         "(raise it with --sql-memory or memory_limit=)") from None
    except duckdb.PermissionException as e:
        raise ReadOnlySQLError(f"SQL may only read the store's tables: {_one_line(e)}") from None
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_one_line(e)}") from None
    finally:
        if timer is not None:
            timer.cancel()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# ------------------------------------------------------------------ printing results
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
