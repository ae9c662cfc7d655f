"""A JSON-lines corpus read a slice at a time: the ingest's records without holding them.

:class:`JsonlLines` is a ``Sequence[PromptRecord]`` over a ``.jsonl`` file.  Opening it reads the
file once in blocks of :data:`BLOCK` bytes: numpy finds the newlines and the lines that hold
something other than whitespace, and SHA-256 digests the bytes (the corpus fingerprint the
manifest records, so that ``--resume`` refuses a different file).  What it keeps is 16 bytes per
record (start offset, length and line number), about 16 MB for 10^6 prompts, instead of the parsed
records (about 3 KB a prompt).  A slice (one segment) is read with one contiguous read and parsed
and validated when asked for, with the same rules and messages as :func:`.jsonl.load_jsonl`
("FILE, line N: ..."); a bad line is found when its segment comes, not before the first batch.

Cost: opening is one sequential read of the file (disk or page-cache rate, about 0.1 s per 10^6
short prompts when cached, measured in benchmarks/bench_scale.py); a slice costs its own bytes.
The ingest job uses it for ``jsonl:FILE.jsonl`` without relation filters or limits
(:func:`stream_dataset`); other data sets (and filtered JSONL) are loaded whole, since a filter
or a per-relation limit needs every record.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import DatasetResult, SliceReader, existing, parse_spec
from actstore.ingest.datasets.jsonl import (
    MAX_JSONL_BYTES,
    MAX_JSONL_LINE,
    _jsonl_record,
    _open_regular,
    _parse_json_value,
)
from actstore.ingest.records import PromptRecord

BLOCK = 16 << 20  # bytes read (and scanned) at a time while indexing

# Bytes that Python's str.strip() removes when they stand alone (ASCII whitespace and the
# separators \x1c-\x1f); a line of only these is blank, as load_jsonl skips it.
_BLANK = np.zeros(256, dtype=bool)
_BLANK[list(b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f")] = True
_SUSPECT = _BLANK | (np.arange(256) >= 0x80)  # a line starting so may be blank (Unicode spaces too)


class JsonlLines(SliceReader[PromptRecord]):
    """The non-blank lines of ``path`` as records, parsed on demand (see the module notes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.starts, self.lengths, self.numbers, self.fingerprint = _index_lines(self.path)

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def _read(self, lo: int, hi: int) -> list[PromptRecord]:
        if hi <= lo:
            return []
        first = int(self.starts[lo])
        size = int(self.starts[hi - 1] + self.lengths[hi - 1]) - first
        with _open_regular(self.path) as f:
            f.seek(first)
            buf = f.read(size)
        if len(buf) != size:
            raise DatasetError(f"{self.path}: the file changed while it was read (shorter than indexed)")
        out = []
        for k in range(lo, hi):
            a = int(self.starts[k]) - first
            where = f"{self.path}, line {int(self.numbers[k])}"
            try:
                line = buf[a : a + int(self.lengths[k])].decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 text ({e.reason})") from None
            out.append(_jsonl_record(_parse_json_value(line, where), where))
        return out


def _index_lines(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """Start offsets (int64), lengths and 1-based line numbers (int32) of the non-blank lines of
    ``path``, and the SHA-256 of its bytes; a line over :data:`MAX_JSONL_LINE` bytes is an error."""
    digest = hashlib.sha256()
    starts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    numbers: list[np.ndarray] = []
    offset = 0  # file offset of buf[0]
    lines_before = 0  # lines that end before buf
    carry = b""
    total = 0
    with _open_regular(path) as f:
        while True:
            block = f.read(BLOCK)
            total += len(block)
            if total > MAX_JSONL_BYTES:
                raise DatasetError(f"{path}: more than {MAX_JSONL_BYTES >> 30} GiB")
            digest.update(block)
            buf = carry + block if carry else block
            if not buf:
                break
            arr = np.frombuffer(buf, dtype=np.uint8)
            ends = np.flatnonzero(arr == 10) + 1
            if not block and (ends.size == 0 or ends[-1] != len(buf)):  # a last line without "\n"
                ends = np.append(ends, len(buf))
            if ends.size == 0:
                if len(buf) > MAX_JSONL_LINE:
                    raise DatasetError(
                        f"{path}, line {lines_before + 1}: longer than {MAX_JSONL_LINE >> 20} MiB"
                    )
                carry = buf
                continue
            begins = np.concatenate([[0], ends[:-1]])
            lens = ends - begins
            long = np.flatnonzero(lens > MAX_JSONL_LINE)
            if long.size:
                raise DatasetError(
                    f"{path}, line {lines_before + int(long[0]) + 1}: longer than {MAX_JSONL_LINE >> 20} MiB"
                )
            # A line whose first byte is ASCII and not blank holds something (every JSON object line);
            # the others (empty, indented, whitespace only, non-ASCII first: few) are looked at one by one.
            content = ~_SUSPECT[arr[begins]]
            for k in np.flatnonzero(~content):
                raw = buf[int(begins[k]) : int(ends[k])]
                if raw.strip(b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"):
                    content[k] = bool(raw.decode("utf-8", "replace").strip())  # Unicode spaces too
            keep = np.flatnonzero(content)
            starts.append(offset + begins[keep])
            lengths.append(lens[keep].astype(np.int32))
            numbers.append((lines_before + keep + 1).astype(np.int32))
            lines_before += int(ends.size)
            offset += int(ends[-1])
            carry = buf[int(ends[-1]) :]
            if not block:
                break
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32), digest.hexdigest()
    return (
        np.concatenate(starts).astype(np.int64),
        np.concatenate(lengths),
        np.concatenate(numbers),
        digest.hexdigest(),
    )


def stream_dataset(spec: str, options: Mapping[str, Any]) -> DatasetResult | None:
    """``spec`` as a streamed :class:`JsonlLines` when it is ``jsonl:FILE.jsonl`` with no option set
    (a relation filter or a per-relation limit needs every record); None otherwise (load it whole)."""
    kind, location = parse_spec(spec)
    if kind != "jsonl" or not location or any(v is not None and v is not False for v in options.values()):
        return None
    path = existing(location, "jsonl")
    if path.is_dir() or path.suffix in (".json", ".parquet") or not os.path.isfile(path):
        return None
    return DatasetResult(JsonlLines(path))
