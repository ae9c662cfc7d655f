"""Reading a store: the manifest, committed segments, arrays, weights and tables.

Layout under the store root::

    manifest.json                      format, model, geometry, settings
    weights/                           zarr group: W_O, b_O, W_V, b_V, W_down, b_down, embed, unembed, ...
    segments/NNNNNN/                   zarr group per segment: z, attn, v, resid, mlp
    tables/{examples,tokens,targets}/NNNNNN.parquet   one shard per segment
    tables/heads/heads.parquet, tables/<result>/<run>.parquet
    commits/NNNNNN.json                written last: the segment is visible once this exists
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from actstore.arrays import read_ranges, read_rows, widen
from actstore.errors import CorruptStoreError, QueryError, StoreNotFoundError
from actstore.fs import StoreLocation, locate
from actstore.manifest import Geometry, Manifest, SegmentCommit
from actstore.tables import SCHEMAS, SEGMENT_TABLES, sha256

if TYPE_CHECKING:
    import duckdb

SEGMENT_ARRAYS = ("z", "attn", "v", "resid", "mlp")


def segment_name(seg: int) -> str:
    return f"{seg:06d}"


@dataclass(frozen=True)
class TableFile:
    name: str
    path: str  # relative to the store root


class Store:
    """A read-only view of a store as of the moment it was opened (or last :meth:`refresh`)."""

    def __init__(self, location: StoreLocation) -> None:
        self.location = location
        if not location.exists("manifest.json"):
            location.probe()  # a wrong endpoint, credentials or bucket says so, not "no store"
            raise StoreNotFoundError(f"no actstore store at {location.url} (manifest.json missing)")
        self.manifest = Manifest.from_json(location.read_bytes("manifest.json"), location.url)
        self._arrays: dict[tuple[int, str], zarr.Array] = {}
        self._verified: set[str] = set()  # table shards whose SHA-256 matched their commit marker
        self._tables: dict[str, pa.Table] = {}  # table files read so far (immutable once visible)
        self.commits: dict[int, SegmentCommit] = {}
        self.refresh()

    # ------------------------------------------------------------------ basics
    @property
    def url(self) -> str:
        return self.location.url

    @property
    def geometry(self) -> Geometry:
        return self.manifest.geometry

    def refresh(self) -> None:
        """Pick up segments committed since the store was opened."""
        commits: dict[int, SegmentCommit] = {}
        for name in self.location.listdir("commits"):
            if not name.endswith(".json"):
                continue
            rel = f"commits/{name}"
            c = SegmentCommit.from_json(self.location.read_bytes(rel), f"{self.url}/{rel}")
            commits[c.segment] = c
        self.commits = dict(sorted(commits.items()))
        self.__dict__.pop("_row_index", None)

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
        from html import escape

        g = self.geometry
        model = self.manifest.model
        rows = [
            ("store", self.url),
            ("model", f"{model.get('name')} ({self.manifest.architecture.get('family', '?')})"),
            ("geometry", f"{g.n_layers} layers x {g.n_heads} heads ({g.n_kv_heads} kv), d_model {g.d_model}, "
                         f"d_head {g.d_head}, d_mlp {g.d_mlp}, vocab {g.vocab_size}"),
            ("rows", f"{self.n_rows} target rows committed in {len(self.commits)}/{self.manifest.n_segments} "
                     f"segments ({'complete' if self.complete else 'incomplete'}), {self.manifest.storage_dtype}"),
        ]
        if self.commits:
            rel = self.sql("SELECT relation_id, any_value(relation_name) AS name, count(*) AS n FROM examples "
                           "GROUP BY 1 ORDER BY n DESC, 1").to_pylist()
            shown = ", ".join(f"{r['relation_id']} {r['name']} ({r['n']})" if r["name"] and r["name"] != r["relation_id"]
                              else f"{r['relation_id']} ({r['n']})" for r in rel[:12])
            rows.append(("relations", f"{len(rel)}: {shown}" + (", ..." if len(rel) > 12 else "")))
        results = {k: len(v) for k, v in self.table_files().items() if k not in SEGMENT_TABLES and k != "heads"}
        if results:
            rows.append(("result tables", ", ".join(f"{k} ({n} file{'s' * (n != 1)})" for k, n in sorted(results.items()))))
        body = "".join(f"<tr><th style='text-align:left'>{escape(k)}</th><td style='text-align:left'>{escape(str(v))}</td></tr>"
                       for k, v in rows)
        return f"<table><caption style='text-align:left'><b>actstore.Store</b></caption>{body}</table>"

    # ------------------------------------------------------------------ arrays
    def array(self, seg: int, name: str) -> zarr.Array:
        key = (seg, name)
        if key not in self._arrays:
            if seg not in self.commits:
                raise QueryError(f"segment {seg} is not committed in {self.url}")
            rel = f"segments/{segment_name(seg)}"
            try:
                group = zarr.open_group(store=self.location.zarr_store(rel, read_only=True), mode="r")
                arr = group[name]
            except Exception as e:
                raise CorruptStoreError(f"{self.url}/{rel}/{name}: cannot open array ({e})") from None
            assert isinstance(arr, zarr.Array)
            self._arrays[key] = arr
        return self._arrays[key]

    def read_segment_rows(self, seg: int, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows (sorted, segment-local) of a per-target array, as float32."""
        arr = self.array(seg, name)
        data = read_rows(arr, rows, f"{self.url}/segments/{segment_name(seg)}/{name}")
        return widen(data, self.manifest.storage_dtype)

    def read_segment_ranges(self, seg: int, name: str, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Concatenated ranges of a flat (ragged) array, as float32."""
        arr = self.array(seg, name)
        data = read_ranges(arr, starts.tolist(), lengths.tolist(), f"{self.url}/segments/{segment_name(seg)}/{name}")
        return widen(data, self.manifest.storage_dtype)

    @cached_property
    def _weights_group(self) -> zarr.Group:
        try:
            return zarr.open_group(store=self.location.zarr_store("weights", read_only=True), mode="r")
        except Exception as e:
            raise CorruptStoreError(f"{self.url}/weights: cannot open ({e})") from None

    def weight(self, name: str) -> np.ndarray:
        """A stored weight as float32 (``W_O`` [L,H,d_head,d_model], ``unembed`` [V,d_model], ...)."""
        group = self._weights_group
        if name == "unembed" and group.attrs.get("tied_unembed"):
            name = "embed"
        if name not in group:
            raise QueryError(f"{self.url}: no stored weight {name!r} (have {sorted(group.array_keys())})")
        arr = group[name]
        assert isinstance(arr, zarr.Array)
        try:
            return np.asarray(arr[...], dtype=np.float32)
        except Exception as e:
            raise CorruptStoreError(f"{self.url}/weights/{name}: read failed ({type(e).__name__}: {e})") from None

    def has_weight(self, name: str) -> bool:
        return name in self._weights_group

    @property
    def weight_attrs(self) -> dict[str, Any]:
        return dict(self._weights_group.attrs)

    # ------------------------------------------------------------------ tables
    def table_files(self) -> dict[str, list[str]]:
        """Visible Parquet files per table name (segment tables: committed shards only)."""
        out: dict[str, list[str]] = {}
        for name in SEGMENT_TABLES:
            out[name] = [f"tables/{name}/{segment_name(s)}.parquet" for s in self.commits]
        for name in self.location.listdir("tables"):
            if name in SEGMENT_TABLES:
                continue
            files = [f for f in self.location.listdir(f"tables/{name}") if f.endswith(".parquet")]
            if files:  # a directory whose first file is still being written is no table yet
                out[name] = [f"tables/{name}/{f}" for f in files]
        return out

    def table(self, name: str, columns: list[str] | None = None, *, files: list[str] | None = None) -> pa.Table:
        """A whole table as Arrow (for small tables and tests; use :meth:`sql` for selections).
        ``files``: the table's files when already listed by :meth:`table_files`."""
        files = self.table_files().get(name) if files is None else files
        if files is None:
            raise QueryError(f"{self.url}: no table {name!r}")
        parts = [self._read_table_file(f, columns) for f in files]
        if not parts:
            schema = SCHEMAS.get(name)
            if schema is None:
                raise QueryError(f"{self.url}: table {name!r} is empty")
            empty = schema.empty_table()
            return empty.select(columns) if columns else empty
        return pa.concat_tables(parts, promote_options="default")

    def _read_table_file(self, rel: str, columns: list[str] | None) -> pa.Table:
        cached = self._tables.get(rel)  # files never change once visible: read each one once
        if cached is None:
            data = self._table_bytes(rel)
            try:
                cached = pq.read_table(pa.BufferReader(data))
            except Exception as e:
                raise CorruptStoreError(f"{self.url}/{rel}: unreadable Parquet ({type(e).__name__}: {e})") from None
            self._tables[rel] = cached
        return cached.select(columns) if columns else cached

    def _table_bytes(self, rel: str) -> bytes:
        """A table file's bytes; a segment shard must match the SHA-256 in its commit marker."""
        try:
            data = self.location.read_bytes(rel)
        except FileNotFoundError:
            raise CorruptStoreError(f"{self.url}/{rel}: missing") from None
        parts = rel.split("/")
        if len(parts) == 3 and parts[1] in SEGMENT_TABLES and rel not in self._verified:
            seg = int(parts[2].split(".")[0])
            commit = self.commits.get(seg)
            if commit is not None and sha256(data) != commit.table_sha256.get(parts[1]):
                raise CorruptStoreError(
                    f"{self.url}/{rel}: SHA-256 does not match commit marker commits/{segment_name(seg)}.json "
                    f"(the table shard or the marker is corrupt; run actstore verify)"
                )
            self._verified.add(rel)
        return data

    def check_table_shards(self) -> None:
        """Hash every committed segment shard not yet checked (DuckDB reads local shards directly)."""
        for name in SEGMENT_TABLES:
            for seg in self.commits:
                rel = f"tables/{name}/{segment_name(seg)}.parquet"
                if rel not in self._verified:
                    self._table_bytes(rel)

    def sql(self, query: str, *, format: str = "arrow") -> Any:
        """Run one read-only SELECT over the store's tables; ``format`` is ``arrow`` or ``pandas``."""
        from actstore.sql import run_sql

        table = run_sql(self, query)
        if format == "pandas":
            return table.to_pandas()
        if format != "arrow":
            raise QueryError(f"unknown result format {format!r} (arrow, pandas)")
        return table

    def connect(self) -> duckdb.DuckDBPyConnection:
        from actstore.sql import connect

        return connect(self)

    # ------------------------------------------------------------------ convenience
    def select(self, where: str | None = None, *, query: str | None = None) -> Any:
        """A :class:`query.Selection` of target rows (imported lazily: the core does not depend on it)."""
        from query.selection import Selection

        return Selection.from_sql(self, where=where, query=query)

    def iter_segments(self) -> Iterator[SegmentCommit]:
        yield from self.commits.values()


def open_store(url: str | os.PathLike[str]) -> Store:
    """Open an existing store (local path or URL) for reading."""
    return Store(locate(url))
