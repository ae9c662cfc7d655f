"""The SQL connection a store keeps between statements (:class:`SQLSession`), and a local store's own
database (:class:`FileDatabase`), whose views DuckDB reads from the store's checked table files."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator

import pyarrow as pa

from actstore.core.dependencies import duckdb
from actstore.core.dependencies import pyarrow_dataset as pads
from actstore.core.sql_connect import (
    TableSource,
    new_connection,
    quote,
    register_table,
    shared_database,
    table_dataset,
)

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
        self.db = new_connection(memory_limit, self.files)
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
                        f"CREATE VIEW {quote(name)} AS SELECT * FROM {view_source(paths, schemas)}"
                    )
                else:
                    data = table_dataset(store, files) if files else store.table(name, files=files)
                    self.arrow[name] = (tuple(files), data)
                self.views[name] = tuple(files)

    def _drop(self, name: str) -> None:
        with contextlib.suppress(duckdb.Error):
            self.db.execute(f"DROP VIEW IF EXISTS {quote(name)}")

    def _sync(self, con: duckdb.DuckDBPyConnection) -> None:
        """The cursor's ``TEMP`` views of the Arrow tables as they are now (hold ``lock``)."""
        mine = self._registered.setdefault(id(con), {})
        for name in [n for n in mine if n not in self.arrow or mine[n] != self.arrow[n][0]]:
            con.execute(f"DROP VIEW IF EXISTS temp.{quote(name)}")
            with contextlib.suppress(Exception):
                con.unregister(f"__arrow_{name}")
            del mine[name]
        for name, (files, data) in self.arrow.items():
            if name not in mine:
                source = f"__arrow_{name}"
                con.register(source, data)
                con.execute(f"CREATE OR REPLACE TEMP VIEW {quote(name)} AS SELECT * FROM {quote(source)}")
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
            self._con = shared_database(memory_limit).cursor()
            self._key, self._views = key, {}
        con = self._con
        listed, every = store.statement_files(tables)  # (no listing for segment tables and heads)
        for gone in [n for n in self._views if every and n not in listed]:
            con.execute(f"DROP VIEW IF EXISTS {quote(gone)}")
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
            register_table(con, store, name, listed[name])
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
