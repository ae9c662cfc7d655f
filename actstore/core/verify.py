"""``actstore verify``: check every byte of a store against what was committed, and that nothing is lost.

Checks, collected rather than raised so that one run reports all of them:

- the manifest and every commit marker parse and pass their field checks (a marker whose
  ``segment`` field disagrees with its file name stops the store from opening at all);
- every segment the manifest promises is committed; a segment whose data is there without its
  marker (a deleted marker, or an ingest still running or killed) is named;
- every object a commit marker lists (every chunk and ``zarr.json`` of the segment) exists and
  has the recorded hash (XXH3-128 in markers of format 4, SHA-256 before); every array has the
  shape the marker implies and the full chunk grid (an array of a kind the corpus ingest kept no
  layer of: none, :func:`unwritten_arrays`);
- every table file matches its SHA-256 (segment shards: the marker; other tables: the
  ``.sha256`` companion) and parses; the ragged offsets in the tables stay inside the flat
  arrays; ``heads`` is the table the geometry implies;
- the weights the store uses (its own ``weights/``, or the shared copy its ``weights.json`` names)
  decode, have the shapes the geometry implies and every chunk, and hash to the recorded SHA-256;
- every tokenizer file the manifest records (``model.tokenizer``) exists and has its SHA-256;
- the snapshot (when the store has one): each segment it lists has its marker with the same sizes,
  and each compacted file exists, matches the snapshot's SHA-256 and holds exactly the rows of the
  shards it replaces, in order;
- with ``values=True``, every chunk is decoded and NaN or infinite values are problems.
"""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from actstore.core.array_meta import ArrayMeta, parse_array_meta
from actstore.core.arrays import NUMPY_DTYPE, check_array, widen
from actstore.core.chunks import CHUNK_SEPARATORS
from actstore.core.errors import ActstoreError, CorruptStoreError
from actstore.core.layout import MAX_CHUNK_BYTES, MAX_TOKENIZER_FILE_BYTES, SEGMENT_ARRAYS, TOKENIZER_DIR
from actstore.core.manifest import SegmentCommit
from actstore.core.progress import progress_bar
from actstore.core.segments import expected_shape, read_commits, segment_name, unwritten_arrays
from actstore.core.store import StoreReader
from actstore.core.tables import (
    ALL_SEGMENT_TABLES,
    HASH_SUFFIX,
    MAX_TABLE_BYTES,
    OBJECT_HASHES,
    digest,
    sha256,
)
from actstore.core.verify_report import VerifyReport, read_hashed
from actstore.core.verify_snapshot import check_snapshot
from actstore.core.verify_tables import check_segment_tables
from actstore.core.weight_store import RECORD, group_hash, missing_message


def _ranges(values: list[int]) -> str:
    out: list[str] = []
    for v in values:
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def _chunk_index(key: str) -> int | None:
    """The axis-0 chunk index of an array-relative chunk key ``c/i/0/...`` or ``c.i.0...`` (zarr's
    default encoding with either separator; None otherwise)."""
    for sep in CHUNK_SEPARATORS:
        parts = key.split(sep)
        if len(parts) >= 2 and parts[0] == "c" and parts[1].isdigit():
            return int(parts[1])
    return None


def _separator(arr: zarr.Array | ArrayMeta) -> str:
    """The separator of ``arr``'s chunk keys ("/" or ".")."""
    if isinstance(arr, ArrayMeta):
        return arr.separator
    encoding = getattr(arr.metadata, "chunk_key_encoding", None)  # (a v3 array's; v2 has none)
    return str(getattr(encoding, "separator", "/"))


