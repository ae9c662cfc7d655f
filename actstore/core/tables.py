"""Schemas of the store's Parquet tables and their (de)serialisation.

``examples``, ``tokens`` and ``targets`` are written one shard per segment and become
visible when the segment commits; their SHA-256 is in the commit marker.  Other tables
(``heads``, ``runs`` and analysis results) are written whole, one file per run, each file
atomically and preceded by a companion ``<file>.parquet.sha256`` holding its SHA-256 (hex),
so that every table file of a store has a hash to check it against.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

SEGMENT_TABLES = ("examples", "tokens", "targets")
# A corpus store (``ingest.positions == "all"`` in its manifest) has a fourth segment table,
# ``positions``: one row per stored row (a token position of a document).  Every shard-level rule
# of the three (written per segment, hashed in the marker, compacted into the snapshot) holds for it.
POSITIONS_TABLE = "positions"
ALL_SEGMENT_TABLES = (*SEGMENT_TABLES, POSITIONS_TABLE)


def table_kind(name: str) -> str:
    """What a store's table is, in the summaries (report and explorer): ``corpus`` (written by the
    ingest), ``run log`` (``runs``) or ``result`` (an analysis's)."""
    if name in ALL_SEGMENT_TABLES or name == "heads":
        return "corpus"
    return "run log" if name == "runs" else "result"


HASH_SUFFIX = ".sha256"  # the companion of a non-segment table file: tables/<name>/<file>.parquet.sha256
MAX_TABLE_BYTES = 8 << 30  # a table file larger than this is refused unread

EXAMPLES = pa.schema(
    [
        ("example_id", pa.int64()),
        ("text", pa.string()),
        ("relation_id", pa.string()),
        ("relation_name", pa.string()),
        ("subject", pa.string()),
        ("object", pa.string()),
        ("split", pa.string()),
        ("source", pa.string()),
        ("subject_start", pa.int32()),  # token span of the subject, -1 when absent
        ("subject_end", pa.int32()),
        ("object_start", pa.int32()),
        ("object_end", pa.int32()),
        ("n_tokens", pa.int32()),  # tokens stored for this example (positions 0 .. n_tokens-1)
        ("segment", pa.int32()),
        ("tok_start", pa.int64()),  # offset of position 0 in the segment's flat token axis (array v)
        ("meta", pa.string()),  # JSON object with the dataset's extra fields
    ]
)

TOKENS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("position", pa.int32()),
        ("token_id", pa.int32()),
        ("token", pa.string()),
        ("role", pa.string()),  # subject | object | other
        ("char_start", pa.int32()),
        ("char_end", pa.int32()),
    ]
)

TARGETS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("position", pa.int32()),  # token position of the target
        ("row", pa.int64()),  # global row in the per-target arrays
        ("segment", pa.int32()),
        ("seg_row", pa.int32()),  # row within the segment's arrays
        ("src_start", pa.int64()),  # offset in the segment's flat source axis (array attn)
        ("n_src", pa.int32()),  # sources = positions 0 .. position
        ("top_token_id", pa.int32()),  # greedy next token at the target
        ("top_token", pa.string()),
        ("object_token_id", pa.int32()),  # first token of " " + object, -1 without an object
        ("object_logprob", pa.float32()),
        ("object_rank", pa.int32()),  # 0 = the model's top prediction
    ]
)

POSITIONS = pa.schema(
    [
        ("example_id", pa.int64()),  # in a corpus store every row is an example of its own
        ("row", pa.int64()),  # global row of the per-row arrays (equal to example_id)
        ("document", pa.int64()),  # document number in the corpus (0-based, in corpus order)
        ("window_index", pa.int32()),  # which context window of the document (0-based; packed: of the stream)
        ("position", pa.int32()),  # token position in the document (0-based, special tokens counted)
        ("window_position", pa.int32()),  # position in the window the model saw
        ("token_id", pa.int32()),
        ("token", pa.string()),  # the token's text (its characters of the document, or its piece)
        ("char_start", pa.int32()),  # character span in the document, -1 for added special tokens
        ("char_end", pa.int32()),
    ]
)

HEADS = pa.schema([("layer", pa.int32()), ("head", pa.int32()), ("kv_head", pa.int32())])

SCHEMAS: dict[str, pa.Schema] = {
    "examples": EXAMPLES,
    "tokens": TOKENS,
    "targets": TARGETS,
    "positions": POSITIONS,
    "heads": HEADS,
}


def store_segment_tables(ingest: dict[str, object] | None) -> tuple[str, ...]:
    """The segment tables of a store whose manifest's ``ingest`` settings are ``ingest``."""
    return ALL_SEGMENT_TABLES if (ingest or {}).get("positions") == "all" else SEGMENT_TABLES


def to_parquet_bytes(table: pa.Table, row_group_size: int | None = None) -> bytes:
    """``table`` as zstd Parquet (``row_group_size`` rows a row group; pyarrow's default when None)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=row_group_size)
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def xxh3(data: bytes) -> str:
    """The XXH3-128 of ``data`` (hex): the hash a reader checks a snapshot's compacted files with on
    open (about 5x the rate of SHA-256; the snapshot keeps each file's SHA-256 too, which ``verify``
    checks).  It guards against damage (flipped bytes, truncation, a swapped file), not an adversary
    who writes the store: one who can write the files can write the snapshot."""
    return xxhash.xxh3_128_hexdigest(data)


#: The hashes a commit marker may list its segment's objects with (its ``object_hash``; format 4):
#: each one's name in messages and the hex digits of its digest.
OBJECT_HASHES = {"sha256": ("SHA-256", 64), "xxh3": ("XXH3-128", 32)}


def digest(data: Any, algorithm: str) -> str:
    """``data``'s hex digest by ``algorithm``, a key of :data:`OBJECT_HASHES`."""
    if algorithm == "xxh3":
        return xxhash.xxh3_128_hexdigest(data)
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown object hash {algorithm!r} (one of {', '.join(OBJECT_HASHES)})")


def needs_hash_file(rel: str) -> bool:
    """True for a non-segment table file (``tables/<name>/<file>.parquet``, name not a segment table),
    which is written with a ``.sha256`` companion."""
    parts = rel.split("/")
    return (
        len(parts) == 3
        and parts[0] == "tables"
        and parts[1] not in ALL_SEGMENT_TABLES
        and parts[2].endswith(".parquet")
    )


def rows_table(rows: Sequence[Sequence[Any]], schema: pa.Schema) -> pa.Table:
    """An Arrow table of ``rows``, tuples of values in the order of ``schema``'s columns."""
    columns = list(zip(*rows)) if rows else [()] * len(schema)
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, schema)], schema=schema)
