"""The table files of a store: which files each table has (committed shards, compacted files, result
tables), reading them once each, and checking each file's SHA-256 and Parquet footer before anything
reads it (:class:`actstore.core.store.StoreReader` is a :class:`TableFiles`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from actstore.core.errors import CorruptStoreError, QueryError
from actstore.core.fs import checked_local_file, file_hash
from actstore.core.manifest import Manifest, SegmentCommit
from actstore.core.segments import segment_name
from actstore.core.snapshot import Snapshot, is_compacted_file, is_index_file
from actstore.core.storage.base import StoreLocation
from actstore.core.tables import ALL_SEGMENT_TABLES, HASH_SUFFIX, MAX_TABLE_BYTES, SCHEMAS, sha256, xxh3


class TableFiles:
    """The table-file half of a store reader: set by the reader, ``location``, ``manifest``,
    ``snapshot``, ``commits`` and the three caches below."""

    location: StoreLocation
    manifest: Manifest
    snapshot: Snapshot | None
    commits: dict[int, SegmentCommit]
    _verified: set[str]  # table files whose SHA-256 matched
    _tables: dict[str, pa.Table]  # table files read so far (immutable once visible)
    _schemas: dict[str, pa.Schema]  # schema of each table file whose hash and footer were checked
    _listing: tuple[int, dict[str, list[str]]] | None  # (location's table writes, result tables' files)

    @property
    def url(self) -> str:
        return self.location.url

    def table_files(self) -> dict[str, list[str]]:
        """Visible Parquet files per table name (segment tables: committed shards only), the result
        tables listed now (``tables/`` and each result table's folder: on an object store a LIST each).
        The listing is kept for the statements that follow (:meth:`statement_files`)."""
        out = self._segment_table_files()
        listed: dict[str, list[str]] = {}
        for name in self.location.listdir("tables"):
            if name in ALL_SEGMENT_TABLES:
                continue
            files = [f for f in self.location.listdir(f"tables/{name}") if f.endswith(".parquet")]
            if files:  # a directory whose first file is still being written is no table yet
                listed[name] = [f"tables/{name}/{f}" for f in files]
        self._listing = (self.location.tables_written(), listed)
        return {**out, **listed}

    def _segment_table_files(self) -> dict[str, list[str]]:
        """The files of the segment tables: the snapshot's compacted files and the shards of the
        committed segments it does not cover (nothing is listed)."""
        out: dict[str, list[str]] = {}
        snap = self.snapshot
        for name in self.manifest.segment_tables:
            compacted = [f.path for f in snap.tables[name]] if snap is not None else []
            out[name] = compacted + [
                f"tables/{name}/{segment_name(s)}.parquet"
                for s in self.commits
                if snap is None or s not in snap.segments
            ]
        return out

    def statement_files(self, tables: set[str] | None) -> tuple[dict[str, list[str]], bool]:
        """The files of the tables a statement reads (``tables``; None: it cannot be told), and whether
        that is every table of the store.  A statement that reads only segment tables and ``heads``
        lists nothing (those files are known from the snapshot and the commit markers).  Any other
        table: locally, the result tables are listed for the statement (a few directory reads: a run
        another process records is seen at once); on an object store, where each listing is a LIST
        request, the listing made by the first such statement is kept until
        :meth:`~actstore.core.store.StoreReader.refresh` or a table written through this store's
        location, so a result recorded by another process is seen after ``refresh()`` (as segments
        committed meanwhile are)."""
        fixed = self._segment_table_files()
        if tables is not None and tables <= {*fixed, "heads"}:
            return {**fixed, "heads": ["tables/heads/heads.parquet"]}, False
        cached = self._listing
        if self.location.lists_cheaply() or cached is None or cached[0] != self.location.tables_written():
            return self.table_files(), True
        return {**fixed, **cached[1]}, True

    def table(
        self, name: str, columns: list[str] | None = None, *, files: list[str] | None = None
    ) -> pa.Table:
        """A whole table as Arrow (for small tables and tests; use :meth:`sql` for selections).
        ``files``: the table's files when already listed by :meth:`table_files`."""
        files = self.statement_files({name})[0].get(name) if files is None else files
        if files is None:
            raise QueryError(f"{self.url}: no table {name!r}")
        parts = [self._read_table_file(f, columns) for f in files]
        if not parts:
            schema = SCHEMAS.get(name)
            if schema is None:
                raise QueryError(f"{self.url}: table {name!r} is empty")
            empty = schema.empty_table()
            return empty.select(columns) if columns else empty
        return pa.concat_tables(parts, promote_options="permissive")

    def segments_table(self, name: str, first: int, last: int, columns: list[str] | None = None) -> pa.Table:
        """The rows of segment table ``name`` that committed segments ``first..last`` hold, in store
        order, with no SQL: the snapshot's compacted files that overlap those segments and the shards of
        the ones it does not cover, each read once by this reader (a file may hold rows of other
        segments too: filter by ``row``).  A DuckDB statement costs a few milliseconds on its own."""
        if name not in self.manifest.segment_tables:
            raise QueryError(f"{self.url}: {name!r} is not a segment table")
        snap = self.snapshot
        compacted = [
            f for f in (snap.tables[name] if snap is not None else ()) if f.last >= first and f.first <= last
        ]
        shards = [
            (s, f"tables/{name}/{segment_name(s)}.parquet")
            for s in sorted(self.commits)
            if first <= s <= last and (snap is None or s not in snap.segments)
        ]
        ordered = sorted([(f.first, f.path) for f in compacted] + shards)
        return self.table(name, columns, files=[path for _, path in ordered])

    def _read_table_file(self, rel: str, columns: list[str] | None) -> pa.Table:
        cached = self._tables.get(rel)  # files never change once visible: read each one once
        if cached is None:
            data = self._table_bytes(rel)
            try:
                cached = pq.ParquetFile(pa.BufferReader(data)).read()  # (pq.read_table: a dataset, slower)
            except Exception as e:
                raise CorruptStoreError(
                    f"{self.url}/{rel}: unreadable Parquet ({type(e).__name__}: {e})"
                ) from None
            self._tables[rel] = cached
        return cached.select(columns) if columns else cached

    def _table_bytes(self, rel: str) -> bytes:
        """A table file's bytes; a segment shard must match the SHA-256 in its commit marker, any other
        table file the one in its ``.sha256`` companion (files written before companions have none)."""
        try:
            data = self.location.read_bytes(rel, MAX_TABLE_BYTES)
        except FileNotFoundError:
            raise CorruptStoreError(f"{self.url}/{rel}: missing") from None
        if rel not in self._verified:
            self._check_hash(rel, data)
        return data

    def _hash_algorithm(self, rel: str) -> str:
        """The hash table file ``rel`` is checked with on open: ``"xxh3"`` for a snapshot file whose
        entry records one, else ``"sha256"``."""
        if self.snapshot is not None and (is_compacted_file(rel) or is_index_file(rel)):
            listed = self.snapshot.files().get(rel)
            if listed is not None and listed.xxh3:
                return "xxh3"
        return "sha256"

    def _check_hash(self, rel: str, data: bytes | None = None, *, digest: str | None = None) -> None:
        """Refuse table file ``rel`` unless the hash (:meth:`_hash_algorithm`) of its bytes ``data``
        (or ``digest``, computed by the caller with that algorithm) is the one recorded for it
        (:meth:`_table_bytes`); once matched, ``rel`` is not hashed again by this reader."""
        algorithm = self._hash_algorithm(rel)
        if digest is None:
            digest = xxh3(data or b"") if algorithm == "xxh3" else sha256(data or b"")
        got = digest
        parts = rel.split("/")
        if is_compacted_file(rel) or is_index_file(rel):
            listed = self.snapshot.files().get(rel) if self.snapshot is not None else None
            if listed is None or got != (listed.xxh3 if algorithm == "xxh3" else listed.sha256):
                raise CorruptStoreError(
                    f"{self.url}/{rel}: "
                    + (
                        "not in the store's snapshot"
                        if listed is None
                        else f"{'XXH3' if algorithm == 'xxh3' else 'SHA-256'} does not match the snapshot"
                    )
                    + " (run actstore verify)"
                )
        elif len(parts) == 3 and parts[1] in ALL_SEGMENT_TABLES:
            seg = int(parts[2].split(".")[0])
            commit = self.commits.get(seg)
            if commit is not None and got != commit.table_sha256.get(parts[1]):
                raise CorruptStoreError(
                    f"{self.url}/{rel}: SHA-256 does not match commit marker commits/{segment_name(seg)}.json "
                    f"(the table shard or the marker is corrupt; run actstore verify)"
                )
        else:
            want = self.table_hash(rel)
            if want is not None and got != want:
                raise CorruptStoreError(
                    f"{self.url}/{rel}: SHA-256 does not match {parts[-1]}{HASH_SUFFIX} "
                    "(the table file or its hash is corrupt; run actstore verify)"
                )
        self._verified.add(rel)

    def table_hash(self, rel: str) -> str | None:
        """The SHA-256 recorded in the ``.sha256`` companion of table file ``rel`` (None without one)."""
        try:
            text = self.location.read_bytes(rel + HASH_SUFFIX, 256).decode("ascii", "replace").strip()
        except FileNotFoundError:
            return None
        if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
            raise CorruptStoreError(f"{self.url}/{rel}{HASH_SUFFIX}: not a SHA-256 hex digest")
        return text

    def check_table_shards(
        self, names: Iterable[str] | None = None, listed: dict[str, list[str]] | None = None
    ) -> None:
        """Check every visible table file (of the tables ``names``; all when None) not yet checked: its
        hash and its Parquet footer (DuckDB reads local files directly, and a garbage file must be one
        clear error, not a DuckDB one).  The footer's schema is kept for :meth:`file_schema`.
        ``listed``: :meth:`table_files` when the caller has just listed them."""
        listed = self.statement_files(None)[0] if listed is None else listed
        todo = [
            rel
            for name in (listed if names is None else [n for n in names if n in listed])
            for rel in listed[name]
            if rel not in self._schemas
        ]
        # hashed on threads (both hashes release the GIL) where the files are opened here
        if len(todo) > 1 and self.location.paths_open_directly():
            with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
                list(pool.map(self._check_table_file, todo))
        else:
            for rel in todo:
                self._check_table_file(rel)

    def _check_table_file(self, rel: str) -> pa.Schema:
        path = self.location.os_path(rel)
        if path is not None:  # hashed in blocks, its footer read from the same descriptor
            with checked_local_file(path, MAX_TABLE_BYTES, f"{self.url}/{rel}") as f:
                if rel not in self._verified:
                    self._check_hash(rel, digest=file_hash(f, self._hash_algorithm(rel)))
                f.seek(0)
                schema = self._footer_schema(rel, pa.PythonFile(f, mode="r"))
        else:
            schema = self._footer_schema(rel, pa.BufferReader(self._table_bytes(rel)))
        self._schemas[rel] = schema
        return schema

    def _footer_schema(self, rel: str, source: pa.NativeFile) -> pa.Schema:
        try:
            return pq.read_metadata(source).schema.to_arrow_schema()
        except Exception as e:
            self._verified.discard(rel)
            raise CorruptStoreError(
                f"{self.url}/{rel}: unreadable Parquet ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
            ) from None

    def file_schema(self, rel: str) -> pa.Schema:
        """The Arrow schema of table file ``rel`` (checked as by :meth:`check_table_shards`, once)."""
        cached = self._schemas.get(rel)
        return cached if cached is not None else self._check_table_file(rel)
