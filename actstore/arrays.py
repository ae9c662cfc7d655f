"""Zarr v3 array conventions: dtypes, codecs, chunking, and chunk-coalesced reads.

Every array is compressed (Blosc/LZ4 with byte shuffle) and ends in a CRC32C codec, so a
flipped byte in any chunk fails decoding instead of returning wrong numbers.  LZ4 rather than
zstd: float16 activations barely compress (Blosc/zstd level 3 saves 6%), and LZ4 encodes about
9x and decodes about 10x faster (benchmarks/bench_codecs.py; see benchmarks/README.md), which
is what a GPU ingest's host side and every query pay for.  Stores written with zstd read as before.  bfloat16 has no
numpy dtype; it is stored as its raw uint16 bits and widened to float32 on read.

Every chunk is written, all-zero ones included (zarr skips those by default, and then a lost
chunk would be indistinguishable from one never written).  Readers open arrays through
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

import os
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from actstore.errors import CorruptStoreError
from actstore.fs import check_regular_file, read_local_file

NUMPY_DTYPE: dict[str, np.dtype] = {"float32": np.dtype("float32"), "float16": np.dtype("float16"), "bfloat16": np.dtype("uint16")}


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
        config={"write_empty_chunks": True},  # a missing chunk is then always a lost one
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


def take1(x: np.ndarray, idx: Sequence[int] | None) -> np.ndarray:
    """``x[:, idx]`` (all of axis 1 when None); a contiguous ascending ``idx`` is a slice (a view)."""
    if idx is None:
        return x
    idx = list(idx)
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return x[:, idx[0]:idx[0] + len(idx)]
    return x[:, idx]


def read_rows(arr: zarr.Array, rows: np.ndarray, where: str, logical_dtype: str | None = None,
              axis1: Sequence[int] | None = None) -> np.ndarray:
    """``arr[rows][:, axis1]`` for sorted row indices, reading each touched run of whole chunks once.

    With ``logical_dtype``, the rows come back widened to float32 (:func:`widen`), converted while
    they are copied out of the decoded chunks (no second copy); a run of consecutive rows is taken
    as a slice of its chunks, not gathered.  ``axis1`` (e.g. layers) is applied before widening, so
    only the kept part of each row is converted."""
    rows = np.asarray(rows, dtype=np.int64)
    dtype = np.dtype(np.float32) if logical_dtype is not None else arr.dtype
    tail = (len(axis1) if axis1 is not None else int(arr.shape[1]), *arr.shape[2:]) if arr.ndim > 1 else ()
    if axis1 is not None and arr.ndim < 2:
        raise ValueError("axis1 needs an array of at least 2 dimensions")
    if rows.size == 0:
        return np.zeros((0, *tail), dtype=dtype)
    chunk = int(arr.chunks[0])
    touched = np.unique(rows // chunk)
    spans = runs(touched)
    out: np.ndarray | None = None
    i = 0
    for c0, c1 in spans:
        lo, hi = c0 * chunk, min(c1 * chunk, int(arr.shape[0]))
        block = _read(arr, slice(lo, hi), where)
        sel = rows[(rows >= lo) & (rows < hi)] - lo
        consecutive = sel[-1] - sel[0] + 1 == sel.size and bool(np.all(sel[1:] != sel[:-1]))
        kept = take1(block, axis1)  # a view: the rows are gathered (and widened) from the kept part only
        piece = kept[sel[0]:sel[-1] + 1] if consecutive else kept[sel]
        if len(spans) == 1:
            return widen(piece, logical_dtype) if logical_dtype is not None else piece
        if out is None:
            out = np.empty((rows.size, *tail), dtype=dtype)
        if logical_dtype == "bfloat16":
            out[i:i + sel.size] = widen(piece, logical_dtype)
        else:
            out[i:i + sel.size] = piece  # float16 -> float32 while copying
        i += sel.size
    assert out is not None
    return out


def read_ranges(arr: zarr.Array, starts: Sequence[int], lengths: Sequence[int], where: str,
                logical_dtype: str | None = None, axis1: Sequence[int] | None = None) -> np.ndarray:
    """Concatenation of ``arr[s:s+n]`` for each range, reading each touched run of chunks once
    (widened to float32 with ``logical_dtype``, restricted to ``axis1``, as :func:`read_rows`)."""
    idx = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths)]) if len(
        starts
    ) else np.zeros(0, dtype=np.int64)
    if idx.size < 2 or bool(np.all(idx[1:] > idx[:-1])):  # ascending, no repeats (rows in store order)
        return read_rows(arr, idx, where, logical_dtype, axis1)
    order = np.argsort(idx, kind="stable")
    got = read_rows(arr, idx[order], where, logical_dtype, axis1)
    out = np.empty_like(got)
    out[order] = got
    return out


@dataclass(frozen=True)
class LocalChunks:
    """Where and how the chunks of one local array are stored, for reads without zarr's dispatch."""

    folder: str  # the array's folder: chunk i of axis 0 is folder/c/i/0/.../0
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype  # as stored (little-endian)
    blosc: bool  # bytes -> blosc -> crc32c (else bytes -> crc32c)
    max_bytes: int | None

    def key(self, i: int) -> str:
        return "/".join(("c", str(i), *("0" * (len(self.shape) - 1))))

    def path(self, i: int) -> str:
        """The file of chunk ``i``."""
        return os.path.join(self.folder, *self.key(i).split("/"))

    def read(self, c0: int, c1: int) -> np.ndarray:
        """Rows ``c0 * chunk .. min(c1 * chunk, shape[0])``: chunks c0..c1-1 decoded into one array."""
        import google_crc32c
        from numcodecs import Blosc

        n = int(self.chunks[0])
        out = np.empty(((c1 - c0) * n, *self.chunks[1:]), dtype=self.dtype)
        size = int(np.prod(self.chunks)) * self.dtype.itemsize
        flat = out.reshape(c1 - c0, -1).view(np.uint8)
        for j, i in enumerate(range(c0, c1)):
            try:  # a regular file of at most max_bytes, checked on the open descriptor (as every local read)
                data = read_local_file(self.path(i), self.max_bytes)
            except FileNotFoundError:
                raise MissingChunkError(f"{self.key(i)}: chunk is missing (lost or deleted; run actstore verify)") from None
            body = np.frombuffer(data, dtype=np.uint8)[:-4]
            if len(data) < 4 or int(google_crc32c.value(body)).to_bytes(4, "little") != data[-4:]:
                raise ValueError(f"{self.key(i)}: stored and computed CRC32C checksums do not match")
            if self.blosc:
                # Blosc's header: bytes 4-7 hold the decompressed size (little-endian)
                got = int.from_bytes(data[4:8], "little") if len(body) >= 16 else -1
                if got != size:
                    raise ValueError(f"{self.key(i)}: Blosc frame of {got} bytes, the chunk has {size}")
                Blosc().decode(body, out=flat[j])
            elif body.size != size:
                raise ValueError(f"{self.key(i)}: {body.size} bytes, the chunk has {size}")
            else:
                flat[j] = body
        return out[:min(c1 * n, self.shape[0]) - c0 * n]


