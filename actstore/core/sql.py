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
   On a connection handed out (:func:`connect`, ``format="relation"``) and for a store on an object
   store, every table is an Arrow dataset over the store's own Parquet files, read by pyarrow and
   registered with DuckDB, with no allowed directory or path at all.  A local store's own statements
   (:class:`SQLSession`, :func:`run_sql`) run on a database whose one allowed "directory" is a
   read-only Python file system serving exactly the store's table files whose hash and footer were
   checked (:mod:`actstore.core.sql_files`): DuckDB reads those Parquet files itself (row groups
   pruned, a Top-N bound pushed into the scan), and can neither write them nor open anything else.
3. **Limits.**  A memory limit (DuckDB's ``memory_limit``; with no temporary directory a query
   that needs more fails; and, as DuckDB does not count what scalar functions build, the process
   may grow by at most about twice the limit while the statement runs, see :data:`GROWTH_FACTOR`)
   and a time limit (a timer thread interrupts the statement).  Defaults:
   :data:`DEFAULT_MEMORY_LIMIT` and :data:`DEFAULT_TIMEOUT`; per call (``Store.sql(...,
   memory_limit=, timeout=)``), per block of code (``with actstore.core.sql.limits(...)``), or per
   command (``--sql-memory``, ``--sql-timeout``).

