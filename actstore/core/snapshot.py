"""A store's snapshot: the committed segments and the compacted files of its segment tables, in one
file, so that opening a complete store reads three small files whatever its size, and no query lists
a directory.

Layout::

    snapshot/CURRENT            the number of the current snapshot (``000003``), replaced atomically
    snapshot/000003.json        segments [[segment, n_sources, n_tokens], ...], their bytes on disk, and,
                                per segment table, its files [{path, sha256, rows, bytes, first, last,
                                min_id, max_id, xxh3}] (xxh3: the hash checked on open)
    tables/<table>/c000003-000.parquet
                                compacted files: the shards of segments ``first..last`` concatenated in
                                example order, row groups of :data:`ROW_GROUP_ROWS` rows (their min/max
                                statistics let DuckDB skip row groups by ``example_id``)
    tables/examples/i000003-000.parquet
                                the relation index of the examples file ``c000003-000``: its
                                ``(relation_id, example_id)`` pairs ordered by relation, then example, in
                                row groups of :data:`INDEX_GROUP_ROWS` (their statistics skip the row
                                groups of other relations; :mod:`actstore.core.relation_index`)

Per-segment shards and commit markers stay where they are (the markers still hold every object's
hash, and ``actstore verify`` checks the snapshot against them).  A snapshot is written by
:mod:`actstore.core.compact`: files first, then the snapshot file, then ``CURRENT``; until
``CURRENT`` names it, readers see the previous one.  Everything in a snapshot is checked before it is
used: its checksum, every field by type and range, each segment against the manifest's row layout,
each file path (a compacted file of its own table, named once), and that every table's files cover
exactly the snapshot's segments, each once.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.errors import CorruptStoreError
from actstore.core.manifest import (
    MAX_COUNT,
    Manifest,
    SegmentCommit,
    checksum_ok,
    field_int,
    parse_json_object,
    seal,
)
from actstore.core.storage.base import StoreLocation
from actstore.core.tables import ALL_SEGMENT_TABLES

SNAPSHOT_DIR = "snapshot"
CURRENT = f"{SNAPSHOT_DIR}/CURRENT"
SNAPSHOT_VERSION = 1
ROW_GROUP_ROWS = 32_768  # rows per row group of a compacted file (statistics prune by these)
INDEX_GROUP_ROWS = 8_192  # rows per row group of a relation index file
MAX_SNAPSHOT_BYTES = 256 << 20  # about 10^7 segments; a larger snapshot file is refused unread
_FILE_NAME = re.compile(r"c(\d{6,})-(\d{3,})\.parquet")
_INDEX_NAME = re.compile(r"i(\d{6,})-(\d{3,})\.parquet")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


def snapshot_name(number: int) -> str:
    return f"{SNAPSHOT_DIR}/{number:06d}.json"


def compacted_name(table: str, number: int, k: int) -> str:
    return f"tables/{table}/c{number:06d}-{k:03d}.parquet"


def index_name(number: int, k: int) -> str:
    return f"tables/examples/i{number:06d}-{k:03d}.parquet"


def is_index_file(rel: str) -> bool:
    """True for the path of a relation index file (``tables/examples/iNNNNNN-KKK.parquet``)."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[1] == "examples" and bool(_INDEX_NAME.fullmatch(parts[2]))


def is_compacted_file(rel: str) -> bool:
    """True for the path of a compacted segment-table file (``tables/<table>/cNNNNNN-KKK.parquet``)."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[1] in ALL_SEGMENT_TABLES and bool(_FILE_NAME.fullmatch(parts[2]))


@dataclass(frozen=True)
class TableFile:
    """One compacted file: the shards of the snapshot's segments ``first..last`` of one table."""

    path: str
    sha256: str
    rows: int
    bytes: int
    first: int
    last: int
    min_id: int  # smallest and largest example_id in the file (-1, -1 when it has no rows)
    max_id: int
    # its XXH3-128 (hex): what a reader checks on open, when present (snapshots written before it
    # have only the SHA-256, which is then checked instead; ``verify`` checks both)
    xxh3: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if not self.xxh3:
            del d["xxh3"]
        return d


