"""Where a store's weights live: in the store (``weights/``), in a shared cache of this machine keyed by
their content hash, or nowhere.

An ingest picks one with ``--weights`` (ours; :data:`WEIGHTS_MODES`):

- ``shared`` (the default for a local store): the weights are written once into the user cache
  (``$ACTSTORE_WEIGHTS_DIR``, else platformdirs' user cache dir ``.../actstore/weights``) as
  ``<sha256>/``, the same zarr group a store's ``weights/`` is; every store of the same model refers
  to that one copy. Writers serialise on ``<sha256>.lock`` (filelock) and write into a temporary
  folder renamed into place, so a reader sees the whole copy or none.
- ``copy``: the weights are written into the store (self-contained: to move or upload). A remote
  store (S3, any non-local URL) always gets a copy: a reader elsewhere has no access to this
  machine's cache.
- ``none``: no weights; an analysis that needs them refuses with one line (:func:`missing_message`).

Whatever the mode, the store's ``weights.json`` records the content hash (:func:`content_hash`: the
arrays' float32 bytes, their names and shapes and the group's attributes), the mode and the cache it
was shared into. Readers use the store's own ``weights/`` when the record says copy (also after
:func:`materialise`, which rewrites it), else the shared copy with that hash (:func:`resolve`; the
record alone decides, so opening a store on object storage sends no HEAD or LIST for it). ``verify`` recomputes
the hash of whichever copy the store uses.

The cache also keeps a small index (``sources/<key>.json``, ours): the content hash and size of the
weights extracted from a model whose identity is ``key`` (:func:`store_model_weights`; the ingest's
key hashes the SHA-256 of the model's weights as loaded, its config, its architecture and the source
of the extraction code). A second store of the same model then neither extracts the weights again
nor hashes them: its record is written from the index, when the shared copy it names is there. A
changed model file changes the weights' SHA-256 and so the key: it is extracted and hashed again.

Part of the store core: imports nothing from ``ingest`` or ``query``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import platformdirs
import zarr
from filelock import FileLock

from actstore.core.arrays import create_array
from actstore.core.errors import CorruptStoreError, WeightsUnavailableError
from actstore.core.layout import WEIGHTS_MODES
from actstore.core.lock import writer_lock
from actstore.core.manifest import checksum_ok, parse_json_object, seal
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation

RECORD = "weights.json"  # the store's record of its weights (hash, mode, cache)
WEIGHTS_DIR = "weights"  # the store's own copy
ENV_DIR = "ACTSTORE_WEIGHTS_DIR"
_RECORD_FORMAT = "actstore-weights"
_INDEX_FORMAT = "actstore-weights-source"
INDEX_DIR = "sources"  # the cache's index: a model's identity -> its weights' content hash
_MAX_RECORD = 1 << 16
log = logging.getLogger(__name__)


def cache_root() -> Path:
    """The shared weights cache of this user: ``$ACTSTORE_WEIGHTS_DIR`` or ``<user cache>/actstore/weights``."""
    env = os.environ.get(ENV_DIR, "")
    if env:
        return Path(env).expanduser().absolute()
    return Path(platformdirs.user_cache_dir("actstore")) / "weights"


@dataclass(frozen=True)
class WeightsRecord:
    """``weights.json``: what the store's weights are (``sha256``: :func:`content_hash`; ``nbytes``:
    their float32 bytes) and where the ingest put them (``mode``, ``cache``: the shared cache's folder)."""

    sha256: str
    mode: str
    nbytes: int
    cache: str = ""

    def to_json(self) -> bytes:
        d = {"format": _RECORD_FORMAT, "sha256": self.sha256, "mode": self.mode, "bytes": self.nbytes}
        return json.dumps(seal({**d, "cache": self.cache}), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> WeightsRecord:
        d = parse_json_object(data, where, "weights record")
        if d.get("format") != _RECORD_FORMAT or not checksum_ok(d, set()):
            raise CorruptStoreError(f"{where}: not a valid weights record (corrupt?)")
        digest, mode, nbytes, cache = d.get("sha256"), d.get("mode"), d.get("bytes"), d.get("cache", "")
        if not isinstance(digest, str) or len(digest) != 64 or mode not in WEIGHTS_MODES:
            raise CorruptStoreError(f"{where}: the weights record's sha256 or mode is malformed")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not isinstance(cache, str):
            raise CorruptStoreError(f"{where}: the weights record's bytes or cache is malformed")
        return cls(digest, mode, nbytes, cache)


def read_record(loc: StoreLocation) -> WeightsRecord | None:
    """The store's ``weights.json`` (None: a store written before the record, its weights in ``weights/``)."""
    try:
        data = loc.read_bytes(RECORD, _MAX_RECORD)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return WeightsRecord.from_json(data, f"{loc.url}/{RECORD}")


def _canonical_attrs(attrs: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(dict(attrs), sort_keys=True, default=float))


def _header(shapes: Mapping[str, tuple[int, ...]], attrs: Mapping[str, Any]) -> bytes:
    doc = {"attrs": _canonical_attrs(attrs), "arrays": {k: list(v) for k, v in sorted(shapes.items())}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _bytes_of(x: np.ndarray) -> memoryview:
    """The float32 little-endian C-order bytes of ``x`` (a view where it already is)."""
    return np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8).data


def content_hash(weights: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> str:
    """SHA-256 of the weights as stored (float32, C order, names sorted) and the group's attributes."""
    h = hashlib.sha256(_header({k: tuple(v.shape) for k, v in weights.items()}, attrs))
    for name in sorted(weights):
        h.update(_bytes_of(weights[name]))
    return h.hexdigest()


def group_hash(group: zarr.Group) -> str:
    """:func:`content_hash` of a stored weights group (read one chunk of rows at a time)."""
    arrays = dict(sorted(group.arrays()))
    h = hashlib.sha256(_header({k: tuple(a.shape) for k, a in arrays.items()}, group.attrs.asdict()))
    for arr in arrays.values():
        step = max(1, int(arr.chunks[0]))
        for lo in range(0, max(1, int(arr.shape[0])), step):
            h.update(_bytes_of(np.asarray(arr[lo : lo + step] if arr.ndim else arr[...])))
    return h.hexdigest()


def weight_chunk(name: str, value: np.ndarray, n_layers: int) -> int:
    """Rows per chunk of a stored weight: one layer for the weights indexed by layer first (a read of
    a few layers reads their chunks only), the whole array for the others (embeddings, final norm)."""
    if name not in ("embed", "unembed") and value.ndim >= 1 and value.shape[0] == n_layers:
        return 1
    return max(1, value.shape[0]) if value.ndim else 1


def write_group(
    loc: StoreLocation, rel: str, weights: Mapping[str, np.ndarray], attrs: Mapping[str, Any], n_layers: int
) -> None:
    """Write ``weights`` as the zarr group ``rel`` of ``loc`` (float32, checksummed, uncompressed)."""
    with loc.zarr_group_writer(rel) as group:
        group.attrs.update(dict(attrs))
        for name, value in weights.items():
            create_array(
                group,
                name,
                np.ascontiguousarray(value, dtype=np.float32),
                weight_chunk(name, value, n_layers),
                logical_dtype="float32",
                compress=False,
            )


def share(weights: Mapping[str, np.ndarray], attrs: Mapping[str, Any], n_layers: int, digest: str) -> Path:
    """The shared copy of ``weights`` (hash ``digest``), written now unless the cache has it: under the
    cache's file lock, into a temporary folder renamed into place. Returns its folder."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / digest
    with FileLock(str(root / f"{digest}.lock")):
        if (final / "zarr.json").is_file():
            return final
        tmp = root / f".tmp-{digest[:16]}-{uuid.uuid4().hex}"
        try:
            write_group(locate(str(tmp)), "", weights, attrs, n_layers)
            if final.exists():  # the remains of a copy someone emptied: replaced whole
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def shared_dirs(record: WeightsRecord) -> list[Path]:
    """Where a shared copy with the record's hash may be: this user's cache, then the cache the
    ingest wrote it to."""
    out = [cache_root() / record.sha256]
    if record.cache and (Path(record.cache) / record.sha256) not in out:
        out.append(Path(record.cache) / record.sha256)
    return out


@dataclass(frozen=True)
class WeightsSource:
    """Where a store's weights are read from: ``location``'s zarr group at ``rel`` (``kind``: store or
    shared; ``where``: for messages)."""

    location: StoreLocation
    rel: str
    kind: str
    where: str


def resolve(loc: StoreLocation, record: WeightsRecord | None) -> WeightsSource | None:
    """The copy a store's readers use, from its record alone (no listing or HEAD request on object
    storage): its own ``weights/`` for a copy (or a store written before records), the shared copy
    with the record's hash for shared; None for none, or when no shared copy is found."""
    if record is None or record.mode == "copy":
        return WeightsSource(loc, WEIGHTS_DIR, "store", f"{loc.url}/{WEIGHTS_DIR}")
    if record.mode == "none":
        return None
    for folder in shared_dirs(record):
        if (folder / "zarr.json").is_file():
            return WeightsSource(locate(str(folder)), "", "shared", str(folder))
    return None


def missing_message(url: str, record: WeightsRecord | None) -> str:
    """The one line an analysis that needs weights refuses with, saying what to do."""
    if record is not None and record.mode == "none":
        return (
            f"{url} was ingested with --weights none: this analysis needs the model's weights "
            "(ingest again with --weights shared or copy)"
        )
    digest = record.sha256[:16] if record is not None else "?"
    return (
        f"{url}: the model's weights (sha256 {digest}...) are neither in the store nor in the shared "
        f"cache {cache_root()} (set {ENV_DIR}, run 'actstore weights materialise' where the cache has "
        "them, or ingest again with --weights copy)"
    )


def store_weights(
    loc: StoreLocation,
    weights: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    n_layers: int,
    mode: str,
) -> WeightsRecord:
    """Put a new store's weights where ``mode`` says (a remote store: always a copy, unless none) and
    write its ``weights.json``; called before the manifest is written."""
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"weights mode must be one of {', '.join(WEIGHTS_MODES)}, not {mode!r}")
    if mode == "shared" and not loc.paths_open_directly():
        log.info(
            "%s: a remote store gets its own copy of the weights (shared applies to local stores)", loc.url
        )
        mode = "copy"
    digest = content_hash(weights, attrs)
    nbytes = sum(int(np.asarray(v).size) * 4 for v in weights.values())
    cache = ""
    if mode == "copy":
        write_group(loc, WEIGHTS_DIR, weights, attrs, n_layers)
    elif mode == "shared":
        cache = str(share(weights, attrs, n_layers, digest).parent)
    record = WeightsRecord(digest, mode, nbytes, cache)
    loc.write_bytes_atomic(RECORD, record.to_json())
    return record


def materialise(loc: StoreLocation) -> str:
    """Copy the shared weights a store refers to into the store (``weights/``), checked against the
    record's hash first, so that the store is self-contained when copied; under the store's writer
    lock. Returns what was done, in one line."""
    with writer_lock(loc, command="actstore weights materialise"):
        record = read_record(loc)
        src = resolve(loc, record)
        if src is not None and src.kind == "store":
            return f"{loc.url}: the weights are in the store already"
        if src is None or record is None:
            raise WeightsUnavailableError(missing_message(loc.url, record))
        group = zarr.open_group(store=src.location.zarr_store("", read_only=True), mode="r")
        got = group_hash(group)
        if got != record.sha256:
            raise CorruptStoreError(
                f"{src.where}: the shared weights' sha256 {got[:16]}... is not the store's "
                f"{record.sha256[:16]}... (corrupt: delete that folder and ingest again)"
            )
        tmp = f".tmp-{WEIGHTS_DIR}-{uuid.uuid4().hex}"
        loc.remove_tree(WEIGHTS_DIR)  # the remains of a materialise killed before its record was rewritten
        for rel in src.location.walk_files(""):  # every file of the group, then one rename into place
            loc.write_bytes_atomic(f"{tmp}/{rel}", src.location.read_bytes(rel))
        if loc.paths_open_directly():
            os.rename(loc.path(tmp), loc.path(WEIGHTS_DIR))
        else:  # object storage: no rename (the group's zarr.json last: readers see all or nothing)
            for rel in sorted(loc.walk_files(tmp), key=lambda r: r == "zarr.json"):
                loc.write_bytes_atomic(f"{WEIGHTS_DIR}/{rel}", loc.read_bytes(f"{tmp}/{rel}"))
            loc.remove_tree(tmp)
        loc.write_bytes_atomic(RECORD, WeightsRecord(record.sha256, "copy", record.nbytes).to_json())
        return (
            f"{loc.url}: copied the weights ({record.nbytes / 2**20:.1f} MiB) from {src.where} into the store"
        )


Extracted = tuple[Mapping[str, np.ndarray], Mapping[str, Any]]


def source_key(*parts: str) -> str:
    """The index key of a model (ours): SHA-256 of ``parts`` (each its length, then its UTF-8 bytes)."""
    h = hashlib.sha256()
    for part in parts:
        b = part.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def _index_path(key: str) -> Path:
    return cache_root() / INDEX_DIR / f"{key}.json"


def indexed(key: str) -> WeightsRecord | None:
    """The index's shared record for the model ``key`` (None: no entry, an unreadable or corrupt one, or
    one whose shared copy is gone: the weights are then extracted and hashed again)."""
    try:
        data = _index_path(key).read_bytes()[:_MAX_RECORD]
        d = json.loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("format") != _INDEX_FORMAT or not checksum_ok(d, set()):
        return None
    digest, nbytes = d.get("sha256"), d.get("bytes")
    if not isinstance(digest, str) or len(digest) != 64 or not isinstance(nbytes, int):
        return None
    if not (cache_root() / digest / "zarr.json").is_file():
        return None
    return WeightsRecord(digest, "shared", nbytes, str(cache_root()))


def remember(key: str, record: WeightsRecord) -> None:
    """Write the index entry of ``key`` (written to a temporary file renamed into place: a reader sees
    the whole entry or none; two writers of one key write the same bytes)."""
    path = _index_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = seal({"format": _INDEX_FORMAT, "sha256": record.sha256, "bytes": record.nbytes})
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex}")
    try:
        tmp.write_bytes(json.dumps(doc, sort_keys=True).encode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def store_model_weights(
    loc: StoreLocation, extract: Callable[[], Extracted], key: str, n_layers: int, mode: str
) -> WeightsRecord:
    """:func:`store_weights` of the weights ``extract()`` gives, skipped when the index knows ``key`` (a
    local store, shared or none, whose shared copy is in the cache): the record is then written from
    the index, and ``extract`` is not called. After a shared store the index learns ``key``; ``copy``
    and ``none`` leave the cache untouched."""
    local = loc.paths_open_directly()
    if key and mode in ("shared", "none") and (local or mode == "none"):
        known = indexed(key)
        if known is not None:
            record = known if mode == "shared" else WeightsRecord(known.sha256, "none", known.nbytes)
            loc.write_bytes_atomic(RECORD, record.to_json())
            return record
    weights, attrs = extract()
    record = store_weights(loc, weights, attrs, n_layers, mode)
    if key and record.mode == "shared":
        remember(key, record)
    return record
