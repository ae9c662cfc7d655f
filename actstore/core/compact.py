"""Compaction: the per-segment shards of ``examples``, ``tokens`` and ``targets`` gathered into a few
large files listed in a new snapshot (:mod:`actstore.core.snapshot`).

Steps, each a complete write, in this order: the new files (fresh names), the snapshot file, then
``snapshot/CURRENT``.  Killed before the last step, the store is the store it was (readers see the
previous snapshot, or none; the new files are unreferenced and the next compaction removes them);
killed after it, the new snapshot is the store.  Files of the snapshot before the previous one, and
unreferenced compacted files, are removed after ``CURRENT`` is written: a reader that opened the
store before the last compaction still finds its files.  The writer lock is held throughout;
readers take no lock.

A full compaction rewrites every table into files of at most :data:`FILE_EXAMPLES` examples; an
incremental one (every ``compact_every`` segments of a long ingest) keeps the snapshot's files and
adds one file per table for the segments committed since.  Cost: a full compaction reads and writes
every table byte once (linear in rows); an incremental one only the new segments' shards.  The tables
are compacted on threads, one a table (memory: a source file and a row group of each table at once).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actstore.core.lock import writer_lock
from actstore.core.manifest import FORMAT_VERSION
from actstore.core.relation_index import INDEX_SCHEMA, index_table, write_index
from actstore.core.snapshot import (
    CURRENT,
    ROW_GROUP_ROWS,
    SNAPSHOT_DIR,
    Snapshot,
    TableFile,
    compacted_name,
    index_name,
    is_compacted_file,
    is_index_file,
    snapshot_name,
)
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation
from actstore.core.store import StoreReader
from actstore.core.tables import ALL_SEGMENT_TABLES, SCHEMAS, SEGMENT_TABLES

FILE_EXAMPLES = 1 << 18  # examples per compacted file at most (a full compaction's file size)


@dataclass(frozen=True)
class CompactReport:
    url: str
    snapshot: int | None  # the snapshot written (None: nothing to compact)
    segments: int  # segments the snapshot covers
    files_written: int
    files_removed: int
    bytes_written: int
    upgraded: bool  # the manifest's format version was raised


def _groups(units: list[list[int]], rows: dict[int, int], limit: int) -> list[list[int]]:
    """Consecutive ``units`` (runs of segments that stay together: an old file's, or one segment)
    joined into groups of at most ``limit`` rows (a unit larger than that is a group of its own)."""
    groups: list[list[int]] = []
    size = 0
    for unit in units:
        n = sum(rows[s] for s in unit)
        if not groups or size + n > limit:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += n
    return groups


def _units(segments: list[int], old: Snapshot | None) -> list[list[int]]:
    """``segments`` (sorted) cut into the runs an old snapshot's files cover (the same for every
    table: compaction writes them together) and single uncovered segments."""
    files = old.tables[SEGMENT_TABLES[0]] if old else ()
    units: list[list[int]] = []
    current: TableFile | None = None
    for seg in segments:
        owner = (
            next((f for f in files if f.first <= seg <= f.last), None)
            if old and seg in old.segments
            else None
        )
        if owner is not None and owner is current:
            units[-1].append(seg)
        else:
            units.append([seg])
        current = owner
    return units


def _compacted_file(
    sink: Any,
    *,
    store: StoreReader,
    table: str,
    segs: list[int],
    old: Snapshot | None,
    keep: list[pa.Table] | None = None,
) -> tuple[int, int, int]:
    """Write one compacted file of ``table`` for segments ``segs`` (consecutive in store order) to the
    binary file ``sink``; its rows and smallest and largest ``example_id`` (-1, -1 when empty).  The
    rows come from the old snapshot's files where they cover the segments (a full compaction takes
    whole files) and from the shards otherwise, every file hash-checked as it is read; they are
    written a row group at a time and no source is cached, so memory is about one source file and one
    row group, whatever the store's size (the reader's table cache would hold every table of the
    store by the end)."""
    schema = SCHEMAS[table]
    writer = pq.ParquetWriter(sink, schema, compression="zstd", write_statistics=True)
    pending: list[pa.Table] = []
    n_pending = rows = 0
    lo, hi = -1, -1

    def flush(n: int) -> None:
        nonlocal pending, n_pending
        whole = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
        writer.write_table(whole.slice(0, n), row_group_size=ROW_GROUP_ROWS)
        rest = whole.slice(n)
        pending, n_pending = ([rest] if rest.num_rows else []), rest.num_rows

    for part in _row_groups(store, _sources(table, segs, old), schema):
        if part.num_rows:
            ids = part.column("example_id")
            a, b = int(pc.min(ids).as_py()), int(pc.max(ids).as_py())
            lo, hi = (a, b) if lo < 0 else (min(lo, a), max(hi, b))
        rows += part.num_rows
        if keep is not None:
            keep.append(part.select(INDEX_SCHEMA.names))
        pending.append(part)
        n_pending += part.num_rows
        while n_pending >= ROW_GROUP_ROWS:
            flush(ROW_GROUP_ROWS)
    if n_pending:
        flush(n_pending)
    writer.close()
    return rows, lo, hi


def _row_groups(store: StoreReader, files: list[str], schema: pa.Schema) -> Iterator[pa.Table]:
    """The rows of ``files`` a row group at a time (each file's bytes hash-checked first, then decoded
    one row group at a time: a compacted source of 2^18 examples holds about 11 million token rows)."""
    for rel in files:
        pf = pq.ParquetFile(pa.BufferReader(store._table_bytes(rel)))
        for i in range(pf.num_row_groups):
            yield pf.read_row_group(i).select(schema.names).cast(schema)


def _sources(table: str, segs: list[int], old: Snapshot | None) -> list[str]:
    """The files holding ``table``'s rows of ``segs``, in store order (see :func:`_compacted_file`)."""
    old_files = old.tables[table] if old else ()
    out: list[str] = []
    for seg in segs:
        owner = next((f for f in old_files if f.first <= seg <= f.last), None)
        if owner is not None and old is not None and seg in old.segments:
            if owner.path not in out:
                out.append(owner.path)
        else:
            out.append(f"tables/{table}/{seg:06d}.parquet")
    return out