def local_chunks(arr: zarr.Array) -> LocalChunks | None:
    """How to read ``arr``'s chunks without zarr's dispatch, or None when they must go through zarr:
    only an array of a local store opened through a strict :class:`ChunkGuard` (a missing chunk is
    an error, not zeros), chunked along axis 0 with zarr's default "/" chunk keys, whose codecs are
    exactly those :func:`create_array` writes (little-endian bytes, optional Blosc, CRC32C).
    A few attribute checks: cheap enough to make on every read."""
    from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding
    from zarr.core.metadata import ArrayV3Metadata

    guard = arr.store
    meta = arr.metadata
    if not isinstance(guard, ChunkGuard) or guard._local_root is None or not guard._strict:
        return None
    if not isinstance(meta, ArrayV3Metadata) or not isinstance(meta.chunk_key_encoding, DefaultChunkKeyEncoding) \
            or meta.chunk_key_encoding.separator != "/":
        return None
    codecs = list(meta.codecs)
    if not codecs or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[-1], Crc32cCodec):
        return None
    middle = codecs[1:-1]
    if middle and not (len(middle) == 1 and isinstance(middle[0], BloscCodec)):
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.kind not in "fiu" or (dtype.itemsize > 1 and getattr(codecs[0].endian, "value", None) != "little"):
        return None
    shape, chunks = tuple(int(n) for n in arr.shape), tuple(int(n) for n in arr.chunks)
    if len(shape) != len(chunks) or chunks[1:] != shape[1:]:
        return None
    return LocalChunks(os.path.join(guard._local_root, *arr.path.split("/")), shape, chunks,
                       dtype.newbyteorder("<"), bool(middle), guard._max_bytes)


