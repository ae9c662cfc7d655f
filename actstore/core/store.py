"""Reading a store: the manifest, committed segments, arrays, weights and tables.

Layout under the store root::

    manifest.json                      format, model, geometry, settings
    weights/                           zarr group: W_O, b_O, W_V, b_V, W_down, b_down, embed, unembed, ...
    tokenizer/                         the model's tokenizer (save_pretrained), SHA-256 in manifest model.tokenizer
    segments/NNNNNN/                   zarr group per segment: z, attn, v, resid, mlp
    tables/{examples,tokens,targets}/NNNNNN.parquet, tables/heads/heads.parquet, tables/<result>/<run>.parquet
    commits/NNNNNN.json                written last: the segment is visible once this exists

What a store says about itself is checked before it is used: the manifest and every commit marker
field by type and range (:mod:`actstore.core.manifest`), each marker against its file name, each
array's metadata against the shape the marker implies, every table file against its SHA-256 (in
the marker, or its ``.sha256`` companion) and its Parquet footer before DuckDB sees it, and every
read offset against the array it reads.  A missing chunk is an error, not zeros (:mod:`actstore.core.chunks`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import pyarrow as pa
import zarr

from actstore.core.array_meta import open_segment_array
from actstore.core.arrays import NUMPY_DTYPE, check_array, read_ranges, read_rows
from actstore.core.chunks import ChunkGuard
from actstore.core.errors import CorruptStoreError, QueryError, WeightsUnavailableError
from actstore.core.layout import MAX_CHUNK_BYTES, MAX_TOKENIZER_FILE_BYTES, TOKENIZER_DIR
from actstore.core.manifest import Geometry, SegmentCommit, read_manifest
from actstore.core.segments import (
    _HEX,
    check_weight,
    expected_shape,
    read_commits,
    segment_name,
    tokenizer_file_name_ok,
    unwritten_arrays,
)
from actstore.core.snapshot import Snapshot, read_snapshot
from actstore.core.sql import relation, run_sql
from actstore.core.sql_connect import connect
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation
from actstore.core.store_html import store_html
from actstore.core.store_tables import TableFiles
from actstore.core.tables import sha256
from actstore.core.weight_store import WeightsRecord, WeightsSource, missing_message, read_record, resolve

if TYPE_CHECKING:
    import duckdb
    import pandas as pd

    from actstore.core.sql import Params
    from actstore.core.sql_session import SQLSession


_SESSION_LOCK = threading.Lock()


_REOPENED: dict[tuple[Any, ...], StoreReader] = {}
_REOPENED_LOCK = threading.Lock()


def reopened(cls: type[StoreReader], location: StoreLocation, snapshot: int, n_commits: int) -> StoreReader:
    """The reader a pickled reader becomes (see :meth:`StoreReader.__reduce__`): ``cls`` opened at
    ``location`` once per process for that snapshot number and count of committed segments (a later
    state of the store is another reader), with its own caches and SQL connection."""
    key = (os.getpid(), cls, location.url, snapshot, n_commits)
    with _REOPENED_LOCK:
        reader = _REOPENED.get(key)
        if reader is None:
            reader = _REOPENED[key] = cls(location)
        return reader


class StoreReader(TableFiles):
    """A read-only view of a store as of the moment it was opened (or last :meth:`refresh`).

    This is the store core: manifest, arrays, weights, tables and SQL.  It imports nothing from
    ``ingest`` or ``query``; :func:`actstore.open` returns :class:`actstore.api.Store`, this class
    plus the methods that need the query layer (``select``).
    """

    def __init__(self, location: StoreLocation) -> None:
        self.location = location
        self.manifest = read_manifest(location)
        self._arrays: dict[tuple[int, str], zarr.Array] = {}
        self._weight_arrays: dict[str, zarr.Array] = {}  # opened and checked (weights never change)
        self._weight_present: dict[str, bool] = {}
        self._verified: set[str] = set()  # table shards whose SHA-256 matched their commit marker
        self._tables: dict[str, pa.Table] = {}  # table files read so far (immutable once visible)
        self._schemas: dict[
            str, pa.Schema
        ] = {}  # schema of each table file whose hash and footer were checked
        self.commits: dict[int, SegmentCommit] = {}
        self.snapshot: Snapshot | None = None
        self._listing: tuple[int, dict[str, list[str]]] | None = None
        self.refresh()

    # ------------------------------------------------------------------ basics
    @property
    def geometry(self) -> Geometry:
        return self.manifest.geometry

    def refresh(self) -> None:
        """Pick up segments committed (and snapshots written) since the store was opened.  A store
        whose snapshot covers every segment is read from the snapshot alone (no directory is listed);
        otherwise the markers of the segments it does not cover are read from ``commits/``.  Result
        tables written since are listed again by the next statement that reads one."""
        snap = read_snapshot(self.location, self.manifest)
        covered = snap.commits(self.manifest) if snap is not None else {}
        if len(covered) < self.manifest.n_segments:
            rest = read_commits(self.location, self.manifest, skip=set(covered))
            covered = dict(sorted({**covered, **rest}.items()))
        self.snapshot, self.commits, self._listing = snap, covered, None

    @property
    def n_rows(self) -> int:
        return sum(c.n_rows for c in self.commits.values())

    @property
    def complete(self) -> bool:
        return len(self.commits) == self.manifest.n_segments

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"<actstore.Store {self.url!r}: model={self.manifest.model.get('name')!r} "
            f"L={g.n_layers} H={g.n_heads} d_model={g.d_model}, {self.n_rows} rows in "
            f"{len(self.commits)}/{self.manifest.n_segments} segments, dtype={self.manifest.storage_dtype}>"
        )

    def _repr_html_(self) -> str:
        """A summary table for notebooks: model, geometry, corpus per relation, result tables."""
        return store_html(self)

    # ------------------------------------------------------------------ arrays
    def array(self, seg: int, name: str) -> zarr.Array:
        key = (seg, name)
        if key not in self._arrays:
            if seg not in self.commits:
                raise QueryError(f"segment {seg} is not committed in {self.url}")
            rel = f"segments/{segment_name(seg)}"
            commit = self.commits[seg]
            try:
                guard = self._guarded(rel, MAX_CHUNK_BYTES + (1 << 20), strict=name not in self._unwritten)
                arr = open_segment_array(self.location, rel, name, guard, f"{self.url}/{rel}/{name}")
            except CorruptStoreError:
                raise
            except Exception as e:
                raise CorruptStoreError(f"{self.url}/{rel}/{name}: cannot open array ({e})") from None
            if not isinstance(arr, zarr.Array):
                raise CorruptStoreError(f"{self.url}/{rel}/{name}: not an array")
            check_array(
                arr,
                f"{self.url}/{rel}/{name}",
                expected_shape(self.geometry, name, commit),
                NUMPY_DTYPE[self.manifest.storage_dtype],
                MAX_CHUNK_BYTES,
            )
            self._arrays[key] = arr
        return self._arrays[key]

    @property
    def _unwritten(self) -> frozenset[str]:
        """Segment arrays of zeros whose chunks need not exist (:func:`unwritten_arrays`)."""
        return unwritten_arrays(self.manifest)

    def _guarded(self, rel: str, max_bytes: int, strict: bool = True) -> ChunkGuard:
        """The zarr store at ``rel``, read through :class:`ChunkGuard` (missing chunks, special files and
        local files over ``max_bytes`` refused; with ``strict=False`` a missing chunk reads as zeros)."""
        loc = self.location
        return ChunkGuard(
            loc.zarr_store(rel, read_only=True),
            where=f"{self.url}/{rel}",
            strict=strict,
            local_root=loc.os_path(rel),
            max_bytes=max_bytes,
        )

    def read_segment_rows(
        self,
        seg: int,
        name: str,
        rows: np.ndarray,
        axis1: Sequence[int] | None = None,
        *,
        stored: bool = False,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Rows (sorted, segment-local) of a per-target array, as float32; ``axis1``: only these positions
        of its second axis (layers), converted alone.  ``stored=True``: in the storage dtype, unconverted
        (float16, float32, or bfloat16 as its uint16 bits), for a caller that converts them itself.
        ``out``: written instead of a new array (:func:`~actstore.core.arrays.read_rows`)."""
        arr = self.array(seg, name)
        where = f"{self.url}/segments/{segment_name(seg)}/{name}"
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= arr.shape[0]):
            raise CorruptStoreError(
                f"{where}: rows {int(rows.min())}..{int(rows.max())} asked for, the array has "
                f"{arr.shape[0]} (the targets table disagrees with the arrays; run actstore verify)"
            )
        return read_rows(arr, rows, where, None if stored else self.manifest.storage_dtype, axis1, out)

    def read_segment_ranges(
        self, seg: int, name: str, starts: np.ndarray, lengths: np.ndarray, axis1: Sequence[int] | None = None
    ) -> np.ndarray:
        """Concatenated ranges of a flat (ragged) array, as float32 (``axis1`` as in :meth:`read_segment_rows`)."""
        arr = self.array(seg, name)
        where = f"{self.url}/segments/{segment_name(seg)}/{name}"
        starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if starts.size and (starts.min() < 0 or lengths.min() < 0 or (starts + lengths).max() > arr.shape[0]):
            raise CorruptStoreError(
                f"{where}: offsets outside the array's {arr.shape[0]} entries (a table's "
                "src_start/n_src or tok_start/n_tokens is wrong; run actstore verify)"
            )
        return read_ranges(arr, starts.tolist(), lengths.tolist(), where, self.manifest.storage_dtype, axis1)

    @cached_property
    def weights_record(self) -> WeightsRecord | None:
        """The store's ``weights.json`` (:mod:`actstore.core.weight_store`): the weights' hash and mode."""
        return read_record(self.location)

    @cached_property
    def weights_source(self) -> WeightsSource | None:
        """Where this store's weights are read from: its own ``weights/``, else the shared copy with the
        record's hash; None when it has neither (an analysis that needs weights then refuses)."""
        return resolve(self.location, self.weights_record)

    @property
    def _weights_where(self) -> str:
        src = self.weights_source
        return src.where if src is not None else f"{self.url}/weights"

    @cached_property
    def _weights_group(self) -> zarr.Group:
        src = self.weights_source
        if src is None:
            raise WeightsUnavailableError(missing_message(self.url, self.weights_record))
        try:
            g = self.geometry
            largest = 4 * max(
                g.n_layers * max(g.n_heads, g.n_kv_heads) * g.d_head * g.d_model,
                g.n_layers * g.d_mlp * g.d_model,
                4 * g.vocab_size * g.d_model,
            )
            guard = ChunkGuard(
                src.location.zarr_store(src.rel, read_only=True),
                where=src.where,
                local_root=src.location.os_path(src.rel),
                max_bytes=largest + (1 << 20),
            )
            return zarr.open_group(store=guard, mode="r")
        except CorruptStoreError:
            raise
        except Exception as e:
            raise CorruptStoreError(f"{src.where}: cannot open ({e})") from None

    def _has(self, name: str) -> bool:
        """Whether the weights group holds ``name`` (asked once a name per open store: weights are
        written with the store, never after; a listing of the whole group costs more)."""
        got = self._weight_present.get(name)
        if got is None and self.weights_source is None:
            return False  # no weights: weight() says why
        if got is None:
            got = self._weight_present[name] = name in self._weights_group
        return got

    def weight_array(self, name: str) -> zarr.Array:
        """The zarr array of a stored weight, its metadata checked against the geometry (opened and
        checked once per open store)."""
        arr = self._weight_arrays.get(name)
        if arr is None:
            got = self._weights_group[name]
            if not isinstance(got, zarr.Array):
                raise CorruptStoreError(f"{self._weights_where}/{name}: not an array")
            check_weight(self.geometry, name, got, f"{self._weights_where}/{name}")
            arr = self._weight_arrays[name] = got
        return arr

    def weight(self, name: str, layer: int | None = None) -> np.ndarray:
        """A stored weight as float32 (``W_O`` [L,H,d_head,d_model], ``unembed`` [V,d_model], ...);
        ``layer``: only that index of its first axis (``W_O[layer]``: one chunk of a store that
        chunks its layer weights one layer per chunk)."""
        group = self._weights_group
        if name == "unembed" and group.attrs.get("tied_unembed"):
            name = "embed"
        if not self._has(name):
            raise QueryError(f"{self.url}: no stored weight {name!r} (have {sorted(group.array_keys())})")
        arr = self.weight_array(name)
        try:
            return np.asarray(arr[...] if layer is None else arr[int(layer)], dtype=np.float32)
        except Exception as e:
            raise CorruptStoreError(
                f"{self._weights_where}/{name}: read failed ({type(e).__name__}: {e})"
            ) from None

    def layer_chunked(self, name: str) -> bool:
        """Whether weight ``name`` is stored one layer (first-axis index) per chunk."""
        if name == "unembed" and self._weights_group.attrs.get("tied_unembed"):
            name = "embed"
        return self._has(name) and int(self.weight_array(name).chunks[0]) == 1

    def has_weight(self, name: str) -> bool:
        return self._has(name)

    @property
    def weight_attrs(self) -> dict[str, Any]:
        return dict(self._weights_group.attrs)

    # ------------------------------------------------------------------ tokenizer
    def tokenizer_record(self) -> dict[str, str] | None:
        """``{file name: SHA-256}`` of the tokenizer files the manifest records (None when it records
        none); a malformed record is a CorruptStoreError."""
        rec = self.manifest.model.get("tokenizer")
        if rec is None:
            return None
        where = f"{self.url}/manifest.json field 'model.tokenizer'"
        files = rec.get("files") if isinstance(rec, dict) else None
        if not isinstance(files, dict) or not files:
            raise CorruptStoreError(f"{where}: expected {{'files': {{name: sha256}}}}")
        for name, digest in files.items():
            if not tokenizer_file_name_ok(name):
                raise CorruptStoreError(f"{where}: {str(name)[:40]!r} is not a plain file name")
            if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
                raise CorruptStoreError(f"{where}: the hash of {name!r} is not a SHA-256 hex digest")
        return dict(files)

    def has_tokenizer(self) -> bool:
        """True when the store holds its model's tokenizer (``tokenizer/``)."""
        return self.tokenizer_record() is not None

    def tokenizer_files(self) -> dict[str, bytes]:
        """The bytes of each tokenizer file, checked against the manifest's SHA-256 (a folder for
        ``AutoTokenizer.from_pretrained`` once written out; see :mod:`actstore.query.select.store_tokenizer`)."""
        record = self.tokenizer_record()
        if record is None:
            raise QueryError(f"{self.url} holds no tokenizer")
        out: dict[str, bytes] = {}
        for name, want in record.items():
            rel = f"{TOKENIZER_DIR}/{name}"
            try:
                data = self.location.read_bytes(rel, MAX_TOKENIZER_FILE_BYTES)
            except FileNotFoundError:
                raise CorruptStoreError(f"{self.url}/{rel}: missing (the manifest records it)") from None
            if sha256(data) != want:
                raise CorruptStoreError(
                    f"{self.url}/{rel}: SHA-256 does not match the manifest's model.tokenizer"
                )
            out[name] = data
        return out

    def sql_session(self) -> SQLSession:
        """The store's SQL connection, kept between statements (:class:`actstore.core.sql_session.SQLSession`)."""
        with _SESSION_LOCK:
            session = self.__dict__.get("_sql_session")
            if session is None:
                from actstore.core.sql_session import SQLSession

                session = self.__dict__["_sql_session"] = SQLSession()
            return session

    def close(self) -> None:
        """Close the store's SQL connection (a later statement opens a new one)."""
        session = self.__dict__.pop("_sql_session", None)
        if session is not None:
            session.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """A reader pickles as its location and state (a few bytes), not as its caches: unpickled (a
        Dask worker's task), it is the store reopened once per process and state (:func:`reopened`).
        Pickling the reader itself sent its table cache and every commit marker with each task (at
        10^5 rows a 391-task ``to_dask`` scan took 342 s against 1.3 s for the raw read)."""
        number = self.snapshot.number if self.snapshot is not None else -1
        return (reopened, (type(self), self.location, number, len(self.commits)))

    @overload
    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: Literal["arrow"] = "arrow",
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> pa.Table: ...

    @overload
    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: Literal["pandas"],
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> pd.DataFrame: ...

    @overload
    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: Literal["relation"],
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> duckdb.DuckDBPyRelation: ...

    def sql(
        self,
        query: str,
        params: Params | None = None,
        *,
        format: str = "arrow",
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> pa.Table | pd.DataFrame | duckdb.DuckDBPyRelation:
        """Run one read-only SELECT over the store's tables: ``format="arrow"`` (a ``pyarrow.Table``,
        the default) or ``"pandas"`` run it now, within the limits; ``"relation"`` returns a lazy
        ``duckdb.DuckDBPyRelation`` over the same locked-down connection, to refine before anything
        runs (``.filter()``, ``.aggregate()``, ``.limit()``) and read with ``.arrow()``, ``.df()`` or
        ``.fetchall()``; a relation runs when read, under the connection's memory limit but without
        the time limit.

        ``params`` are bound by DuckDB, never pasted into the text: a list for ``?`` (or ``$1``)
        placeholders, a dict for ``$name`` ones::

            store.sql("SELECT * FROM probe_runs WHERE run_id = ?", [run_id])
            store.sql("SELECT count(*) FROM examples WHERE relation_id = $rel", {"rel": "P17"})
            store.sql("SELECT * FROM examples WHERE relation_id = ?", ["P17"], format="relation").limit(5).df()

        ``memory_limit`` (e.g. ``"1GB"``) and ``timeout`` (seconds, 0 for none) override the limits in
        force (:func:`actstore.core.sql_limits.limits`; defaults in :mod:`actstore.core.sql_limits`)."""

        if format == "relation":
            return relation(self, query, params, memory_limit, timeout)
        if format not in ("arrow", "pandas"):
            raise QueryError(f"unknown result format {format!r} (arrow, pandas, relation)")
        table = run_sql(self, query, params=params, memory_limit=memory_limit, timeout=timeout)
        return table.to_pandas() if format == "pandas" else table

    def connect(self, *, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
        """A locked-down DuckDB connection over the tables (no file access, see :mod:`actstore.core.sql`)."""

        return connect(self, memory_limit=memory_limit)


def open_reader(url: str | os.PathLike[str]) -> StoreReader:
    """Open an existing store (local path or URL) for reading."""
    return StoreReader(locate(url))
