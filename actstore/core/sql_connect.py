"""The locked-down DuckDB connection, and a store's tables as views on it.

The connection is the second of the SQL sandbox's three layers (:mod:`actstore.core.sql` describes
all three): no file access of its own, no temporary directory, no extension loading, no Python
replacement scans, a memory limit, a locked configuration.  A store's tables reach it as Arrow
datasets or tables registered with DuckDB (:func:`register_table`); a local store's own database
(:mod:`actstore.core.sql_session`) may instead read its checked table files through a read-only
file system (:mod:`actstore.core.sql_files`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

from actstore.core.dependencies import duckdb
from actstore.core.dependencies import pyarrow_dataset as pads
from actstore.core.errors import CorruptStoreError
from actstore.core.sql_limits import current_limits

if TYPE_CHECKING:
    from actstore.core.sql_files import CheckedFiles
    from actstore.core.storage.base import StoreLocation


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


#: DuckDB's threads a connection gets where no ``--threads`` is in force (:func:`sql_threads`).
THREADS = 2
_threads: contextvars.ContextVar[int] = contextvars.ContextVar("actstore_sql_threads", default=0)


@contextlib.contextmanager
def sql_threads(threads: int) -> Iterator[None]:
    """Connections opened inside the block run DuckDB on ``threads`` threads (0: :data:`THREADS`):
    ``--threads`` of every command reaches SQL through here, as it reaches torch and numpy."""
    token = _threads.set(max(0, threads))
    try:
        yield
    finally:
        _threads.reset(token)


def quote(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def table_dataset(store: TableSource, files: list[str]) -> pads.Dataset:
    """A table's local files as one dataset; columns missing from a file read as NULL (``union_by_name``).
    Each file's schema comes from the store (read with its footer when its hash was checked)."""

    paths = [store.location.path(f) for f in files]
    schemas = [store.file_schema(rel) for rel in files]
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive") if len(schemas) > 1 else schemas[0]
    except pa.ArrowException as e:
        raise CorruptStoreError(
            f"{store.url}: the files of one table have incompatible schemas ({one_line(e)})"
        ) from None
    data = pads.dataset(paths, schema=schema, format="parquet")
    for fragment in data.get_fragments():  # footers read once, kept: a scan then skips row groups by their
        fragment.ensure_complete_metadata()  # statistics without reading the footer again (2-3x per point query)
    return data


def new_connection(memory_limit: str, files: CheckedFiles | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection, locked down (see the module notes), with no table yet.
    ``files``: a read-only file system of checked table files (:mod:`actstore.core.sql_files`), the
    only "directory" DuckDB may then read from."""

    con = duckdb.connect(
        ":memory:",
        config={
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "allow_community_extensions": False,
            "threads": _threads.get() or THREADS,
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


def register_table(con: duckdb.DuckDBPyConnection, store: TableSource, name: str, files: list[str]) -> None:
    """(Re)define view ``name`` over the table's ``files``.  Every file is checked first (its hash and
    Parquet footer: a corrupt shard is an error, never silently wrong rows), by the store's
    :meth:`file_schema` for a dataset and by :meth:`table` for a table read into memory."""
    loc = store.location
    source = f"__arrow_{name}"
    data: pa.Table | pads.Dataset
    if files and loc.paths_open_directly():  # scanned from the files (only the columns and row groups read)
        data = table_dataset(store, files)
    else:  # an object store: read into memory once (cached by the store)
        data = store.table(name, files=files)
    with contextlib.suppress(Exception):
        con.unregister(source)
    con.register(source, data)
    # TEMP: the view belongs to this connection alone (sessions of several stores share one database).
    con.execute(f"CREATE OR REPLACE TEMP VIEW {quote(name)} AS SELECT * FROM {quote(source)}")


def connect(store: TableSource, *, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A locked-down in-memory DuckDB connection with one view per store table.

    DuckDB has no file access on it (the tables are Arrow datasets read by pyarrow), no
    temporary directory and the memory limit in force (:func:`actstore.core.sql_limits.limits`); the
    configuration is locked.  A time limit applies to statements run through
    :func:`actstore.core.sql.run_sql` only.
    """
    con = new_connection(current_limits(memory_limit).memory_limit)
    try:
        if store.location.paths_open_directly():  # (tables read into memory are checked as they are read)
            store.check_table_shards()  # a corrupt shard is an error, never silently wrong rows
        for name, files in store.statement_files(None)[0].items():
            register_table(con, store, name, files)
    except BaseException:
        con.close()
        raise
    return con


_DATABASES: dict[tuple[int, str], duckdb.DuckDBPyConnection] = {}  # (pid, memory limit) -> locked database
_DATABASES_LOCK = threading.Lock()


def shared_database(memory_limit: str) -> duckdb.DuckDBPyConnection:
    """The process's locked-down in-memory database for this memory limit, made once (a new DuckDB
    database costs 15-40 ms; a connection to an existing one, :meth:`cursor`, a few microseconds)."""

    key = (os.getpid(), memory_limit)
    with _DATABASES_LOCK:
        db = _DATABASES.get(key)
        if db is None:
            db = _DATABASES[key] = new_connection(memory_limit)
        return db


def one_line(e: BaseException) -> str:
    """An error's text on one line."""
    return " ".join(str(e).split())
