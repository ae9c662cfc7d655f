"""Zarr v3 array conventions: dtypes, codecs, chunking, and chunk-coalesced reads.

Every array is compressed (Blosc/LZ4 with byte shuffle) and ends in a CRC32C codec, so a
flipped byte in any chunk fails decoding instead of returning wrong numbers.  LZ4 rather than
zstd: float16 activations barely compress (Blosc/zstd level 3 saves 6%), and LZ4 encodes about
9x and decodes about 10x faster (benchmarks/bench_codecs.py; see benchmarks/README.md), which
is what a GPU ingest's host side and every query pay for.  Stores written with zstd read as before.  bfloat16 has no
numpy dtype; it is stored as its raw uint16 bits and widened to float32 on read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

from actstore.errors import CorruptStoreError

NUMPY_DTYPE = {"float32": np.dtype("float32"), "float16": np.dtype("float16"), "bfloat16": np.dtype("uint16")}


def compressors() -> list[Any]:
    return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec()]


def create_array(group: zarr.Group, name: str, data: np.ndarray, chunk0: int, *, logical_dtype: str,
                 compress: bool = True) -> None:
    """Write ``data`` as a new array chunked only along axis 0 (``chunk0`` rows per chunk).

    ``compress=False`` keeps only the checksum: float32 weights barely compress (about 5%)
    and zstd on them would cost seconds at every store creation.
    """
    chunks = (max(1, min(chunk0, max(1, data.shape[0]))), *data.shape[1:])
    arr = group.create_array(
        name,
        shape=data.shape,
        chunks=chunks,
        dtype=data.dtype,
        serializer=BytesCodec(),
        compressors=compressors() if compress else [Crc32cCodec()],
        fill_value=0,
        overwrite=True,
        attributes={"logical_dtype": logical_dtype},
    )
    if data.size:
        arr[...] = data


def widen(data: np.ndarray, logical_dtype: str) -> np.ndarray:
    """Stored values as float32 (bfloat16 bits are shifted into the high half of a float32)."""
    if logical_dtype == "bfloat16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32, copy=False)


def runs(sorted_chunks: np.ndarray) -> list[tuple[int, int]]:
    """Group sorted, unique chunk indices into half-open runs of consecutive chunks."""
    out: list[tuple[int, int]] = []
    for c in sorted_chunks.tolist():
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1)
        else:
            out.append((c, c + 1))
    return out


def read_rows(arr: zarr.Array, rows: np.ndarray, where: str) -> np.ndarray:
    """``arr[rows]`` for sorted row indices, reading each touched run of whole chunks once."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.zeros((0, *arr.shape[1:]), dtype=arr.dtype)
    chunk = int(arr.chunks[0])
    touched = np.unique(rows // chunk)
    parts: list[np.ndarray] = []
    for c0, c1 in runs(touched):
        lo, hi = c0 * chunk, min(c1 * chunk, int(arr.shape[0]))
        block = _read(arr, slice(lo, hi), where)
        sel = rows[(rows >= lo) & (rows < hi)] - lo
        parts.append(block[sel])
    return np.concatenate(parts, axis=0)


def read_ranges(arr: zarr.Array, starts: Sequence[int], lengths: Sequence[int], where: str) -> np.ndarray:
    """Concatenation of ``arr[s:s+n]`` for each range, reading each touched run of chunks once."""
    idx = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths)]) if len(
        starts
    ) else np.zeros(0, dtype=np.int64)
    order = np.argsort(idx, kind="stable")
    got = read_rows(arr, idx[order], where)
    out = np.empty_like(got)
    out[order] = got
    return out


def _read(arr: zarr.Array, sl: slice, where: str) -> np.ndarray:
    try:
        return np.asarray(arr[sl])
    except Exception as e:  # zarr raises codec-specific errors on checksum mismatch
        raise CorruptStoreError(
            f"{where}: chunk read failed for rows {sl.start}:{sl.stop} ({type(e).__name__}: {e})"
        ) from None
