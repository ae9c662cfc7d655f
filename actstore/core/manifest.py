"""The manifest: what a store is (format, model, geometry, settings) and which segments are committed.

A store is split into *segments* of ``segment_size`` consecutive examples.  A segment's
arrays and table shards are written first; its commit marker ``commits/NNNNNN.json`` is
written last and atomically.  Readers only see segments whose marker exists, so a killed
writer leaves at most an uncommitted segment that a resume rewrites from scratch.

A store's files may come from anyone (a shared folder, a download), so every field is checked
for type and range before use, and every file for size and nesting depth before parsing: a
hostile or damaged manifest or marker is one :class:`CorruptStoreError` line, never a crash,
an allocation of a made-up size or a loop over a made-up count.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from actstore.core.errors import CorruptStoreError, FormatVersionError, StoreNotFoundError
from actstore.core.tables import ALL_SEGMENT_TABLES, OBJECT_HASHES, SEGMENT_TABLES, store_segment_tables

if TYPE_CHECKING:
    from actstore.core.storage.base import StoreLocation

FORMAT_NAME = "actstore"
FORMAT_VERSION = 4  # 2: segment arrays may be chunked along the layer axis too (chunk_layers);
#                     3: a snapshot (snapshot/CURRENT) may list compacted segment tables;
#                     4: a commit marker may list its objects' XXH3-128 (object_hash "xxh3")
OBJECT_HASH_FROM = 4  # the format version whose writers hash a segment's objects with XXH3-128
OLDEST_READ = 2  # format 2 reads as a store without a snapshot; `actstore compact` upgrades it in place
# What a store's writer guarantees beyond format version 1 (readers of older levels ignore it):
#   0  stores written before 2026-12: all-zero chunks may be absent, markers carry no object list;
#   1  every chunk is written (all-zero ones too), each commit marker lists every object of its
#      segment with its hash (SHA-256; XXH3-128 from format 4), and every non-segment table file
#      has a ``.sha256`` companion.
INTEGRITY = 1
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
CHECKSUM_KEY = "checksum"  # SHA-256 of the rest of the JSON object, so a flipped byte is caught

MAX_JSON_BYTES = 16 << 20  # a manifest or commit marker larger than this is refused unread
MAX_JSON_DEPTH = 32  # nesting deeper than this is refused (real ones nest at most 4 deep)
MAX_COUNT = 1 << 40  # examples, rows, sources, tokens: far above any corpus, far below int64
MAX_CONTEXT = 1 << 22  # tokens per prompt a marker may claim

# Geometry bounds: far beyond today's largest models, small enough that nothing derived from
# them (the heads table, a row of z, a weight matrix) is an absurd allocation.
GEOMETRY_LIMITS: dict[str, int] = {
    "n_layers": 4096,
    "n_heads": 4096,
    "n_kv_heads": 4096,
    "d_head": 1 << 16,
    "d_model": 1 << 20,
    "d_mlp": 1 << 22,
    "vocab_size": 1 << 24,
}
MAX_HEADS_TOTAL = 1 << 20  # n_layers * n_heads

_HEX64 = re.compile(r"[0-9a-f]{64}")
_OBJECT_KEY = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
# the same checks over a marker's whole object list at once, its entries joined by newlines
_HEX = {a: re.compile(f"[0-9a-f]{{{n}}}") for a, (_, n) in OBJECT_HASHES.items()}  # (object digests)
_HEX_LINES = {a: re.compile(f"(?:[0-9a-f]{{{n}}}\n)*") for a, (_, n) in OBJECT_HASHES.items()}
_OBJECT_KEY_LINES = re.compile(r"(?:[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*\n)*")
_DOTDOT = re.compile(r"(?:^|[/\n])\.\.(?:[/\n]|$)")


def _objects_ok(objects: dict[str, Any], algorithm: str) -> bool:
    """True when every key of a marker's ``objects`` is an object key (path components of
    ``[A-Za-z0-9_.-]``, none ``..``, at most 512 characters) and every value a hex digest of
    ``algorithm`` (SHA-256 or XXH3-128): the per-entry checks in two regular-expression matches (a
    marker lists about 70 objects)."""
    keys, values = list(objects), list(objects.values())
    if not all(type(v) is str for v in values) or (keys and max(map(len, keys)) > 512):
        return False
    joined = "\n".join(keys) + "\n" if keys else ""
    digests = "\n".join(values) + "\n" if values else ""
    return (  # (one line per entry: a newline inside a key or a value fails the counts)
        joined.count("\n") == len(keys) == digests.count("\n")
        and _OBJECT_KEY_LINES.fullmatch(joined) is not None
        and _DOTDOT.search(joined) is None
        and _HEX_LINES[algorithm].fullmatch(digests) is not None
    )


def _digest(d: dict[str, Any]) -> str:
    body = {k: v for k, v in d.items() if k != CHECKSUM_KEY}
    return (
        "sha256:"
        + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    )


def seal(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its checksum added (manifests and commit markers are written sealed)."""
    return {**d, CHECKSUM_KEY: _digest(d)}