def compact(
    url: str | StoreLocation,
    *,
    full: bool = True,
    log: Callable[[str], None] = lambda m: None,
) -> CompactReport:
    """Compact the store at ``url`` (see the module notes), holding its writer lock."""
    loc = url if isinstance(url, StoreLocation) else locate(url)
    with writer_lock(loc, command="actstore compact", log=log):
        return compact_held(loc, full=full, log=log)


def compacted_fully(loc: StoreLocation) -> bool:
    """Whether the current snapshot is what a full compaction would write now: every committed segment
    in it, in the files a full compaction groups them into, with the relation index and the fast
    digests.  An ingest resumed after its own final compaction (killed as it exited) then has nothing to
    compact, and writes no second snapshot of the same files."""
    store = StoreReader(loc)
    old = store.snapshot
    commits = store.commits
    if old is None or not commits or store.manifest.format_version < FORMAT_VERSION:
        return False
    if set(old.segments) != set(commits) or old.segment_bytes < 0:
        return False
    rows = {s: c.n_rows for s, c in commits.items()}
    spans = [(min(g), max(g)) for g in _groups(_units(sorted(commits), old), rows, FILE_EXAMPLES)]
    tables = store.manifest.segment_tables
    indexed = spans if "examples" in tables else []
    return (
        all([(f.first, f.last) for f in old.tables[t]] == spans for t in tables)
        and [(f.first, f.last) for f in old.relation_index] == indexed
        and all(f.xxh3 for f in old.files().values())
    )