@dataclass(frozen=True)
class Snapshot:
    """What a snapshot file says: its number, the committed segments it covers, and the compacted
    files of every segment table."""

    number: int
    segments: dict[int, tuple[int, int]]  # segment -> (n_sources, n_tokens)
    tables: dict[str, tuple[TableFile, ...]]
    segment_bytes: int = -1  # bytes under segments/ of the covered segments (-1: not counted)
    # the relation index, one file per examples file (same segments); empty: no index (a snapshot
    # written before the index existed; ``actstore compact`` adds one)
    relation_index: tuple[TableFile, ...] = ()

    def files(self) -> dict[str, TableFile]:
        """Every file the snapshot lists (the tables' and the index's), by path (built once: a reader
        asks for each file it checks)."""
        return self._files

    @functools.cached_property
    def _files(self) -> dict[str, TableFile]:
        out = {f.path: f for files in self.tables.values() for f in files}
        out.update((f.path, f) for f in self.relation_index)
        return out

    def commits(self, manifest: Manifest) -> dict[int, SegmentCommit]:
        """The covered segments as commit records (their shard hashes are not needed to read: the
        compacted files replace the shards; ``verify`` reads the markers themselves)."""
        out = {}
        for seg, (n_sources, n_tokens) in sorted(self.segments.items()):
            start = seg * manifest.segment_size
            out[seg] = SegmentCommit(
                segment=seg,
                row_start=start,
                n_rows=min(manifest.segment_size, manifest.n_examples - start),
                n_sources=n_sources,
                n_tokens=n_tokens,
                table_sha256={},
            )
        return out

    def to_json(self) -> bytes:
        d = {
            "version": SNAPSHOT_VERSION,
            "snapshot": self.number,
            "segments": [[s, a, b] for s, (a, b) in sorted(self.segments.items())],
            "tables": {t: [f.to_dict() for f in files] for t, files in sorted(self.tables.items())},
            "segment_bytes": self.segment_bytes,
        }
        if self.relation_index:
            d["relation_index"] = [f.to_dict() for f in self.relation_index]
        return json.dumps(seal(d), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, manifest: Manifest) -> Snapshot:
        d = parse_json_object(data, where, "snapshot")
        if not checksum_ok(d, set()):
            raise CorruptStoreError(f"{where}: snapshot fails its checksum (the file is corrupt)")
        where = f"{where}: snapshot"
        version = field_int(d, "version", where, 1, 1 << 20)
        if version > SNAPSHOT_VERSION:
            raise CorruptStoreError(f"{where} version {version} is newer than this actstore reads; upgrade")
        number = field_int(d, "snapshot", where, 0, MAX_COUNT)
        raw = d.get("segments")
        if not isinstance(raw, list):
            raise CorruptStoreError(f"{where} field 'segments' must be a list")
        segments = _segments(raw, where, manifest.n_segments)
        tables_raw = d.get("tables")
        if not isinstance(tables_raw, dict) or set(tables_raw) != set(manifest.segment_tables):
            raise CorruptStoreError(
                f"{where} field 'tables' must list the files of {', '.join(manifest.segment_tables)}"
            )
        tables: dict[str, tuple[TableFile, ...]] = {}
        seen: set[str] = set()
        segs = np.fromiter(segments, dtype=np.int64, count=len(segments))  # sorted: _segments checked it
        for table, files_raw in tables_raw.items():
            if not isinstance(files_raw, list):
                raise CorruptStoreError(f"{where}: the files of table {table!r} are not a list")
            files = tuple(_table_file(f, table, where) for f in files_raw)
            for f in files:
                if f.path in seen:
                    raise CorruptStoreError(f"{where}: file {f.path} is listed twice")
                seen.add(f.path)
            if not _cover_once(files, segs):
                raise CorruptStoreError(
                    f"{where}: the files of table {table!r} do not cover its segments exactly once"
                )
            tables[table] = files
        ranges = {t: [(f.first, f.last) for f in files] for t, files in tables.items()}
        if len({tuple(r) for r in ranges.values()}) > 1:
            raise CorruptStoreError(f"{where}: the tables' files cover different segment ranges")
        segment_bytes = field_int(d, "segment_bytes", where, -1, 1 << 62) if "segment_bytes" in d else -1
        index = _relation_index(d.get("relation_index", []), where, seen, ranges["examples"])
        return cls(
            number=number,
            segments=segments,
            tables=tables,
            segment_bytes=segment_bytes,
            relation_index=index,
        )


def _segments(raw: list[Any], where: str, n_segments: int) -> dict[int, tuple[int, int]]:
    """The snapshot's ``[segment, n_sources, n_tokens]`` entries, checked: three integers each (JSON
    integers: not floats, not booleans), segments below ``n_segments``, none twice, sizes in range;
    returned in segment order.  Types by one pass over the flattened values, ranges by numpy (3,907 entries
    at 10^6 rows: a per-entry loop cost about 25 ms of every open)."""
    if not all(type(e) is list and len(e) == 3 for e in raw):
        raise CorruptStoreError(f"{where}: a segment entry is not [segment, n_sources, n_tokens]")
    flat = [v for e in raw for v in e]
    if any(type(v) is not int for v in flat) or any(abs(v) > (1 << 62) for v in flat):
        raise CorruptStoreError(f"{where}: a segment entry is not [segment, n_sources, n_tokens]")
    a = np.array(flat, dtype=np.int64).reshape(-1, 3)
    seg, sizes = a[:, 0], a[:, 1:]
    if len(seg) and (seg.min() < 0 or seg.max() >= n_segments):
        bad = int(seg[(seg < 0) | (seg >= n_segments)][0])
        raise CorruptStoreError(f"{where}: segment {bad} is past the store's {n_segments}")
    if len(seg) > 1 and not bool((np.diff(seg) > 0).all()):  # (written in order; read in any)
        values, counts = np.unique(seg, return_counts=True)
        if (counts > 1).any():
            raise CorruptStoreError(f"{where}: segment {int(values[counts > 1][0])} is listed twice")
        a = a[np.argsort(seg, kind="stable")]
        seg, sizes = a[:, 0], a[:, 1:]
    if len(seg) and (sizes.min() < 0 or sizes.max() > MAX_COUNT):
        bad = int(seg[((sizes < 0) | (sizes > MAX_COUNT)).any(axis=1)][0])
        raise CorruptStoreError(f"{where}: segment {bad} has impossible sizes")
    return dict(zip(seg.tolist(), zip(a[:, 1].tolist(), a[:, 2].tolist(), strict=True), strict=True))