def checksum_ok(d: dict[str, Any], known: set[str]) -> bool:
    """True when ``d``'s checksum matches; files from before checksums pass if every key is known
    (a flipped byte in the key name itself leaves an unknown key)."""
    if CHECKSUM_KEY in d:
        return d[CHECKSUM_KEY] == _digest(d)
    return set(d) <= known


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of parsed JSON (iterative: a deep value cannot exhaust the stack here; stops
    counting once past ``limit``)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d > limit:
                return d
            # (only containers are queued: a snapshot's thousands of numbers cost nothing here)
            todo.extend(
                (x, d + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, dict | list)
            )
    return deepest


def parse_json_object(data: bytes, where: str, what: str) -> dict[str, Any]:
    """``data`` parsed as one JSON object, refusing oversized, deeply nested or non-object input."""
    if len(data) > MAX_JSON_BYTES:
        raise CorruptStoreError(
            f"{where}: {what} is larger than {MAX_JSON_BYTES >> 20} MiB; refusing to parse it"
        )
    try:
        d = json.loads(data)
    except RecursionError:
        raise CorruptStoreError(f"{where}: {what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CorruptStoreError(f"{where}: {what} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CorruptStoreError(f"{where}: {what} is not a JSON object")
    if text_depth(data) > MAX_JSON_DEPTH:
        raise CorruptStoreError(f"{where}: {what} nests deeper than {MAX_JSON_DEPTH} levels")
    return d


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def text_depth(data: bytes) -> int:
    """Nesting depth of the valid JSON text ``data`` (what :func:`json_depth` gives for its parsed
    value), from its brackets once its strings are blanked: a snapshot's 4,000 segment entries cost
    about 4 ms as parsed objects, well under 1 ms so."""
    a = np.frombuffer(_JSON_STRING.sub(b'""', data), dtype=np.uint8)
    step = (a == ord("[")).astype(np.int32) + (a == ord("{")) - (a == ord("]")) - (a == ord("}"))
    return int(np.cumsum(step).max()) if len(step) else 0


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def field_int(d: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    """``d[key]`` as an int in ``lo..hi`` (a bool, float or string is refused, not converted)."""
    if key not in d:
        raise CorruptStoreError(f"{where} field {key!r} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise CorruptStoreError(f"{where} field {key!r} must be an integer, got {_kind(v)} {_show(v)}")
    if not lo <= v <= hi:
        raise CorruptStoreError(f"{where} field {key!r} is {v}, outside {lo}..{hi}")
    return v


def _field_dict(
    d: dict[str, Any], key: str, where: str, default: dict[str, Any] | None = None
) -> dict[str, Any]:
    if key not in d and default is not None:
        return dict(default)
    v = d.get(key)
    if not isinstance(v, dict):
        raise CorruptStoreError(f"{where} field {key!r} must be a JSON object, got {_kind(v)}")
    return v


def _field_str(d: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    if key not in d and default is not None:
        return default
    v = d.get(key)
    if not isinstance(v, str):
        raise CorruptStoreError(f"{where} field {key!r} must be a string, got {_kind(v)} {_show(v)}")
    return v


@dataclass(frozen=True)
class Geometry:
    """Model shape.  ``d_mlp`` is the input width of the MLP down projection."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_mlp: int
    vocab_size: int

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head (grouped-query attention); head h reads kv head h // kv_group."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "manifest") -> Geometry:
        """A geometry from stored JSON, every field checked (see :data:`GEOMETRY_LIMITS`)."""
        if not isinstance(d, dict):
            raise CorruptStoreError(f"{where} field 'geometry' must be a JSON object, got {_kind(d)}")
        values = {
            f.name: field_int(d, f.name, f"{where} geometry", 1, GEOMETRY_LIMITS[f.name]) for f in fields(cls)
        }
        g = cls(**values)
        if g.n_heads % g.n_kv_heads:
            raise CorruptStoreError(
                f"{where} geometry: n_heads {g.n_heads} is not a multiple of n_kv_heads {g.n_kv_heads}"
            )
        if g.n_layers * g.n_heads > MAX_HEADS_TOTAL:
            raise CorruptStoreError(
                f"{where} geometry: {g.n_layers} x {g.n_heads} heads, more than {MAX_HEADS_TOTAL}"
            )
        return g


@dataclass(frozen=True)
class SegmentCommit:
    """The commit marker of one segment: its row range, the sizes of its ragged axes, the SHA-256 of
    its table shards and (``objects``, stores of integrity 1) the hash of every object under its
    ``segments/NNNNNN/`` folder, keyed by the path below that folder (``z/c.0.0.0.0``, ``z/zarr.json``;
    ``z/c/0/0/0/0`` in segments written before 2026-12-07): XXH3-128 where ``object_hash`` is
    ``"xxh3"`` (format 4), else SHA-256 (the field is absent from such markers)."""

    segment: int
    row_start: int
    n_rows: int
    n_sources: int
    n_tokens: int
    table_sha256: dict[str, str]
    objects: dict[str, str] | None = None  # None: a marker written before object lists
    object_hash: str = "sha256"  # what ``objects`` holds: "sha256" or "xxh3" (XXH3-128, format 4)

    def to_json(self) -> bytes:
        d = asdict(self)
        if self.objects is None:
            d.pop("objects")
        if self.object_hash == "sha256":  # (a format 3 marker, byte for byte)
            d.pop("object_hash")
        return json.dumps(seal(d), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> SegmentCommit:
        d = parse_json_object(data, where, "commit marker")
        if not checksum_ok(d, {f.name for f in fields(cls)}):
            raise CorruptStoreError(f"{where}: commit marker fails its checksum (the file is corrupt)")
        where = f"{where}: commit marker"
        tables = _field_dict(d, "table_sha256", where)
        if set(tables) not in (set(SEGMENT_TABLES), set(ALL_SEGMENT_TABLES)) or not all(
            isinstance(v, str) and _HEX64.fullmatch(v) for v in tables.values()
        ):
            raise CorruptStoreError(
                f"{where} field 'table_sha256' must map {', '.join(SEGMENT_TABLES)} to SHA-256 hex digests"
            )
        algorithm = d.get("object_hash", "sha256")
        if algorithm not in _HEX:
            raise CorruptStoreError(
                f"{where} field 'object_hash' must be one of {', '.join(_HEX)}, got {_show(algorithm)}"
            )
        objects: dict[str, str] | None = None
        if "objects" in d:
            raw = _field_dict(d, "objects", where)
            for k, v in [] if _objects_ok(raw, algorithm) else raw.items():  # (the loop finds the bad entry)
                if (
                    not _OBJECT_KEY.fullmatch(k)
                    or ".." in k.split("/")
                    or len(k) > 512
                    or not isinstance(v, str)
                    or not _HEX[algorithm].fullmatch(v)
                ):
                    raise CorruptStoreError(f"{where} field 'objects' has a bad entry {_show(k)}: {_show(v)}")
            objects = dict(raw)
        return cls(
            segment=field_int(d, "segment", where, 0, MAX_COUNT),
            row_start=field_int(d, "row_start", where, 0, MAX_COUNT),
            n_rows=field_int(d, "n_rows", where, 0, MAX_COUNT),
            n_sources=field_int(d, "n_sources", where, 0, MAX_COUNT),
            n_tokens=field_int(d, "n_tokens", where, 0, MAX_COUNT),
            table_sha256=dict(tables),
            objects=objects,
            object_hash=algorithm,
        )

    def check_against(self, manifest: Manifest, name: str, where: str) -> None:
        """Refuse a marker that disagrees with its file name ``name`` or with the manifest's row layout."""
        if name != f"{self.segment:06d}.json":
            raise CorruptStoreError(
                f"{where}: the marker's segment field says {self.segment}, its file name says otherwise "
                "(a copied or renamed marker; the store cannot be read until it is fixed)"
            )
        if self.segment >= manifest.n_segments:
            raise CorruptStoreError(
                f"{where}: segment {self.segment} is past the store's {manifest.n_segments} segments"
            )
        want_start = self.segment * manifest.segment_size
        want_rows = min(manifest.segment_size, manifest.n_examples - want_start)
        if self.row_start != want_start or self.n_rows != want_rows:
            raise CorruptStoreError(
                f"{where}: rows {self.row_start}..{self.row_start + self.n_rows} but segment {self.segment} holds "
                f"rows {want_start}..{want_start + want_rows}"
            )
        if set(self.table_sha256) != set(manifest.segment_tables):
            raise CorruptStoreError(
                f"{where}: the marker lists tables {', '.join(sorted(self.table_sha256))}, the store's "
                f"segments have {', '.join(manifest.segment_tables)}"
            )
        if max(self.n_sources, self.n_tokens) > max(1, self.n_rows) * MAX_CONTEXT:
            raise CorruptStoreError(
                f"{where}: {max(self.n_sources, self.n_tokens)} sources or tokens for "
                f"{self.n_rows} rows is more than {MAX_CONTEXT} per row"
            )


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to interpret the arrays, plus what a resume must match."""

    geometry: Geometry
    model: dict[str, Any]
    storage_dtype: str
    segment_size: int
    n_examples: int
    chunk_rows: int
    chunk_flat: int
    ingest: dict[str, Any] = field(default_factory=dict)
    architecture: dict[str, Any] = field(default_factory=dict)
    code_version: str = ""
    chunk_layers: int = 0  # layers per chunk of the segment arrays (axis 1); 0: all layers in one chunk
    format_version: int = FORMAT_VERSION
    integrity: int = INTEGRITY

    @property
    def n_segments(self) -> int:
        return (self.n_examples + self.segment_size - 1) // self.segment_size

    @property
    def segment_tables(self) -> tuple[str, ...]:
        """The tables written per segment: examples, tokens, targets, and positions in a corpus store."""
        return store_segment_tables(self.ingest)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["format"] = FORMAT_NAME
        return json.dumps(seal(d), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        d = parse_json_object(data, f"{where}/manifest.json", "manifest")
        if d.get("format") != FORMAT_NAME:
            raise CorruptStoreError(f"{where}: not an actstore manifest")
        version = d.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise FormatVersionError(
                f"{where}: manifest field 'format_version' must be an integer, got {_kind(version)} {_show(version)}"
            )
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: store format version {version} is newer than this actstore reads "
                f"(up to {FORMAT_VERSION}); upgrade actstore"
            )
        if version < 1:
            raise FormatVersionError(
                f"{where}: store format version {version} is not a valid actstore version"
            )
        if not checksum_ok(d, {f.name for f in fields(cls)} | {"format"}):
            raise CorruptStoreError(f"{where}: manifest.json fails its checksum (the file is corrupt)")
        w = f"{where}: manifest"
        integrity = field_int(d, "integrity", w, 0, 1 << 20) if "integrity" in d else 0
        if version < OLDEST_READ or integrity < INTEGRITY:
            raise FormatVersionError(
                f"{where}: written by an earlier actstore (format {version}, integrity {integrity}; this one reads "
                f"format {FORMAT_VERSION}, integrity {INTEGRITY}): ingest it again (actstore ingest ... --overwrite)"
            )
        storage_dtype = _field_str(d, "storage_dtype", w)
        if storage_dtype not in STORAGE_DTYPES:
            raise CorruptStoreError(
                f"{w} field 'storage_dtype' is {_show(storage_dtype)}, not one of {', '.join(STORAGE_DTYPES)}"
            )
        model = _field_dict(d, "model", w)
        if "name" in model and model["name"] is not None and not isinstance(model["name"], str):
            raise CorruptStoreError(f"{w} field 'model.name' must be a string, got {_kind(model['name'])}")
        return cls(
            geometry=Geometry.from_dict(d.get("geometry"), w),  # type: ignore[arg-type]
            model=model,
            storage_dtype=storage_dtype,
            segment_size=field_int(d, "segment_size", w, 1, 1 << 24),
            n_examples=field_int(d, "n_examples", w, 0, MAX_COUNT),
            chunk_rows=field_int(d, "chunk_rows", w, 1, 1 << 24),
            chunk_flat=field_int(d, "chunk_flat", w, 1, 1 << 30),
            chunk_layers=field_int(d, "chunk_layers", w, 0, 1 << 20) if "chunk_layers" in d else 0,
            ingest=_field_dict(d, "ingest", w, {}),
            architecture=_field_dict(d, "architecture", w, {}),
            code_version=_field_str(d, "code_version", w, ""),
            format_version=version,
            integrity=integrity,
        )


def read_manifest(location: StoreLocation) -> Manifest:
    """The manifest of the store at ``location`` (no segment, table or weight is read)."""
    try:  # one GET (no HEAD first)
        data = location.read_bytes("manifest.json", MAX_JSON_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        location.probe()  # a wrong endpoint, credentials or bucket says so, not "no store"
        raise StoreNotFoundError(f"no actstore store at {location.url} (manifest.json missing)") from None
    return Manifest.from_json(data, location.url)