**Parameters.**  Values reach a statement as DuckDB parameters (``$name`` with a mapping, ``?`` or
``$1`` with a sequence: :func:`run_sql`'s ``params``, ``Store.sql(..., params=)``), never as text
pasted into it: the statement checked above is the statement that runs, and a value holding quotes,
semicolons or keywords is compared as data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from actstore.core.dependencies import duckdb
from actstore.core.dependencies import pyarrow_dataset as pads
from actstore.core.errors import CorruptStoreError, QueryError, ReadOnlySQLError
from actstore.core.sql_limits import (  # noqa: F401 - part of this module's interface
    DEFAULT_MEMORY_LIMIT,
    DEFAULT_TIMEOUT,
    GROWTH_FACTOR,
    GROWTH_SLACK,
    SQLLimits,
    _process_growth_cap,
    check_memory_limit,
    current_limits,
    limits,
    size_bytes,
)
from actstore.core.sql_render import render  # noqa: F401 - part of this module's interface

if TYPE_CHECKING:
    from actstore.core.fs import StoreLocation
    from actstore.core.sql_files import CheckedFiles

Params = Sequence[Any] | Mapping[str, Any]
"""SQL parameter values: a sequence for ``?`` / ``$1`` placeholders, a mapping for ``$name`` ones."""


class TableSource(Protocol):
    """What this module needs of a store (:class:`actstore.core.store.StoreReader` is one): its location and
    its visible, checked table files.  A protocol, so the store imports this module and not back."""

    location: StoreLocation

    @property
    def url(self) -> str: ...

    def table_files(self) -> dict[str, list[str]]: ...

    def statement_files(self, tables: set[str] | None) -> tuple[dict[str, list[str]], bool]: ...

    def table(
        self, name: str, columns: list[str] | None = None, *, files: list[str] | None = None
    ) -> pa.Table: ...

    def check_table_shards(
        self, names: Iterable[str] | None = None, listed: dict[str, list[str]] | None = None
    ) -> None: ...

    def file_schema(self, rel: str) -> pa.Schema: ...


ALLOWED_STATEMENTS = {"SELECT"}
THREADS = 2


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _dataset(store: TableSource, files: list[str]) -> pads.Dataset:
    """A table's local files as one dataset; columns missing from a file read as NULL (``union_by_name``).
    Each file's schema comes from the store (read with its footer when its hash was checked)."""

    paths = [store.location.path(f) for f in files]
    schemas = [store.file_schema(rel) for rel in files]
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive") if len(schemas) > 1 else schemas[0]
    except pa.ArrowException as e:
        raise CorruptStoreError(
            f"{store.url}: the files of one table have incompatible schemas ({_one_line(e)})"
        ) from None
    data = pads.dataset(paths, schema=schema, format="parquet")
    for fragment in data.get_fragments():  # footers read once, kept: a scan then skips row groups by their
        fragment.ensure_complete_metadata()  # statistics without reading the footer again (2-3x per point query)
    return data


def _new_connection(memory_limit: str, files: CheckedFiles | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection, locked down (see the module notes), with no table yet.
    ``files``: a read-only file system of checked table files (:mod:`actstore.core.sql_files`), the
    only "directory" DuckDB may then read from."""

    con = duckdb.connect(
        ":memory:",
        config={
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "allow_community_extensions": False,
            "threads": THREADS,
            "python_enable_replacements": False,
            "temp_directory": "",
            "max_temp_directory_size": "0B",
            "memory_limit": memory_limit,
        },
    )
    try:
        if files is not None:
            from actstore.core.sql_files import PREFIX

            con.register_filesystem(files)
            # footers read once a file (GLOBAL: a session setting would not reach the cursors)
            con.execute("SET GLOBAL parquet_metadata_cache = true")
            con.execute(f"SET allowed_directories = ['{PREFIX}']")  # the read-only checked files alone
        con.execute("SET enable_external_access = false")  # else no allowed directories or paths: none at all
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
        for name, files in store.statement_files(None)[0].items():
            _register(con, store, name, files)
    except BaseException:
        con.close()
        raise
    return con


_PARSER: list[duckdb.DuckDBPyConnection] = []  # a connection that only parses (json_serialize_sql)


def _parser() -> duckdb.DuckDBPyConnection:
    """The parsing connection (held under ``_PARSER_LOCK``): a cursor of the process's locked-down
    database, which the first statement needs anyway (a database of its own cost 15-40 ms more on a
    fresh process's first query)."""
    if not _PARSER:
        _PARSER.append(_database(current_limits(None).memory_limit).cursor())
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


_DATABASES: dict[tuple[int, str], duckdb.DuckDBPyConnection] = {}  # (pid, memory limit) -> locked database
_DATABASES_LOCK = threading.Lock()


def _database(memory_limit: str) -> duckdb.DuckDBPyConnection:
    """The process's locked-down in-memory database for this memory limit, made once (a new DuckDB
    database costs 15-40 ms; a connection to an existing one, :meth:`cursor`, a few microseconds)."""

    key = (os.getpid(), memory_limit)
    with _DATABASES_LOCK:
        db = _DATABASES.get(key)
        if db is None:
            db = _DATABASES[key] = _new_connection(memory_limit)
        return db


#: A table of at most this many files is read by DuckDB through the checked-files file system; one of
#: more (the shards of a store not compacted) through an Arrow dataset, as DuckDB opens every file of
#: a table through Python for each statement (about 0.2-0.35 ms a file: 455 against 133 ms CPU for a
#: point query over 1,300 shards).
MAX_FILE_VIEW_FILES = 64


class FileDatabase:
    """A local store's own locked-down in-memory database (one per memory limit), whose views read
    the store's checked table files through a read-only file system (:mod:`actstore.core.sql_files`):
    DuckDB's Parquet reader then prunes row groups and pushes a Top-N bound into the scan.  A table
    of more than :data:`MAX_FILE_VIEW_FILES` files, of none, or of a path DuckDB would take for a
    pattern is an Arrow dataset (or table) instead, registered on each cursor as a ``TEMP`` view.

    Statements run in parallel, each on a cursor of its own (a connection to this database, taken
    from a pool and put back); the file views belong to the database, so every cursor sees them.
    Views are made and remade under ``lock`` (the files of a table are checked before its view is
    made or its files put on the file system's list)."""

    def __init__(self, memory_limit: str) -> None:
        from actstore.core.sql_files import CheckedFiles

        self.files = CheckedFiles()
        self.db = _new_connection(memory_limit, self.files)
        _LIVE_DATABASES.add(self)
        self.lock = threading.Lock()
        self.views: dict[str, tuple[str, ...]] = {}
        #: the tables read through Arrow: name -> (files, dataset or table)
        self.arrow: dict[str, tuple[tuple[str, ...], pa.Table | pads.Dataset]] = {}
        self._free: list[duckdb.DuckDBPyConnection] = []
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._registered: dict[int, dict[str, tuple[str, ...]]] = {}  # id(cursor) -> its Arrow views

    def prepare(self, store: TableSource, tables: set[str] | None) -> None:
        """Current views of ``tables`` (all tables when None), their files checked (see
        :meth:`SQLSession.connection`)."""
        from actstore.core.sql_files import readable, view_source

        with self.lock:
            listed, every = store.statement_files(tables)
            for gone in [n for n in self.views if every and n not in listed]:
                self._drop(gone)
                del self.views[gone]
                self.arrow.pop(gone, None)
            wanted = [n for n in listed if tables is None or n in tables]
            store.check_table_shards(None if tables is None else wanted, listed)
            loc = store.location
            checked = listed if tables is None else {n: listed[n] for n in wanted}
            self.files.allow([loc.path(f) for files in checked.values() for f in files])
            for name in [n for n in wanted if self.views.get(n) != tuple(listed[n])]:
                self.views.pop(name, None)
                self.arrow.pop(name, None)
                self._drop(name)
                files = listed[name]
                paths = [loc.path(f) for f in files]
                if files and len(files) <= MAX_FILE_VIEW_FILES and readable(paths):
                    schemas = [store.file_schema(f) for f in files]
                    self.db.execute(
                        f"CREATE VIEW {_quote(name)} AS SELECT * FROM {view_source(paths, schemas)}"
                    )
                else:
                    data = _dataset(store, files) if files else store.table(name, files=files)
                    self.arrow[name] = (tuple(files), data)
                self.views[name] = tuple(files)

    def _drop(self, name: str) -> None:
        with contextlib.suppress(duckdb.Error):
            self.db.execute(f"DROP VIEW IF EXISTS {_quote(name)}")

    def _sync(self, con: duckdb.DuckDBPyConnection) -> None:
        """The cursor's ``TEMP`` views of the Arrow tables as they are now (hold ``lock``)."""
        mine = self._registered.setdefault(id(con), {})
        for name in [n for n in mine if n not in self.arrow or mine[n] != self.arrow[n][0]]:
            con.execute(f"DROP VIEW IF EXISTS temp.{_quote(name)}")
            with contextlib.suppress(Exception):
                con.unregister(f"__arrow_{name}")
            del mine[name]
        for name, (files, data) in self.arrow.items():
            if name not in mine:
                source = f"__arrow_{name}"
                con.register(source, data)
                con.execute(f"CREATE OR REPLACE TEMP VIEW {_quote(name)} AS SELECT * FROM {_quote(source)}")
                mine[name] = files

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor of this database for one statement (from the pool, put back after), with the
        current Arrow views."""
        with self.lock:
            if self._free:
                con = self._free.pop()
            else:
                con = self.db.cursor()
                self._cursors.append(con)
            try:
                self._sync(con)
            except BaseException:
                self._free.append(con)
                raise
        try:
            yield con
        finally:
            with self.lock:
                self._free.append(con)

    def close(self) -> None:
        with self.lock:
            for con in self._cursors:
                con.close()
            self.db.close()
            self._free, self._cursors = [], []


#: Every FileDatabase made in this process (weakly held), and those a forked child inherited (held for
#: good): a DuckDB database made before a fork must never be closed in the child, where its threads do
#: not exist (closing it there hung, or crashed the child).
_LIVE_DATABASES: weakref.WeakSet[FileDatabase] = weakref.WeakSet()
_INHERITED_DATABASES: list[FileDatabase] = []


def _keep_inherited_databases() -> None:
    _INHERITED_DATABASES.extend(_LIVE_DATABASES)
    _LIVE_DATABASES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_inherited_databases)


class SQLSession:
    """The SQL connection a store keeps (:meth:`actstore.core.store.StoreReader.sql`) between statements.

    A local store's statements run on a database of the store's own (:class:`FileDatabase`, one per
    memory limit), each on a cursor of its own, so that statements of several threads run in
    parallel; DuckDB reads the store's checked table files itself, through a read-only file system
    that serves those files alone (:mod:`actstore.core.sql_files`).

    A store on an object store runs its statements on a connection to the process's locked-down
    in-memory database (one per memory limit), with the store's tables read into memory as views of
    its own (``TEMP``: other stores' sessions on the same database do not see them), one statement
    at a time (``lock``).

    Either way, a table's view is made when a statement first reads that table, and made again
    when its files changed (new segments or result files after ``refresh``, a result written through
    the store; :meth:`~actstore.core.store_tables.TableFiles.statement_files`); tables a statement
    does not read are neither opened nor checked (a table's files are checked once, when a statement
    first reads it).  Another memory limit, or a forked process, gets another connection.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._key: tuple[int, str] | None = None
        self._views: dict[str, tuple[str, ...]] = {}
        self._databases: dict[tuple[int, str], FileDatabase] = {}

    def database(self, memory_limit: str) -> FileDatabase:
        """The store's own database for this memory limit (made on first use; see :class:`FileDatabase`)."""
        key = (os.getpid(), memory_limit)
        with self.lock:
            db = self._databases.get(key)
            if db is None:
                db = self._databases[key] = FileDatabase(memory_limit)
            return db

    @contextlib.contextmanager
    def cursor(
        self, store: TableSource, memory_limit: str, tables: set[str] | None
    ) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor for one statement of a local store, with current views of ``tables``."""
        db = self.database(memory_limit)
        db.prepare(store, tables)
        with db.cursor() as con:
            yield con

    def connection(
        self, store: TableSource, memory_limit: str, tables: set[str] | None
    ) -> duckdb.DuckDBPyConnection:
        """The connection, with current views of ``tables`` (all tables when None); hold ``lock``."""

        key = (os.getpid(), memory_limit)
        if self._con is None or self._key != key:
            if self._con is not None and self._key is not None and self._key[0] == key[0]:
                self._con.close()
            self._con = _database(memory_limit).cursor()
            self._key, self._views = key, {}
        con = self._con
        listed, every = store.statement_files(tables)  # (no listing for segment tables and heads)
        for gone in [n for n in self._views if every and n not in listed]:
            con.execute(f"DROP VIEW IF EXISTS {_quote(gone)}")
            del self._views[gone]
        wanted = [n for n in listed if tables is None or n in tables]
        stale = [n for n in wanted if self._views.get(n) != tuple(listed[n])]
        # The files of the tables this statement reads are checked (hash, Parquet footer; each file once per
        # store): a damaged table fails every statement that reads it, and no statement returns rows from a
        # file that does not match its hash.  Tables it does not read are not opened (``actstore verify``
        # checks them all); when the tables cannot be told (``tables`` None), every file is checked.
        store.check_table_shards(None if tables is None else wanted, listed)
        for name in stale:
            self._views.pop(name, None)
            _register(con, store, name, listed[name])
            self._views[name] = tuple(listed[name])
        return con

    def close(self) -> None:

        with self.lock:
            if self._con is not None and self._key is not None and self._key[0] == os.getpid():
                self._con.close()
            for key, db in self._databases.items():
                if key[0] == os.getpid():
                    db.close()
            self._con, self._key, self._views, self._databases = None, None, {}, {}


def _statement(query: str) -> duckdb.Statement:
    """The one statement ``query`` holds, parsed by DuckDB (nothing is bound or run)."""

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
            f"SQL error: the WHERE predicate must be one SQL expression: {_one_line(e)}"
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
    if isinstance(session, SQLSession) and store.location.is_local:
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
        raise ReadOnlySQLError(f"SQL may only read the store's tables: {_one_line(e)}") from None
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_one_line(e)}") from None
    finally:
        if timer is not None:
            timer.cancel()
            # Wait for the timer's thread to end: it holds the connection (``stop``), and a thread still
            # ending when the interpreter finalises would drop that last reference there, running
            # DuckDB's C++ destructor in a thread being stopped (SIGABRT after a successful command).
            timer.join()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
