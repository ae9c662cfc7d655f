"""The manifest: what a store is (format, model, geometry, settings) and which segments are committed.

A store is split into *segments* of ``segment_size`` consecutive examples.  A segment's
arrays and table shards are written first; its commit marker ``commits/NNNNNN.json`` is
written last and atomically.  Readers only see segments whose marker exists, so a killed
writer leaves at most an uncommitted segment that a resume rewrites from scratch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from actstore.errors import CorruptStoreError, FormatVersionError

FORMAT_NAME = "actstore"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
CHECKSUM_KEY = "checksum"  # SHA-256 of the rest of the JSON object, so a flipped byte is caught


def _digest(d: dict[str, Any]) -> str:
    body = {k: v for k, v in d.items() if k != CHECKSUM_KEY}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its checksum added (manifests and commit markers are written sealed)."""
    return {**d, CHECKSUM_KEY: _digest(d)}


def checksum_ok(d: dict[str, Any], known: set[str]) -> bool:
    """True when ``d``'s checksum matches; files from before checksums pass if every key is known
    (a flipped byte in the key name itself leaves an unknown key)."""
    if CHECKSUM_KEY in d:
        return d[CHECKSUM_KEY] == _digest(d)
    return set(d) <= known


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
    def from_dict(cls, d: dict[str, Any]) -> Geometry:
        return cls(**{f.name: int(d[f.name]) for f in fields(cls)})


@dataclass(frozen=True)
class SegmentCommit:
    """The commit marker of one segment: its row range and the sizes of its ragged axes."""

    segment: int
    row_start: int
    n_rows: int
    n_sources: int
    n_tokens: int
    table_sha256: dict[str, str]

    def to_json(self) -> bytes:
        return json.dumps(seal(asdict(self)), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> SegmentCommit:
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or not checksum_ok(d, {f.name for f in fields(cls)}):
                raise CorruptStoreError(f"{where}: commit marker fails its checksum (the file is corrupt)")
            return cls(
                segment=int(d["segment"]),
                row_start=int(d["row_start"]),
                n_rows=int(d["n_rows"]),
                n_sources=int(d["n_sources"]),
                n_tokens=int(d["n_tokens"]),
                table_sha256={str(k): str(v) for k, v in d["table_sha256"].items()},
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptStoreError(f"{where}: unreadable commit marker ({e})") from None


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
    format_version: int = FORMAT_VERSION

    @property
    def n_segments(self) -> int:
        return (self.n_examples + self.segment_size - 1) // self.segment_size

    def to_json(self) -> bytes:
        d = asdict(self)
        d["format"] = FORMAT_NAME
        return json.dumps(seal(d), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            d = json.loads(data)
        except ValueError as e:
            raise CorruptStoreError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CorruptStoreError(f"{where}: not an actstore manifest")
        version = d.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: store format version {version} is newer than this actstore reads "
                f"({FORMAT_VERSION}); upgrade actstore"
            )
        if not checksum_ok(d, {f.name for f in fields(cls)} | {"format"}):
            raise CorruptStoreError(f"{where}: manifest.json fails its checksum (the file is corrupt)")
        try:
            return cls(
                geometry=Geometry.from_dict(d["geometry"]),
                model=dict(d["model"]),
                storage_dtype=str(d["storage_dtype"]),
                segment_size=int(d["segment_size"]),
                n_examples=int(d["n_examples"]),
                chunk_rows=int(d["chunk_rows"]),
                chunk_flat=int(d["chunk_flat"]),
                ingest=dict(d.get("ingest", {})),
                architecture=dict(d.get("architecture", {})),
                code_version=str(d.get("code_version", "")),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptStoreError(f"{where}: manifest is missing or has a bad field ({e})") from None