def _array_meta(store: StoreReader, seg: int, name: str) -> ArrayMeta:
    """Segment array ``name``'s metadata, read from its ``zarr.json`` and checked as :meth:`StoreReader.array`
    checks the array (shape against the marker, dtype, chunking, sizes)."""
    rel = f"segments/{segment_name(seg)}/{name}"
    where = f"{store.url}/{rel}"
    try:
        data = store.location.read_bytes(f"{rel}/zarr.json", 1 << 20)
    except FileNotFoundError:
        raise CorruptStoreError(f"{where}: cannot open array (zarr.json is missing)") from None
    except OSError as e:
        raise CorruptStoreError(f"{where}: cannot open array ({e})") from None
    meta = parse_array_meta(data, where)
    commit = store.commits[seg]
    dtype = NUMPY_DTYPE[store.manifest.storage_dtype]
    check_array(meta, where, expected_shape(store.geometry, name, commit), dtype, MAX_CHUNK_BYTES)
    return meta


def _grid_keys(arr: zarr.Array | ArrayMeta) -> dict[str, int]:
    """The chunk keys (relative to the array) of the full grid of an array chunked along axis 0."""
    n, chunk, sep = int(arr.shape[0]), int(arr.chunks[0]), _separator(arr)
    tail = f"{sep}0" * (arr.ndim - 1)
    return {f"c{sep}{i}{tail}": i for i in range(-(-n // chunk))}


# Stored weights whose first axis is the layer (one layer per chunk); segment arrays hold every layer
# of their rows in each chunk (axis 1; resid has one slot more, the embedding).
_LAYER_WEIGHTS = frozenset({"W_O", "b_O", "W_V", "b_V", "W_down", "b_down"})
_LAYER_ARRAYS = frozenset({"z", "attn", "v", "mlp", "resid"})


def _rows(arr: zarr.Array | ArrayMeta, i: int, where: str = "") -> str:
    """The rows of chunk ``i`` and the layers they hold (``where``: the array's path in the store)."""
    chunk, n = int(arr.chunks[0]), int(arr.shape[0])
    lo, hi = i * chunk, min((i + 1) * chunk, n)
    name = where.rsplit("/", 1)[-1]
    if name in _LAYER_WEIGHTS and not where.startswith("segments/"):  # the store's or the shared weights
        return f"rows {lo}:{hi}, " + (f"layer {lo}" if hi - lo == 1 else f"layers {lo}..{hi - 1}")
    if where.startswith("segments/") and name in _LAYER_ARRAYS and len(arr.shape) > 1:
        return f"rows {lo}:{hi}, every layer 0..{int(arr.shape[1]) - 1}"
    return f"rows {lo}:{hi}"


def _scan_chunk(
    report: VerifyReport, where: str, arr: zarr.Array, i: int, logical_dtype: str | None, values: bool
) -> None:
    """Decode chunk ``i`` (its CRC32C is checked by the codec) and, with ``values``, count NaN/Inf."""
    chunk = int(arr.chunks[0])
    try:
        data = np.asarray(arr[i * chunk : (i + 1) * chunk])
    except Exception as e:
        report.problems.append(
            f"{where}: chunk {i} ({_rows(arr, i, where)}) is corrupt: {type(e).__name__}: {e}"
        )
        return
    if values:
        x = widen(data, logical_dtype) if logical_dtype else data.astype(np.float32, copy=False)
        n_nan, n_inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
        if n_nan or n_inf:
            report.problems.append(
                f"{where}: chunk {i} ({_rows(arr, i, where)}) holds {n_nan} NaN and {n_inf} infinite values"
            )


def _uncommitted(store: StoreReader, report: VerifyReport) -> None:
    """Segments the manifest promises that are not committed, told apart by whether their data exists."""
    loc = store.location
    present: set[int] = set()
    for name in loc.listdir("segments"):
        if name.isdigit():
            present.add(int(name))
    for table in ALL_SEGMENT_TABLES:
        for name in loc.listdir(f"tables/{table}"):
            stem = name[: -len(".parquet")] if name.endswith(".parquet") else ""
            if stem.isdigit():
                present.add(int(stem))
    n_segments = store.manifest.n_segments
    stray = sorted(s for s in present if s >= n_segments)
    if stray:
        report.problems.append(f"segments {_ranges(stray)}: data past the manifest's {n_segments} segments")
    missing = [s for s in range(n_segments) if s not in store.commits]
    report.uncommitted = missing
    with_data = [s for s in missing if s in present]
    without = [s for s in missing if s not in present]
    size = store.manifest.segment_size
    for s in with_data:
        lo, hi = s * size, min((s + 1) * size, store.manifest.n_examples)
        report.problems.append(
            f"segment {s} (rows {lo}..{hi - 1}) is not committed although its data is there: commits/"
            f"{segment_name(s)}.json is missing (deleted, or an ingest of this store is running or was killed: "
            "resume it with --resume)"
        )
    if without:
        report.problems.append(
            f"segment{'s' * (len(without) > 1)} {_ranges(without)} of {n_segments} not committed and without data "
            f"({sum(min(size, store.manifest.n_examples - s * size) for s in without)} rows): the ingest is "
            "incomplete (resume it with --resume)"
        )


def _check_objects(
    store: StoreReader, report: VerifyReport, seg: int, objects: dict[str, str], values: bool, algorithm: str
) -> None:
    """A segment whose marker lists its objects: every one present with its hash (``algorithm``: the
    marker's ``object_hash``), the full chunk grid listed."""
    loc = store.location
    rel = f"segments/{segment_name(seg)}"
    present = set(loc.walk_files(rel))
    for key in sorted(present - set(objects)):
        report.notes.append(f"{rel}/{key}: not listed in the commit marker (ignored by readers)")
    arrays: dict[str, zarr.Array | ArrayMeta] = {}
    for name in SEGMENT_ARRAYS:  # (values: decoded through zarr; else only the metadata is needed)
        try:
            if values:
                arrays[name] = store.array(seg, name)
            elif "zarr.json" not in present:  # (zarr opens no array of a group without its zarr.json)
                raise CorruptStoreError(
                    f"{store.url}/{rel}/{name}: cannot open array (the group's zarr.json is missing)"
                )
            else:
                arrays[name] = _array_meta(store, seg, name)
        except ActstoreError as e:
            report.problems.append(str(e))
    for key in sorted(objects):
        name, _, sub = key.partition("/")
        i = _chunk_index(sub)
        arr = arrays.get(name)
        what = (
            f"{rel}/{name}: chunk {i} ({_rows(arr, i, f'{rel}/{name}')})"
            if i is not None and arr is not None
            else f"{rel}/{key}"
        )
        if key not in present:
            report.problems.append(f"{what} is missing (lost or deleted; the commit marker lists it)")
            continue
        try:
            data = loc.read_bytes(f"{rel}/{key}", MAX_CHUNK_BYTES + (1 << 20))
        except (ActstoreError, OSError) as e:
            report.problems.append(f"{what} cannot be read: {e}")
            continue
        if digest(data, algorithm) != objects[key]:
            report.problems.append(
                f"{what} is corrupt: {OBJECT_HASHES[algorithm][0]} does not match the commit marker"
            )
            continue
        if i is not None:
            report.chunks_checked += 1
            if values and isinstance(arr, zarr.Array):
                _scan_chunk(report, f"{rel}/{name}", arr, i, store.manifest.storage_dtype, True)
    unwritten = unwritten_arrays(store.manifest)  # (zeros by the manifest: no chunk need exist)
    for name, arr in arrays.items():
        if name in unwritten:
            continue
        listed = {_chunk_index(k.partition("/")[2]) for k in objects if k.startswith(name + "/")}
        unlisted = [i for i in _grid_keys(arr).values() if i not in listed]
        if unlisted:
            report.problems.append(
                f"{rel}/{name}: the commit marker does not list chunk(s) {_ranges(unlisted)}"
            )


def _check_other_tables(store: StoreReader, report: VerifyReport) -> None:
    """Non-segment tables: each file's ``.sha256`` companion and Parquet; ``heads`` against the geometry."""
    loc = store.location
    unhashed: list[str] = []
    for name in loc.listdir("tables"):
        if name in ALL_SEGMENT_TABLES:
            continue
        files = loc.listdir(f"tables/{name}")
        for f in files:
            if f.endswith(".parquet" + HASH_SUFFIX) and f[: -len(HASH_SUFFIX)] not in files:
                report.notes.append(
                    f"tables/{name}/{f}: a hash without its table file (an interrupted write)"
                )
        for f in (f for f in files if f.endswith(".parquet")):
            rel = f"tables/{name}/{f}"
            try:
                data = loc.read_bytes(rel, MAX_TABLE_BYTES)
                want = store.table_hash(rel)
            except (ActstoreError, OSError) as e:
                report.problems.append(f"{rel}: cannot be read: {e}")
                continue
            if want is None:
                unhashed.append(rel)
            elif sha256(data) != want:
                report.problems.append(f"{rel}: SHA-256 does not match {f}{HASH_SUFFIX} (table corrupted)")
                continue
            try:
                table = pq.read_table(pa.BufferReader(data))
            except Exception as e:
                report.problems.append(
                    f"{rel}: unreadable Parquet ({type(e).__name__}: {' '.join(str(e).split())})"
                )
                continue
            if rel == "tables/heads/heads.parquet" and not _heads_ok(store, table):
                report.problems.append(f"{rel}: not the (layer, head, kv_head) table of the store's geometry")
    if "heads" not in loc.listdir("tables") or "heads.parquet" not in loc.listdir("tables/heads"):
        report.problems.append("tables/heads/heads.parquet: missing")
    if unhashed:
        text = (
            f"{len(unhashed)} table file(s) without a {HASH_SUFFIX} companion ({', '.join(unhashed[:3])}"
            f"{', ...' if len(unhashed) > 3 else ''})"
        )
        report.problems.append(f"{text}: this store writes one beside every table file (deleted?)")


def _heads_ok(store: StoreReader, table: pa.Table) -> bool:
    g = store.geometry
    try:
        layer, head, kv = (table.column(c).to_numpy() for c in ("layer", "head", "kv_head"))
    except (KeyError, pa.ArrowException):
        return False
    return (
        np.array_equal(layer, np.repeat(np.arange(g.n_layers), g.n_heads))
        and np.array_equal(head, np.tile(np.arange(g.n_heads), g.n_layers))
        and np.array_equal(kv, np.tile(np.arange(g.n_heads) // g.kv_group, g.n_layers))
    )


def _check_weights(store: StoreReader, report: VerifyReport, values: bool) -> None:
    """The copy of the weights the store uses (its own ``weights/``, or the shared copy its
    ``weights.json`` names): every chunk there and decoding, and the content hash the record holds."""
    try:
        record = store.weights_record
        src = store.weights_source
    except ActstoreError as e:
        report.problems.append(str(e))
        return
    if src is None:
        if (
            record is None or record.mode != "none"
        ):  # a store ingested with --weights none has nothing to check
            report.problems.append(missing_message(store.url, record))
        return
    try:
        group = store._weights_group
        names = sorted(group.array_keys())
    except ActstoreError as e:
        report.problems.append(str(e))
        return
    present = set(src.location.walk_files(src.rel))
    before = len(report.problems)
    for name in names:
        where = f"weights/{name}" if src.kind == "store" else f"{src.where}/{name}"
        try:
            arr = store.weight_array(name)
        except ActstoreError as e:
            report.problems.append(str(e))
            continue
        for key, i in _grid_keys(arr).items():
            if posixpath.join(name, key) not in present:
                report.problems.append(
                    f"{where}: chunk {i} ({_rows(arr, i, where)}) is missing (lost or deleted)"
                )
                continue
            report.chunks_checked += 1
            _scan_chunk(report, where, arr, i, None, values)
    if record is not None and len(report.problems) == before:
        try:
            got = group_hash(group)
        except Exception as e:
            report.problems.append(f"{src.where}: unreadable ({type(e).__name__}: {e})")
            return
        if got != record.sha256:
            report.problems.append(
                f"{src.where}: the weights' sha256 {got[:16]}... is not {record.sha256[:16]}..., the hash "
                f"{RECORD} records (corrupt or replaced)"
            )


def _check_tokenizer(store: StoreReader, report: VerifyReport) -> None:
    """Each tokenizer file the manifest records: present, with its SHA-256 (every file is reported)."""
    try:
        record = store.tokenizer_record()
    except ActstoreError as e:
        report.problems.append(str(e))
        return
    for name, want in sorted((record or {}).items()):
        read_hashed(
            store,
            report,
            f"{TOKENIZER_DIR}/{name}",
            MAX_TOKENIZER_FILE_BYTES,
            want,
            "the manifest's model.tokenizer records it",
            "the manifest's model.tokenizer",
        )


def verify_store(
    store: StoreReader, *, values: bool = False, threads: int | None = None, progress: bool = False
) -> VerifyReport:
    """Check ``store`` (see the module docstring); ``values`` also scans every chunk for NaN/Inf;
    ``threads``: segments checked at once (default: one per core, at most 8); ``progress``: a bar of
    the segments checked on stderr."""
    report = VerifyReport(store.url, values_checked=values)
    _uncommitted(store, report)
    markers = read_commits(store.location, store.manifest)  # every marker, the snapshot's segments too
    lost = [seg for seg in store.commits if seg not in markers]
    if lost:
        report.problems.append(
            f"segments {_ranges(lost)}: the snapshot lists them but their commit markers are missing"
        )
    old = [seg for seg, c in markers.items() if c.objects is None]
    if old:
        report.problems.append(
            f"segments {_ranges(old)}: commit markers lack the object list this store writes"
        )

    def one(commit: SegmentCommit) -> VerifyReport:
        part = VerifyReport(store.url, values_checked=values)
        if commit.objects is not None:
            _check_objects(store, part, commit.segment, commit.objects, values, commit.object_hash)
        check_segment_tables(store, part, commit)
        return part

    # Segments are independent: checked on threads (file reads and SHA-256 release the GIL), their
    # findings merged in segment order, so the report is the same as one thread's.
    with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        parts = pool.map(one, markers.values())
        for part in progress_bar(parts, total=len(markers), desc="verify", unit="segment", enabled=progress):
            report.segments_checked += 1
            report.chunks_checked += part.chunks_checked
            report.problems += part.problems
            report.notes += part.notes
    if store.snapshot is not None:
        check_snapshot(
            store.location,
            report.problems,
            store.snapshot,
            markers,
            lambda rel, want, missing, problems: read_hashed(
                store,
                VerifyReport(store.url, problems=problems),
                rel,
                MAX_TABLE_BYTES,
                want,
                missing,
                "the snapshot",
            ),
            threads=threads or min(8, os.cpu_count() or 1),
        )
    _check_other_tables(store, report)
    _check_weights(store, report, values)
    _check_tokenizer(store, report)
    return report


def quick_verify_store(store: StoreReader) -> VerifyReport:
    """``verify --quick``: the manifest, every commit marker and the snapshot parse and agree, every
    promised segment is committed, and every table file exists with a Parquet footer that parses;
    no chunk or table byte is hashed (cost: one marker read per segment and one footer read per
    table file)."""
    report = VerifyReport(store.url, values_checked=False)
    _uncommitted(store, report)
    markers = read_commits(store.location, store.manifest)
    report.segments_checked = len(markers)
    lost = [seg for seg in store.commits if seg not in markers]
    if lost:
        report.problems.append(
            f"segments {_ranges(lost)}: the snapshot lists them but their commit markers are missing"
        )
    snap = store.snapshot
    if snap is not None:
        for seg, sizes in snap.segments.items():
            m = markers.get(seg)
            if m is not None and (m.n_sources, m.n_tokens) != sizes:
                report.problems.append(
                    f"snapshot {snap.number}: segment {seg}'s sizes differ from its commit marker"
                )
    for files in store.table_files().values():
        for rel in files:
            try:
                with store.location.fs.open(store.location.path(rel), "rb") as f:
                    pq.read_metadata(f)
            except FileNotFoundError:
                report.problems.append(f"{rel}: missing")
            except Exception as e:
                report.problems.append(f"{rel}: unreadable Parquet footer ({type(e).__name__}: {e})")
    return report
