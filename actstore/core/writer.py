"""Writing a store: create or resume, write a segment, commit it.

Commit protocol: a segment's arrays are written first, then its table
shards, then its commit marker, atomically.  A segment without a marker is garbage: a
resume deletes it and writes it again.  Segments are independent, so several writers (one
per process or GPU) can each take a disjoint set of segments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.arrays import create_array
from actstore.core.errors import StoreMismatchError
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.core.manifest import OBJECT_HASH_FROM, Manifest, SegmentCommit, read_manifest
from actstore.core.ownership import CREATING, creating_marker, prepare_root, signed_creating
from actstore.core.segments import read_commits, segment_name, unwritten_arrays
from actstore.core.storage.base import StoreLocation
from actstore.core.store import StoreReader
from actstore.core.tables import ALL_SEGMENT_TABLES, HEADS, sha256, to_parquet_bytes
from actstore.core.weight_store import Extracted, store_model_weights, store_weights

# Manifest fields a resume must match exactly, or the result would not equal an uninterrupted run.
RESUME_KEYS = (
    "geometry",
    "model",
    "storage_dtype",
    "segment_size",
    "n_examples",
    "chunk_rows",
    "chunk_flat",
    "chunk_layers",
    "ingest",
)


def creation_interrupted(loc: StoreLocation) -> bool:
    """True when ``loc`` holds only the remains of a creation killed before its manifest (a
    ``.creating`` marker with actstore's signature: an empty or foreign one proves nothing)."""
    return loc.exists(CREATING) and not loc.exists("manifest.json") and signed_creating(loc)


class StoreWriter:
    """Writes segments of one store.  Use :meth:`create` or :meth:`resume`."""

    #: The chunks of a kind the corpus ingest kept no layer of are not written (all zeros by the
    #: manifest: :func:`~actstore.core.segments.unwritten_arrays`); False writes them, as stores written
    #: before 2026-12-07 did (tests read such stores).
    skip_unkept = True
    #: The separator of the segment arrays' chunk keys: "." puts each chunk file (``c.3.0.0``) beside
    #: its array's ``zarr.json``, where "/" (stores written before 2026-12-07; tests read such
    #: stores) gave it two folders of its own (``c/3/0/0``).
    chunk_separator = "."

    def __init__(self, location: StoreLocation, manifest: Manifest) -> None:
        self.location = location
        self.manifest = manifest

    @classmethod
    def create(
        cls,
        loc: StoreLocation,
        manifest: Manifest,
        weights: Mapping[str, np.ndarray] | Callable[[], Extracted],
        weight_attrs: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
        files: Mapping[str, bytes] | None = None,
        weights_mode: str = "shared",
        weights_key: str = "",
    ) -> StoreWriter:
        """A new store at ``loc``.  The caller holds the writer lock (:mod:`actstore.core.lock`); an existing
        store is replaced only with ``overwrite`` and only when it provably is one, and the signed
        remains of a killed creation are cleared (:func:`actstore.core.ownership.prepare_root`).
        ``weights_mode``: where the weights go (shared, copy, none: :mod:`actstore.core.weight_store`);
        ``weights``: the arrays (with ``weight_attrs``), or a function giving both, called only when the
        shared cache's index does not know ``weights_key`` (:func:`~actstore.core.weight_store.
        store_model_weights`)."""
        prepare_root(loc, overwrite=overwrite)
        loc.makedirs("")
        loc.write_bytes_atomic(CREATING, creating_marker())
        n_layers = manifest.geometry.n_layers
        if callable(weights):
            store_model_weights(loc, weights, weights_key, n_layers, weights_mode)
        else:
            store_weights(loc, weights, weight_attrs or {}, n_layers, weights_mode)
        g = manifest.geometry
        heads = pa.table(
            {
                "layer": np.repeat(np.arange(g.n_layers), g.n_heads).astype(np.int32),
                "head": np.tile(np.arange(g.n_heads), g.n_layers).astype(np.int32),
                "kv_head": np.tile(np.arange(g.n_heads) // g.kv_group, g.n_layers).astype(np.int32),
            },
            schema=HEADS,
        )
        loc.write_bytes_atomic("tables/heads/heads.parquet", to_parquet_bytes(heads))
        for rel, data in (files or {}).items():  # e.g. tokenizer/*: before the manifest that records them
            loc.write_bytes_atomic(rel, data)
        # The manifest goes last: until it exists the directory is not a store.
        loc.write_bytes_atomic("manifest.json", manifest.to_json())
        loc.fs.rm(loc.path(CREATING))
        return cls(loc, manifest)

    @classmethod
    def resume(cls, loc: StoreLocation, manifest: Manifest) -> StoreWriter:
        """Reopen a store for writing; ``manifest`` must describe the same ingest (only the store's
        manifest is read)."""
        stored = read_manifest(loc)
        old = json.loads(stored.to_json())
        new = json.loads(manifest.to_json())
        diffs = [k for k in RESUME_KEYS if old.get(k) != new.get(k)]
        if diffs:
            detail = ""
            if "model" in diffs:
                was, now = old["model"].get("weight_hash", "?"), new["model"].get("weight_hash", "?")
                detail = (
                    f" (store: {old['model'].get('name')} weights {str(was)[:12]}, given: "
                    f"{new['model'].get('name')} weights {str(now)[:12]})"
                )
            elif "ingest" in diffs:  # name the settings: {key: (store's, given)}
                a, b = old.get("ingest") or {}, new.get("ingest") or {}
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                detail = (
                    " settings ("
                    + ", ".join(f"{k}: store {a.get(k, 'unset')}, given {b.get(k, 'unset')}" for k in keys)
                    + ")"
                )
            else:
                scalar = [k for k in diffs if not isinstance(old.get(k), dict)]
                detail = (
                    " ("
                    + ", ".join(
                        f"{k}: store {old.get(k, 'unset')}, given {new.get(k, 'unset')}" for k in scalar
                    )
                    + ")"
                    if scalar
                    else ""
                )
            raise StoreMismatchError(
                f"cannot resume {loc.url}: the store was written with different {', '.join(diffs)}{detail}"
            )
        if loc.exists(CREATING):  # killed between writing the manifest and removing the flag
            loc.fs.rm(loc.path(CREATING))
        return cls(loc, stored)

    def committed(self) -> set[int]:
        """Segments with a valid commit marker, read exactly as readers read them (a marker whose
        ``segment`` field disagrees with its file name is an error here too, not a skipped segment)."""
        return set(read_commits(self.location, self.manifest))

    def _given_layers(self, name: str, data: np.ndarray) -> tuple[list[int] | None, int]:
        """The kept layers (the manifest's ``ingest.kept``) when segment array ``name`` came with those
        layers only, in that order, and its full axis-1 length; (None, 0) when it came whole."""
        kept = (self.manifest.ingest or {}).get("kept")
        if not isinstance(kept, dict) or name not in kept or data.ndim < 2:
            return None, 0
        n1 = self.manifest.geometry.n_layers + (name == "resid")
        layers = [int(x) for x in kept[name]]
        if len(layers) == n1 or data.shape[1] != len(layers):
            return None, 0
        return layers, n1

    def write_segment(
        self,
        seg: int,
        row_start: int,
        arrays: Mapping[str, np.ndarray],
        tables: Mapping[str, pa.Table | bytes],
    ) -> SegmentCommit:
        """Write one segment's arrays and tables, then commit it (the marker is the last write); a table
        may come as its Parquet bytes already (:func:`~actstore.core.tables.to_parquet_bytes`, encoded by
        a thread with time to spare).  A corpus store's ``z``, ``mlp`` and ``resid`` may come with their
        kept layers only (the manifest's ``ingest.kept``, in that order): the layers not kept are
        written as the one compressed zero chunk, without being made or read (given whole, every chunk
        is compressed: the same bytes)."""
        m = self.manifest
        missing = set(SEGMENT_ARRAYS) - set(arrays)
        if missing or set(m.segment_tables) - set(tables):
            raise ValueError(f"segment {seg}: missing arrays/tables {sorted(missing)}")
        rel = f"segments/{segment_name(seg)}"
        self.location.remove_tree(rel)  # leftovers of a killed attempt
        objects: dict[str, str] = {}  # the hash of every object of the segment's group, for the marker
        # (XXH3-128 from format 4: SHA-256 was 0.26 s of an import's 1.4 s; a format 3 store resumed
        # keeps SHA-256, which its readers know)
        algorithm = "xxh3" if m.format_version >= OBJECT_HASH_FROM else "sha256"
        unwritten = unwritten_arrays(m) if self.skip_unkept else frozenset()
        with self.location.zarr_group_writer(rel, digests=objects, algorithm=algorithm) as group:
            for name in SEGMENT_ARRAYS:
                data = np.ascontiguousarray(arrays[name])
                chunk = m.chunk_flat if name in ("attn", "v") else m.chunk_rows
                layers, n1 = self._given_layers(name, data)
                create_array(
                    group,
                    name,
                    data,
                    chunk,
                    logical_dtype=m.storage_dtype,
                    chunk1=m.chunk_layers,
                    chunks_written=name not in unwritten,
                    separator=self.chunk_separator,
                    layers=layers,
                    n_layers=n1,
                )
        digests: dict[str, str] = {}
        for name in m.segment_tables:
            given = tables[name]
            data_bytes = given if isinstance(given, bytes) else to_parquet_bytes(given)
            digests[name] = sha256(data_bytes)
            self.location.write_bytes_atomic(f"tables/{name}/{segment_name(seg)}.parquet", data_bytes)
        commit = SegmentCommit(
            segment=seg,
            row_start=row_start,
            n_rows=int(arrays["z"].shape[0]),
            n_sources=int(arrays["attn"].shape[0]),
            n_tokens=int(arrays["v"].shape[0]),
            table_sha256=digests,
            objects=objects,
            object_hash=algorithm,
        )
        self.location.write_bytes_atomic(f"commits/{segment_name(seg)}.json", commit.to_json())
        return commit


def write_result_table(
    store: StoreReader, name: str, run_id: str, table: pa.Table, row_group_size: int | None = None
) -> str:
    """Add an analysis result (one file per run, written atomically) and return its path
    (``row_group_size``: rows a Parquet row group, for a table whose readers want one row's lists)."""
    if name in ALL_SEGMENT_TABLES or name == "heads" or not name.replace("_", "").isalnum():
        raise ValueError(f"invalid result table name {name!r}")
    rel = f"tables/{name}/{run_id}.parquet"
    store.location.write_bytes_atomic(rel, to_parquet_bytes(table, row_group_size))
    return rel