def compact_held(
    loc: StoreLocation, *, full: bool = True, log: Callable[[str], None] = lambda m: None
) -> CompactReport:
    """:func:`compact` for a caller that holds the writer lock (an ingest, at its end or every
    ``compact_every`` segments)."""
    store = StoreReader(loc)
    old = store.snapshot
    upgraded = False
    if store.manifest.format_version < FORMAT_VERSION:  # 2 -> 3: a snapshot; 3 -> 4: markers of either hash
        from dataclasses import replace

        loc.write_bytes_atomic(
            "manifest.json", replace(store.manifest, format_version=FORMAT_VERSION).to_json()
        )
        upgraded = True
        store = StoreReader(loc)
    commits = store.commits
    if not commits:
        return CompactReport(loc.url, None, 0, 0, 0, 0, upgraded)
    new_segs = [s for s in commits if old is None or s not in old.segments]
    if not full and not new_segs:
        return CompactReport(loc.url, old.number if old else None, len(commits), 0, 0, 0, upgraded)
    number = (old.number if old else 0) + 1
    rows = {s: c.n_rows for s, c in commits.items()}
    if full or old is None:
        groups = _groups(_units(sorted(commits), old), rows, FILE_EXAMPLES)
        kept: dict[str, list[TableFile]] = {t: [] for t in store.manifest.segment_tables}
        index: list[TableFile] | None = []
    else:
        groups = [new_segs]
        kept = {t: list(old.tables[t]) for t in store.manifest.segment_tables}
        # an old snapshot without an index gets none until a full compaction (it would not cover all)
        index = list(old.relation_index) if old.relation_index or not old.segments else None

    def one_table(table: str) -> tuple[list[TableFile], list[TableFile]]:
        """The files of ``table`` this compaction writes, and the relation index files made beside them."""
        made: list[TableFile] = []
        indexed: list[TableFile] = []
        for k, segs in enumerate(groups, start=len(kept[table])):
            path = compacted_name(table, number, k)
            pairs: list[pa.Table] | None = [] if table == "examples" and index is not None else None
            (n_rows, min_id, max_id), digest, size, fast = loc.write_stream_atomic(
                path,
                functools.partial(_compacted_file, store=store, table=table, segs=segs, old=old, keep=pairs),
            )
            made.append(TableFile(path, digest, n_rows, size, min(segs), max(segs), min_id, max_id, fast))
            if pairs is not None:  # the relation index of this examples file
                ipath = index_name(number, k)
                n_index, idigest, isize, ifast = loc.write_stream_atomic(
                    ipath, functools.partial(write_index, table=index_table(pairs))
                )
                indexed.append(
                    TableFile(ipath, idigest, n_index, isize, min(segs), max(segs), min_id, max_id, ifast)
                )
        return made, indexed

    # The tables are independent files: compacted on threads (Parquet's decoding and encoding, the
    # hashes and the writes release the GIL; 0.24 s of an import of 65,536 positions on one thread).
    names = list(store.manifest.segment_tables)
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        done = dict(zip(names, pool.map(one_table, names), strict=True))
    tables = {t: (*kept[t], *done[t][0]) for t in names}
    new = [f for t in names for part in done[t] for f in part]
    if index is not None:
        index += [f for t in names for f in done[t][1]]
    written, bytes_written = len(new), sum(f.bytes for f in new)
    segments = {s: (c.n_sources, c.n_tokens) for s, c in commits.items()}
    counted = old is not None and old.segment_bytes >= 0
    seg_bytes = (old.segment_bytes if counted and old else 0) + sum(
        loc.tree_bytes(f"segments/{s:06d}") for s in segments if not (counted and old and s in old.segments)
    )
    snap = Snapshot(
        number=number,
        segments=segments,
        tables=tables,
        segment_bytes=seg_bytes,
        relation_index=tuple(index or ()),
    )
    loc.write_bytes_atomic(snapshot_name(number), snap.to_json())
    loc.write_bytes_atomic(CURRENT, f"{number:06d}\n".encode())
    removed = _remove_unreferenced(loc, snap, old)
    log(
        f"compacted {len(segments)} segments into snapshot {number} ({written} files, "
        f"{bytes_written / 1e6:.1f} MB written, {removed} old files removed)"
    )
    return CompactReport(loc.url, number, len(segments), written, removed, bytes_written, upgraded)


def _remove_unreferenced(loc: StoreLocation, snap: Snapshot, previous: Snapshot | None) -> int:
    """Remove compacted files and snapshot files that neither ``snap`` nor ``previous`` names."""
    keep = set(snap.files()) | set(previous.files() if previous else ())
    keep_snaps = {snapshot_name(snap.number)} | ({snapshot_name(previous.number)} if previous else set())
    removed = 0
    for table in ALL_SEGMENT_TABLES:
        for name in loc.listdir(f"tables/{table}"):
            rel = f"tables/{table}/{name}"
            if (is_compacted_file(rel) or is_index_file(rel)) and rel not in keep:
                loc.fs.rm(loc.path(rel))
                removed += 1
    for name in loc.listdir(SNAPSHOT_DIR):
        rel = f"{SNAPSHOT_DIR}/{name}"
        if name.endswith(".json") and rel not in keep_snaps and name[:-5].isdigit():
            loc.fs.rm(loc.path(rel))
            removed += 1
    return removed