def _cover_once(files: tuple[TableFile, ...], segs: np.ndarray) -> bool:
    """True when the files' segment ranges ``first..last`` hold every segment of ``segs`` (sorted)
    exactly once: together they hold as many as there are, and each segment lies in one."""
    lo = np.array([f.first for f in files], dtype=np.int64)
    hi = np.array([f.last for f in files], dtype=np.int64)
    held = np.searchsorted(segs, hi, side="right") - np.searchsorted(segs, lo, side="left")
    if int(held.sum()) != len(segs):
        return False
    if not len(segs):
        return True
    hits = np.zeros(len(segs), dtype=np.int64)
    for a, b in zip(np.searchsorted(segs, lo, side="left"), np.searchsorted(segs, hi, side="right")):
        hits[a:b] += 1
    return bool((hits == 1).all())


def _relation_index(
    raw: Any, where: str, seen: set[str], examples: list[tuple[int, int]]
) -> tuple[TableFile, ...]:
    """The snapshot's relation index files, checked: index file names, each listed once, covering the
    segments of the examples files one for one (an empty list: no index)."""
    if not isinstance(raw, list):
        raise CorruptStoreError(f"{where} field 'relation_index' must be a list")
    files = tuple(_table_file(f, "examples", where, index=True) for f in raw)
    for f in files:
        if f.path in seen:
            raise CorruptStoreError(f"{where}: file {f.path} is listed twice")
        seen.add(f.path)
    if files and [(f.first, f.last) for f in files] != examples:
        raise CorruptStoreError(f"{where}: the relation index does not cover the examples files one for one")
    return files


def _table_file(raw: Any, table: str, where: str, *, index: bool = False) -> TableFile:
    if not isinstance(raw, dict):
        raise CorruptStoreError(f"{where}: a file entry of table {table!r} is not an object")
    path = raw.get("path")
    named = is_index_file if index else is_compacted_file
    if not isinstance(path, str) or not named(path) or path.split("/")[1] != table:
        shown = repr(path)[:80]
        kind = "relation index file" if index else f"compacted file of table {table!r}"
        letter = "i" if index else "c"
        raise CorruptStoreError(
            f"{where}: {shown} is not a {kind} (tables/{table}/{letter}NNNNNN-KKK.parquet)"
        )
    digest = raw.get("sha256")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise CorruptStoreError(f"{where}: the hash of {path} is not a SHA-256 hex digest")
    fast = raw.get("xxh3", "")
    if not isinstance(fast, str) or (fast and not _HEX32.fullmatch(fast)):
        raise CorruptStoreError(f"{where}: the xxh3 of {path} is not an XXH3-128 hex digest")
    w = f"{where} file {path}"
    f = TableFile(
        path=path,
        sha256=digest,
        rows=field_int(raw, "rows", w, 0, MAX_COUNT),
        bytes=field_int(raw, "bytes", w, 0, MAX_COUNT),
        first=field_int(raw, "first", w, 0, MAX_COUNT),
        last=field_int(raw, "last", w, 0, MAX_COUNT),
        min_id=field_int(raw, "min_id", w, -1, 1 << 62),
        max_id=field_int(raw, "max_id", w, -1, 1 << 62),
        xxh3=fast,
    )
    if f.last < f.first:
        raise CorruptStoreError(f"{w}: segments {f.first}..{f.last} is an empty range")
    return f


def current_number(location: StoreLocation) -> int | None:
    """The number ``snapshot/CURRENT`` names (None when the store has no snapshot)."""
    try:
        text = location.read_bytes(CURRENT, 64).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None
    if not text.isdigit() or len(text) > 12:
        raise CorruptStoreError(f"{location.url}/{CURRENT}: not a snapshot number ({text[:20]!r})")
    return int(text)


def read_snapshot(location: StoreLocation, manifest: Manifest) -> Snapshot | None:
    """The current snapshot, checked (None when the store has none)."""
    number = current_number(location)
    if number is None:
        return None
    rel = snapshot_name(number)
    where = f"{location.url}/{rel}"
    try:
        data = location.read_bytes(rel, MAX_SNAPSHOT_BYTES)
    except FileNotFoundError:
        raise CorruptStoreError(f"{where}: missing ({CURRENT} names it)") from None
    snap = Snapshot.from_json(data, where, manifest)
    if snap.number != number:
        raise CorruptStoreError(f"{where}: says it is snapshot {snap.number}, {CURRENT} says {number}")
    return snap
