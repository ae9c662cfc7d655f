"""Zarr v3 array conventions: dtypes, codecs, chunking, and chunk-coalesced reads.

Every array is compressed (Blosc/LZ4 with byte shuffle) and ends in a CRC32C codec, so a
flipped byte in any chunk fails decoding instead of returning wrong numbers.  LZ4 rather than
zstd: float16 activations barely compress (Blosc/zstd level 3 saves 6%), and LZ4 encodes about
9x and decodes about 10x faster (benchmarks/bench_codecs.py; see benchmarks/README.md), which
is what a GPU ingest's host side and every query pay for.  Stores written with zstd read as before.  bfloat16 has no
numpy dtype; it is stored as its raw uint16 bits and widened to float32 on read.

Segment arrays are chunked along their rows; since format version 2 each chunk of rows is a shard
(zarr's sharding codec: one file, index at its end) of layer chunks, so a read of a few layers
fetches only their bytes (:func:`axis1_plan`) while a full scan still reads one file per chunk of
rows; every later axis is whole.

Every chunk is written, all-zero ones included (zarr skips those by default, and then a lost
chunk would be indistinguishable from one never written), except those of an array the manifest
says is all zeros (:func:`actstore.core.segments.unwritten_arrays`: no chunk of it is written).  Readers open arrays through
:class:`ChunkGuard`, which turns a missing chunk of a store that writes every chunk into an
error instead of zarr's silent fill value, and refuses special files (a named pipe as a chunk
would block the read forever).

Reads of a local store's chunks skip zarr's asynchronous dispatch when the array's codecs are
the ones this module writes (:func:`local_chunks`): each chunk file is read, its CRC32C checked
and its Blosc frame decoded in the calling thread (``google_crc32c`` and ``numcodecs``, the
libraries zarr's own codecs call).  A small read is then dominated by the bytes, not by
handing the read to zarr's event loop and waiting (about 1 ms per call, see benchmarks/README.md);
every other array (an object store, other codecs, a store that may lack chunks) reads through zarr.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import zarr
import zarr.storage
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from actstore.core.array_meta import ArrayMeta
from actstore.core.chunks import CHUNK_SEPARATORS, local_chunks, sharded_ok
from actstore.core.errors import CorruptStoreError, MissingChunkError
from actstore.core.shards import memory_dict, write_shards

NUMPY_DTYPE: dict[str, np.dtype] = {
    "float32": np.dtype("float32"),
    "float16": np.dtype("float16"),
    "bfloat16": np.dtype("uint16"),
}


def compressors() -> list[Any]:
    return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec()]


def create_array(
    group: zarr.Group,
    name: str,
    data: np.ndarray,
    chunk0: int,
    *,
    logical_dtype: str,
    compress: bool = True,
    chunk1: int = 0,
    zero_blocks: Collection[int] = (),
    chunks_written: bool = True,
    separator: str = "/",
    layers: Sequence[int] | None = None,
    n_layers: int = 0,
) -> None:
    """Write ``data`` as a new array chunked along axis 0 (``chunk0`` rows per chunk).

    With ``chunk1`` > 0 (fewer than axis 1's length), each chunk of rows is a shard holding inner
    chunks of ``chunk1`` positions of axis 1 (the layers of a segment array): one file per chunk of
    rows, as without, whose inner chunks are read alone (zarr's sharding codec, index at the end).
    ``compress=False`` keeps only the checksum: float32 weights barely compress (about 5%)
    and zstd on them would cost seconds at every store creation.  ``zero_blocks``: the axis-1 chunks
    the caller knows to be all zero (a corpus store's layers not kept), written without being read
    or compressed again (:func:`write_shards`).  ``chunks_written=False``: the metadata only (an array
    of zeros whose chunks the store does not write: :func:`actstore.core.segments.unwritten_arrays`).
    ``separator``: of zarr's default chunk keys: ``"/"`` (chunk ``i`` is the file ``c/i/0/..``, two
    folders of its own) or ``"."`` (the file ``c.i.0..`` beside ``zarr.json``: segments since
    2026-12-07, docs/format.md).  ``layers``: ``data`` holds only these positions of axis 1, in this
    order, of an array of ``n_layers`` there whose other positions are zeros (a corpus store's kept
    layers): the array written is the same, without the full array being made (where the shards are
    written here; zarr's own path is given it whole).
    """
    if separator not in CHUNK_SEPARATORS:
        raise ValueError(f"chunk key separator must be one of {CHUNK_SEPARATORS} (got {separator!r})")
    shape = tuple(int(n) for n in data.shape)
    if layers is not None:
        if data.ndim < 2 or len(layers) != data.shape[1] or not all(0 <= i < n_layers for i in layers):
            raise ValueError(f"layers {list(layers)} do not fit data {shape} of {n_layers} layers")
        shape = (shape[0], n_layers, *shape[2:])
    size = int(np.prod(shape))
    chunks: tuple[int, ...] = (max(1, min(chunk0, max(1, shape[0]))), *shape[1:])
    shards: tuple[int, ...] | None = None
    if chunk1 > 0 and len(shape) >= 2 and 0 < chunk1 < shape[1]:
        n1 = shape[1]
        shards = (chunks[0], -(-n1 // chunk1) * chunk1, *chunks[2:])
        chunks = (chunks[0], chunk1, *chunks[2:])
    spec = (
        shape,
        chunks,
        shards,
        data.dtype.str,
        compress,
        logical_dtype,
        separator,
    )
    held = memory_dict(group.store)
    if held is not None and (not size or not chunks_written or (shards is not None and compress)):
        # a group built in memory (a segment): the array's zarr.json as zarr writes it for these settings,
        # made once and put in the group's dict (zarr's create_array took 3-4 ms a call on the loaded machine)
        meta = _METADATA.get(spec)
        if meta is None:
            made: dict[str, Any] = {}
            scratch = zarr.open_group(store=zarr.storage.MemoryStore(made), mode="w")
            _create(scratch, "a", *spec)
            meta = _METADATA[spec] = made["a/zarr.json"].to_bytes()
        prefix = f"{group.path}/{name}" if group.path else name
        held[f"{prefix}/zarr.json"] = default_buffer_prototype().buffer.from_bytes(meta)
        if chunks_written and size:
            write_shards(group, name, data, chunks, zero_blocks, separator, layers, n_layers)
        return
    arr = _create(group, name, *spec)
    if not chunks_written:
        return
    if size and shards is not None and compress:
        write_shards(group, name, data, chunks, zero_blocks, separator, layers, n_layers)
    elif size:
        if layers is not None:
            whole = np.zeros(shape, dtype=data.dtype)
            whole[:, list(layers)] = data
            data = whole
        arr[...] = data


_METADATA: dict[tuple[Any, ...], bytes] = {}  # an array's zarr.json by its settings (create_array)


def _create(
    group: zarr.Group,
    name: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    shards: tuple[int, ...] | None,
    dtype: str,
    compress: bool,
    logical_dtype: str,
    separator: str,
) -> zarr.Array:
    return group.create_array(
        name,
        shape=shape,
        chunks=chunks,
        shards=shards,
        dtype=np.dtype(dtype),
        serializer=BytesCodec(),
        compressors=compressors() if compress else [Crc32cCodec()],
        fill_value=0,
        overwrite=True,
        attributes={"logical_dtype": logical_dtype},
        chunk_key_encoding={"name": "default", "separator": separator},
        config={"write_empty_chunks": True},  # a missing chunk is then always a lost one
    )


def widen(data: np.ndarray, logical_dtype: str) -> np.ndarray:
    """Stored values as float32 (bfloat16 bits are shifted into the high half of a float32)."""
    if logical_dtype == "bfloat16":
        return (data.astype(np.uint32, order="C") << 16).view(np.float32)
    if data.dtype == np.float32:
        return np.ascontiguousarray(data)
    out = np.empty(data.shape, dtype=np.float32)
    widen_into(out, data)
    return out


WIDEN_BLOCK = 1 << 15  # float16 values a torch copy converts at once (see widen_into)


def widen_into(out: np.ndarray, data: np.ndarray) -> None:
    """``out[...] = data`` (float32 from float16 or float32; ``data`` of ``out``'s shape, any strides).
    Float16 goes through torch's vectorised conversion, ``WIDEN_BLOCK`` values a copy: numpy 2.4
    converts one value at a time (6.4M values into the same array: 12.4 ms against 2.7 ms so), and a
    copy no larger than torch's parallel grain (32,768) runs on the calling thread alone (one copy of
    them all went to the intra-op pool, and on busy cores took 5x numpy's time).  The values are the
    same, float16 being exact in float32.  Read-only values (which torch would warn about), negative
    strides (which it cannot view) and small reads go by numpy."""
    if (
        data.dtype != np.float16
        or data.ndim == 0
        or data.size < WIDEN_BLOCK
        or not data.flags.writeable
        or min(data.strides) < 0
    ):
        out[...] = data
        return
    import torch  # (only where torch is loaded anyway: a read of float16 values)

    src, dst = torch.from_numpy(data), torch.from_numpy(out)
    step = max(1, WIDEN_BLOCK // max(1, data.size // data.shape[0]))  # rows a copy
    for i in range(0, data.shape[0], step):
        dst[i : i + step].copy_(src[i : i + step])


def runs(sorted_chunks: np.ndarray) -> list[tuple[int, int]]:
    """Group sorted, unique chunk indices into half-open runs of consecutive chunks."""
    out: list[tuple[int, int]] = []
    for c in sorted_chunks.tolist():
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1)
        else:
            out.append((c, c + 1))
    return out


def take1(x: np.ndarray, idx: Sequence[int] | None) -> np.ndarray:
    """``x[:, idx]`` (all of axis 1 when None); a contiguous ascending ``idx`` is a slice (a view)."""
    if idx is None:
        return x
    idx = list(idx)
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return x[:, idx[0] : idx[0] + len(idx)]
    return x[:, idx]


def axis1_plan(
    shape: Sequence[int], chunks: Sequence[int], axis1: Sequence[int] | None
) -> tuple[list[int] | None, list[int] | None]:
    """Which axis-1 chunks a read of ``axis1`` fetches, and where ``axis1``'s positions then lie.

    Returns ``(blocks, positions)``: ``blocks`` the sorted axis-1 chunk indices to read (None: the
    whole axis, as one block or all of them), ``positions`` the indices of ``axis1`` in the
    concatenation of those blocks along axis 1 (None: all of it).  An array not chunked along axis 1
    reads it whole and keeps ``axis1`` as given."""
    if axis1 is None or len(shape) < 2:
        return None, None if axis1 is None else list(axis1)
    k1, n1 = int(chunks[1]), int(shape[1])
    ax = [int(a) + n1 if -n1 <= int(a) < 0 else int(a) for a in axis1]
    bad = [a for a in ax if not 0 <= a < n1]
    if bad:
        raise IndexError(f"index {bad[0]} is out of bounds for axis 1 with size {n1}")
    if k1 >= n1:
        return None, ax
    blocks = sorted({a // k1 for a in ax})
    offset: dict[int, int] = {}
    total = 0
    for blk in blocks:
        offset[blk] = total
        total += min(k1, n1 - blk * k1)
    return blocks, [offset[a // k1] + a % k1 for a in ax]


def read_rows(
    arr: zarr.Array,
    rows: np.ndarray,
    where: str,
    logical_dtype: str | None = None,
    axis1: Sequence[int] | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``arr[rows][:, axis1]`` for sorted row indices, reading each touched run of whole chunks once.

    With ``logical_dtype``, the rows come back widened to float32 (:func:`widen`), converted while
    they are copied out of the decoded chunks (no second copy); a run of consecutive rows is taken
    as a slice of its chunks, not gathered.  ``axis1`` (e.g. layers) is applied before widening, so
    only the kept part of each row is converted; an array chunked along axis 1 as well (layer
    chunks) fetches only the axis-1 chunks that ``axis1`` touches.  ``out``: a C-contiguous array of
    the result's shape and dtype, written (no array of the result made and copied) and returned."""
    rows = np.asarray(rows, dtype=np.int64)
    dtype = np.dtype(np.float32) if logical_dtype is not None else arr.dtype
    tail = (len(axis1) if axis1 is not None else int(arr.shape[1]), *arr.shape[2:]) if arr.ndim > 1 else ()
    if axis1 is not None and arr.ndim < 2:
        raise ValueError("axis1 needs an array of at least 2 dimensions")
    if out is not None and (
        out.shape != (rows.size, *tail) or out.dtype != dtype or not out.flags.c_contiguous
    ):
        raise ValueError(
            f"read_rows: out is {out.dtype} {out.shape}, expected C-contiguous {dtype} {(rows.size, *tail)}"
        )
    if rows.size == 0:
        return np.zeros((0, *tail), dtype=dtype) if out is None else out
    blocks, positions = axis1_plan(arr.shape, arr.chunks, axis1)
    chunk = int(arr.chunks[0])
    c = rows // chunk
    if c.size > 1 and bool((c[1:] >= c[:-1]).all()):  # sorted (as asked): no sort (np.unique's)
        touched = c[np.flatnonzero(np.r_[True, c[1:] != c[:-1]])]
    else:
        touched = np.unique(c)
    spans = runs(touched)
    i = 0
    for c0, c1 in spans:
        lo, hi = c0 * chunk, min(c1 * chunk, int(arr.shape[0]))
        block = _read(arr, slice(lo, hi), where, blocks)
        sel = rows[(rows >= lo) & (rows < hi)] - lo
        consecutive = sel[-1] - sel[0] + 1 == sel.size and bool(np.all(sel[1:] != sel[:-1]))
        kept = take1(block, positions)  # a view: the rows are gathered (and widened) from the kept part only
        piece = kept[sel[0] : sel[-1] + 1] if consecutive else kept[sel]
        if len(spans) == 1 and out is None:
            return widen(piece, logical_dtype) if logical_dtype is not None else np.ascontiguousarray(piece)
        if out is None:
            out = np.empty((rows.size, *tail), dtype=dtype)
        if logical_dtype == "bfloat16":
            out[i : i + sel.size] = widen(piece, logical_dtype)
        else:
            widen_into(out[i : i + sel.size], piece)  # float16 -> float32 (or as stored) while copying
        i += sel.size
    assert out is not None
    return out


def read_ranges(
    arr: zarr.Array,
    starts: Sequence[int],
    lengths: Sequence[int],
    where: str,
    logical_dtype: str | None = None,
    axis1: Sequence[int] | None = None,
) -> np.ndarray:
    """Concatenation of ``arr[s:s+n]`` for each range, reading each touched run of chunks once
    (widened to float32 with ``logical_dtype``, restricted to ``axis1``, as :func:`read_rows`)."""
    idx = (
        np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths)])
        if len(starts)
        else np.zeros(0, dtype=np.int64)
    )
    if idx.size < 2 or bool(np.all(idx[1:] > idx[:-1])):  # ascending, no repeats (rows in store order)
        return read_rows(arr, idx, where, logical_dtype, axis1)
    order = np.argsort(idx, kind="stable")
    got = read_rows(arr, idx[order], where, logical_dtype, axis1)
    out = np.empty_like(got)
    out[order] = got
    return out


def _read(arr: zarr.Array, sl: slice, where: str, blocks: Sequence[int] | None = None) -> np.ndarray:
    """Rows ``sl`` of ``arr`` (whole chunks), with only the axis-1 chunks ``blocks`` concatenated (None: all)."""
    try:
        direct = local_chunks(arr)
        if direct is not None and sl.step is None:
            n = int(arr.chunks[0])
            lo, hi = int(sl.start or 0), min(int(sl.stop), int(arr.shape[0]))
            if lo % n == 0 and hi > lo:
                return direct.read(lo // n, -(-hi // n), blocks)[: hi - lo]
        if blocks is None:
            return np.asarray(arr[sl])
        k1, n1 = int(arr.chunks[1]), int(arr.shape[1])
        parts = [np.asarray(arr[sl, b0 * k1 : min(b1 * k1, n1)]) for b0, b1 in runs(np.asarray(blocks))]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    except MissingChunkError as e:
        _settle_zarr_reads()
        raise CorruptStoreError(f"{where}: chunk read failed for rows {sl.start}:{sl.stop} ({e})") from None
    except Exception as e:  # zarr raises codec-specific errors on checksum mismatch
        _settle_zarr_reads()
        raise CorruptStoreError(
            f"{where}: chunk read failed for rows {sl.start}:{sl.stop} ({type(e).__name__}: {e})"
        ) from None


def _settle_zarr_reads() -> None:
    """Wait for the other chunk reads of a failed zarr read (zarr runs them as tasks on its own
    event loop and leaves them running when one fails).  Left pending, they are destroyed at
    interpreter exit and print pages of asyncio tracebacks after the one error line."""

    async def settle() -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if others:
            await asyncio.gather(*others, return_exceptions=True)

    try:
        sync(settle())
    except Exception:  # best effort: never hide the read error behind a second one
        pass


def check_array(
    arr: zarr.Array | ArrayMeta,
    where: str,
    shape: tuple[int, ...] | None,
    dtype: np.dtype | None,
    max_chunk_bytes: int | None = None,
    max_chunks: int = 1 << 20,
) -> None:
    """Refuse (:class:`CorruptStoreError`) an array whose metadata disagrees with what the store's manifest
    and commit markers say: its ``shape`` and ``dtype``, chunking along axis 0 only (or shards of
    rows x layer chunks, :func:`sharded_ok`), at most ``max_chunks`` chunks (inner chunks of shards
    included) and ``max_chunk_bytes`` per chunk (per shard).  Run before any read, so a made-up shape
    in a ``zarr.json`` can neither allocate its size nor make a loop over its chunks endless."""
    got = tuple(int(n) for n in arr.shape)
    if shape is not None and got != tuple(shape):
        raise CorruptStoreError(f"{where}: shape {got} but the store says {tuple(shape)}")
    if dtype is not None and arr.dtype != dtype:
        raise CorruptStoreError(f"{where}: dtype {arr.dtype} but the store says {dtype}")
    chunks = tuple(int(n) for n in arr.chunks)  # the inner chunks of a sharded array
    shards = tuple(int(n) for n in arr.shards) if arr.shards is not None else None
    if shards is not None:
        if not sharded_ok(got, chunks, shards):
            raise CorruptStoreError(
                f"{where}: shards {shards} of chunks {chunks} for shape {got}: not rows x every "
                "layer in layer chunks"
            )
        n_chunks = -(-got[0] // chunks[0]) * (shards[1] // chunks[1])
    else:
        if len(chunks) != len(got) or not got or chunks[0] < 1 or chunks[1:] != got[1:]:
            raise CorruptStoreError(
                f"{where}: chunks {chunks} for shape {got}: not chunked along axis 0 only"
            )
        n_chunks = -(-got[0] // chunks[0])
    if n_chunks > max_chunks:
        raise CorruptStoreError(f"{where}: {n_chunks} chunks, more than the {max_chunks} an array may have")
    whole = shards or chunks  # what one file holds, and a whole-file read decodes
    if (
        max_chunk_bytes is not None
        and int(np.prod(whole, dtype=np.float64)) * arr.dtype.itemsize > max_chunk_bytes
    ):
        raise CorruptStoreError(f"{where}: chunks of {whole} {arr.dtype} exceed {max_chunk_bytes >> 20} MiB")