def _read(arr: zarr.Array, sl: slice, where: str) -> np.ndarray:
    try:
        direct = local_chunks(arr)
        if direct is not None and sl.step is None:
            n = int(arr.chunks[0])
            lo, hi = int(sl.start or 0), min(int(sl.stop), int(arr.shape[0]))
            if lo % n == 0 and hi > lo:
                return direct.read(lo // n, -(-hi // n))[:hi - lo]
        return np.asarray(arr[sl])
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
    import asyncio

    from zarr.core.sync import sync

    async def settle() -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if others:
            await asyncio.gather(*others, return_exceptions=True)

    try:
        sync(settle())
    except Exception:  # best effort: never hide the read error behind a second one
        pass


class MissingChunkError(CorruptStoreError):
    """A chunk that the store's writer wrote (every chunk, for stores of integrity 1) is not there."""


def is_chunk_key(key: str) -> bool:
    """True for a zarr v3 chunk key (``c/0/1`` below an array, ``z/c/0/0/0/0`` below a group)."""
    parts = key.split("/")
    return "c" in parts[:-1]


class ChunkGuard(WrapperStore[Store]):
    """A read-only view of a zarr store that raises :class:`MissingChunkError` for a missing chunk
    (when ``strict``) instead of letting zarr return the fill value, and refuses special files and
    files larger than ``max_bytes`` of a local store (``local_root``) before zarr opens them."""

    def __init__(self, store: Store, *, where: str = "", strict: bool = True, local_root: str | None = None,
                 max_bytes: int | None = None) -> None:
        super().__init__(store)
        self._where = where
        self._strict = strict
        self._local_root = local_root
        self._max_bytes = max_bytes

    def _with_store(self, store: Store) -> ChunkGuard:
        return ChunkGuard(store, where=self._where, strict=self._strict, local_root=self._local_root,
                          max_bytes=self._max_bytes)

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if self._local_root is not None:
            check_regular_file(os.path.join(self._local_root, key), self._max_bytes)
        buf = await self._store.get(key, prototype, byte_range)
        if buf is None and self._strict and is_chunk_key(key):
            raise MissingChunkError(f"{self._where}/{key}: chunk is missing (lost or deleted; run actstore verify)")
        return buf

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)


def check_array(arr: zarr.Array, where: str, shape: tuple[int, ...] | None, dtype: np.dtype | None,
                max_chunk_bytes: int | None = None, max_chunks: int = 1 << 20) -> None:
    """Refuse (:class:`CorruptStoreError`) an array whose metadata disagrees with what the store's manifest
    and commit markers say: its ``shape`` and ``dtype``, chunking along axis 0 only, at most
    ``max_chunks`` chunks and ``max_chunk_bytes`` per chunk.  Run before any read, so a made-up shape
    in a ``zarr.json`` can neither allocate its size nor make a loop over its chunks endless."""
    got = tuple(int(n) for n in arr.shape)
    if shape is not None and got != tuple(shape):
        raise CorruptStoreError(f"{where}: shape {got} but the store says {tuple(shape)}")
    if dtype is not None and arr.dtype != dtype:
        raise CorruptStoreError(f"{where}: dtype {arr.dtype} but the store says {dtype}")
    chunks = tuple(int(n) for n in arr.chunks)
    if len(chunks) != len(got) or not got or chunks[0] < 1 or chunks[1:] != got[1:]:
        raise CorruptStoreError(f"{where}: chunks {chunks} for shape {got}: not chunked along axis 0 only")
    n_chunks = -(-got[0] // chunks[0])
    if n_chunks > max_chunks:
        raise CorruptStoreError(f"{where}: {n_chunks} chunks, more than the {max_chunks} an array may have")
    if max_chunk_bytes is not None and int(np.prod(chunks, dtype=np.float64)) * arr.dtype.itemsize > max_chunk_bytes:
        raise CorruptStoreError(f"{where}: chunks of {chunks} {arr.dtype} exceed {max_chunk_bytes >> 20} MiB")
