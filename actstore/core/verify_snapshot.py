"""``actstore verify``'s check of a snapshot (:mod:`actstore.core.snapshot`) against the commit markers
and the shards the compacted files replace."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actstore.core.manifest import SegmentCommit
from actstore.core.relation_index import index_table
from actstore.core.segments import segment_name
from actstore.core.snapshot import Snapshot, TableFile
from actstore.core.storage.base import StoreLocation
from actstore.core.tables import MAX_TABLE_BYTES, xxh3


def _same_rows(a: pa.Table, b: pa.Table) -> bool:
    """Equal schemas and values in the same order, NaN equal to NaN (a float column of NaNs is not
    ``equals`` to itself)."""
    if a.schema != b.schema or a.num_rows != b.num_rows:
        return False
    for x, y in zip(a.columns, b.columns):
        if pa.types.is_floating(x.type):
            if not np.array_equal(
                x.to_numpy(zero_copy_only=False), y.to_numpy(zero_copy_only=False), equal_nan=True
            ):
                return False
        elif not x.equals(y):
            return False
    return True


def check_snapshot(
    location: StoreLocation,
    problems: list[str],
    snap: Snapshot,
    markers: dict[int, SegmentCommit],
    read_hashed: Callable[[str, str, str, list[str]], bytes | None],
    threads: int = 1,
) -> None:
    """The snapshot against the markers and the shards: sizes, each compacted file's hash and rows.
    ``read_hashed(rel, sha256, why it should exist, problems)``: the file's bytes when they match, else
    None (the problem added to ``problems``)."""
    for seg, (n_sources, n_tokens) in snap.segments.items():
        m = markers.get(seg)
        if m is not None and (m.n_sources, m.n_tokens) != (n_sources, n_tokens):
            problems.append(f"snapshot {snap.number}: segment {seg}'s sizes differ from its commit marker")
    examples: dict[tuple[int, int], pa.Table] = {}  # the examples files' rows, for the index's check

    def one(table: str, f: TableFile) -> list[str]:
        """One compacted file against the shards it replaces (files are checked on threads: Parquet
        decoding releases the GIL)."""
        found: list[str] = []
        data = read_hashed(f.path, f.sha256, f"snapshot {snap.number} lists it", found)
        if data is None:
            return found
        if f.xxh3 and xxh3(data) != f.xxh3:  # (what a reader checks on open must hold too)
            return [f"{f.path}: its XXH3 does not match snapshot {snap.number} (its SHA-256 does)"]
        try:
            got = pq.ParquetFile(pa.BufferReader(data)).read()
        except Exception as e:
            return [f"{f.path}: unreadable Parquet ({type(e).__name__}: {e})"]
        if table == "examples":
            examples[(f.first, f.last)] = got
        shards = []
        for seg in sorted(s for s in snap.segments if f.first <= s <= f.last):
            rel = f"tables/{table}/{segment_name(seg)}.parquet"
            try:
                shards.append(  # (a shard is small: Arrow's threads cost more than they give, ~20% CPU)
                    pq.ParquetFile(pa.BufferReader(location.read_bytes(rel, MAX_TABLE_BYTES))).read(
                        use_threads=False
                    )
                )
            except Exception:
                shards = []  # (a missing or damaged shard is reported by the segment's own check)
                break
        if shards and not _same_rows(got, pa.concat_tables(shards, promote_options="permissive")):
            return [f"{f.path}: its rows differ from the shards of segments {f.first}..{f.last} it replaces"]
        if got.num_rows != f.rows:
            return [f"{f.path}: {got.num_rows} rows, the snapshot says {f.rows}"]
        return []

    jobs = [(table, f) for table, files in snap.tables.items() for f in files]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for found in pool.map(lambda job: one(*job), jobs):  # (in order: the report is one thread's)
            problems += found
    _check_index(problems, snap, examples, read_hashed)


def _check_index(
    problems: list[str],
    snap: Snapshot,
    examples: dict[tuple[int, int], pa.Table],
    read_hashed: Callable[[str, str, str, list[str]], bytes | None],
) -> None:
    """Each relation index file holds exactly its examples file's (relation_id, example_id) pairs,
    sorted, as :func:`actstore.core.relation_index.index_table` makes them (an index that lost or
    gained an example would make a selection miss rows or scan the wrong range)."""
    for f in snap.relation_index:
        data = read_hashed(f.path, f.sha256, f"snapshot {snap.number} lists it", problems)
        if data is None:
            continue
        if f.xxh3 and xxh3(data) != f.xxh3:
            problems.append(f"{f.path}: its XXH3 does not match snapshot {snap.number} (its SHA-256 does)")
            continue
        try:
            got = pq.ParquetFile(pa.BufferReader(data)).read()
        except Exception as e:
            problems.append(f"{f.path}: unreadable Parquet ({type(e).__name__}: {e})")
            continue
        source = examples.get((f.first, f.last))
        if source is not None and not _same_rows(got, index_table([source])):
            problems.append(
                f"{f.path}: the relation index differs from the examples of segments {f.first}..{f.last}"
            )
        elif got.num_rows != f.rows:
            problems.append(f"{f.path}: {got.num_rows} rows, the snapshot says {f.rows}")
