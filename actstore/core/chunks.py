"""Reading chunks safely and fast: :class:`ChunkGuard` (a wrapper of the zarr store that refuses a
missing chunk, special files and oversized local files) and :class:`LocalChunks` (local shard
reads with their CRC32C, bypassing zarr's per-chunk overhead)."""

from __future__ import annotations

import copy
import os
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass, field

import google_crc32c
import numpy as np
import zarr
from numcodecs import blosc
from zarr.abc.store import ByteRequest, Store, SuffixByteRequest
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ShardingCodecIndexLocation
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding
from zarr.core.metadata import ArrayV3Metadata
from zarr.storage import WrapperStore

from actstore.core.errors import MissingChunkError
from actstore.core.fs import check_regular_file, open_regular_file, pread_exact, read_local_file

_MISSING = (1 << 64) - 1  # a shard index entry of an inner chunk that was never written


_SHARD_INDEX_MAX = 1 << 14  # shard indexes a guard keeps (a 30-layer index is 480 bytes)


CHUNK_SEPARATORS = ("/", ".")  # of zarr's default chunk key encoding: those a store writes and reads


@dataclass(frozen=True)
class LocalChunks:
    """Where and how the chunks of one local array are stored, for reads without zarr's dispatch.

    Without ``inner1``, chunk ``i`` is the file ``c/i/0/...`` (``c.i.0...`` with the separator ".")
    and holds rows ``i * chunks[0]``
    onwards, whole along every other axis.  With ``inner1`` (a sharded array: layer chunks), that
    file is a shard of inner chunks of ``inner1`` positions of axis 1 (``chunks`` is then the inner
    chunk's shape), followed by its index: one (offset, length) pair of little-endian uint64 per
    inner chunk, then the index's CRC32C."""

    folder: str  # the array's folder: chunk (shard) i of axis 0 is folder/c/i/0/.../0
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype  # as stored (little-endian)
    blosc: bool  # bytes -> blosc -> crc32c (else bytes -> crc32c)
    max_bytes: int | None
    inner1: int = 0  # positions of axis 1 per inner chunk of a shard (0: not sharded)
    # checked shard indexes, kept by the array's ChunkGuard: key (path, dev, inode, size, mtime)
    index_cache: dict[tuple[object, ...], np.ndarray] | None = field(default=None, compare=False, repr=False)
    separator: str = "/"  # of the chunk keys (zarr's default encoding): "/" or "."

    def key(self, i: int) -> str:
        return self.separator.join(("c", str(i), *("0" * (len(self.shape) - 1))))

    def path(self, i: int) -> str:
        """The file of chunk (or shard) ``i``."""
        return os.path.join(self.folder, *self.key(i).split("/"))

    @property
    def n_inner(self) -> int:
        """Inner chunks per shard (1 without sharding)."""
        return -(-int(self.shape[1]) // self.inner1) if self.inner1 else 1

    def _decode(self, i: int, j: int, data: bytes, dest: np.ndarray) -> None:
        """The stored bytes of chunk ``i`` (inner chunk ``j``) checked (CRC32C) and decoded into ``dest``
        (uint8, the chunk's size)."""

        size = dest.size
        where = self.key(i) + (f" (layers {j * self.inner1}:{(j + 1) * self.inner1})" if self.inner1 else "")
        body = np.frombuffer(data, dtype=np.uint8)[:-4]
        if len(data) < 4 or int(google_crc32c.value(body)).to_bytes(4, "little") != data[-4:]:
            raise ValueError(f"{where}: stored and computed CRC32C checksums do not match")
        if self.blosc:
            # Blosc's header: bytes 4-7 hold the decompressed size (little-endian)
            got = int.from_bytes(data[4:8], "little") if len(body) >= 16 else -1
            if got != size:
                raise ValueError(f"{where}: Blosc frame of {got} bytes, the chunk has {size}")
            blosc.decompress(body, dest)
        elif body.size != size:
            raise ValueError(f"{where}: {body.size} bytes, the chunk has {size}")
        else:
            dest[...] = body

    def _missing(self, i: int) -> MissingChunkError:
        return MissingChunkError(f"{self.key(i)}: chunk is missing (lost or deleted; run actstore verify)")

    def _file(self, i: int) -> bytes:
        try:  # a regular file of at most max_bytes, checked on the open descriptor (as every local read)
            return read_local_file(self.path(i), self.max_bytes)
        except FileNotFoundError:
            raise self._missing(i) from None

    def _inner(self, i: int, blocks: Sequence[int]) -> list[bytes]:
        """The stored bytes of inner chunks ``blocks`` of shard ``i``: the whole file in one read when every
        inner chunk is wanted, else its index and then each run of adjacent inner chunks (``pread``)."""

        n_idx = 16 * self.n_inner + 4
        whole = len(blocks) == self.n_inner
        try:
            fd, st = open_regular_file(path := self.path(i), self.max_bytes)
        except FileNotFoundError:
            raise self._missing(i) from None
        size = int(st.st_size)
        # The index of this very file (same inode, size and mtime), as checked by an earlier read of the
        # same open store: a read of a few layers is then one pread.  Committed shards are never rewritten.
        file_id = (path, st.st_dev, st.st_ino, size, st.st_mtime_ns)
        cache = self.index_cache if self.index_cache is not None else {}
        try:
            if size < n_idx:
                raise ValueError(f"{self.key(i)}: {size} bytes, fewer than its shard index's {n_idx}")
            data = pread_exact(fd, size, 0, path) if whole else b""
            table = cache.get(file_id)
            if table is None or table.shape[0] != self.n_inner:
                index = data[size - n_idx :] if whole else pread_exact(fd, n_idx, size - n_idx, path)
                if int(google_crc32c.value(index[:-4])).to_bytes(4, "little") != index[-4:]:
                    raise ValueError(f"{self.key(i)}: the shard index fails its CRC32C checksum")
                table = np.frombuffer(index[:-4], dtype="<u8").reshape(self.n_inner, 2)
                if len(cache) >= _SHARD_INDEX_MAX:
                    cache.clear()
                cache[file_id] = table
            spans: list[tuple[int, int]] = []
            for b in blocks:
                off, n = (int(v) for v in table[b])
                if off == _MISSING and n == _MISSING:
                    raise MissingChunkError(
                        f"{self.key(i)}: inner chunk {b} (layers {b * self.inner1}:"
                        f"{(b + 1) * self.inner1}) is missing from the shard"
                    )
                if off + n > size - n_idx:
                    raise ValueError(
                        f"{self.key(i)}: the shard index points past the data ({off}+{n} > {size - n_idx})"
                    )
                spans.append((off, n))
            if whole:
                return [data[off : off + n] for off, n in spans]
            out: list[bytes] = []
            k = 0
            while k < len(spans):  # adjacent inner chunks (consecutive layers) in one read
                m = k + 1
                while m < len(spans) and spans[m][0] == spans[m - 1][0] + spans[m - 1][1]:
                    m += 1
                lo = spans[k][0]
                buf = pread_exact(fd, spans[m - 1][0] + spans[m - 1][1] - lo, lo, path)
                out += [buf[off - lo : off - lo + n] for off, n in spans[k:m]]
                k = m
            return out
        finally:
            os.close(fd)

    def read_chunk_into(self, i: int, block: int, dest: np.ndarray) -> None:
        """Chunk ``i`` (of a sharded array: its inner chunk ``block``; else ``block`` is 0) read, checked
        and decoded into ``dest`` (uint8, the chunk's size): for a reader that keeps its own buffers
        (the training loader's windows)."""
        data = self._inner(i, [block])[0] if self.inner1 else self._file(i)
        self._decode(i, block, data, dest)

    def read(self, c0: int, c1: int, blocks: Sequence[int] | None = None) -> np.ndarray:
        """Rows ``c0 * chunk .. min(c1 * chunk, shape[0])``: chunks c0..c1-1 decoded into one array;
        ``blocks``: of a sharded array, only these inner chunks of axis 1, concatenated along it (None: all)."""
        n = int(self.chunks[0])
        stop = min(c1 * n, self.shape[0]) - c0 * n
        if not self.inner1:  # one chunk per row range: decode in place
            out = np.empty(((c1 - c0) * n, *self.chunks[1:]), dtype=self.dtype)
            flat = out.reshape(c1 - c0, -1).view(np.uint8)
            for j, i in enumerate(range(c0, c1)):
                self._decode(i, 0, self._file(i), flat[j])
            return out[:stop]
        k1, n1 = self.inner1, int(self.shape[1])
        blocks = list(range(self.n_inner)) if blocks is None else list(blocks)
        widths = [min(k1, n1 - b * k1) for b in blocks]
        out = np.empty(((c1 - c0) * n, sum(widths), *self.chunks[2:]), dtype=self.dtype)
        if len(blocks) == 1 and widths[0] == k1:  # one full inner chunk per shard: decode in place
            flat = out.reshape(c1 - c0, -1).view(np.uint8)
            for j, i in enumerate(range(c0, c1)):
                self._decode(i, blocks[0], self._inner(i, blocks)[0], flat[j])
            return out[:stop]
        if (
            k1 == 1
        ):  # one layer per inner chunk: decode in place into [layer, row, ...], return a [row, layer] view
            by_layer = np.empty((len(blocks), (c1 - c0) * n, *self.chunks[2:]), dtype=self.dtype)
            for j, i in enumerate(range(c0, c1)):
                for m, data in enumerate(self._inner(i, blocks)):
                    self._decode(
                        i, blocks[m], data, by_layer[m, j * n : (j + 1) * n].reshape(-1).view(np.uint8)
                    )
            return by_layer.swapaxes(0, 1)[:stop]
        tmp = np.empty(self.chunks, dtype=self.dtype)
        raw = tmp.reshape(-1).view(np.uint8)
        for j, i in enumerate(range(c0, c1)):
            at = 0
            for b, w, data in zip(blocks, widths, self._inner(i, blocks)):
                self._decode(i, b, data, raw)
                out[j * n : (j + 1) * n, at : at + w] = tmp[:, :w]
                at += w
        return out[:stop]


def local_chunks(arr: zarr.Array) -> LocalChunks | None:
    """How to read ``arr``'s chunks without zarr's dispatch, or None when they must go through zarr:
    only an array of a local store opened through a strict :class:`ChunkGuard` (a missing chunk is
    an error, not zeros), chunked along axis 0 with zarr's default chunk keys, "/" or "." (or sharded as
    :func:`create_array` shards: rows x every layer, index at the end with CRC32C), whose codecs are
    exactly those :func:`create_array` writes (little-endian bytes, optional Blosc, CRC32C).
    A few attribute checks: cheap enough to make on every read."""

    guard = arr.store
    meta = arr.metadata
    if not isinstance(guard, ChunkGuard) or guard._local_root is None or not guard._strict:
        return None
    if (
        not isinstance(meta, ArrayV3Metadata)
        or not isinstance(meta.chunk_key_encoding, DefaultChunkKeyEncoding)
        or meta.chunk_key_encoding.separator not in CHUNK_SEPARATORS
    ):
        return None
    codecs = list(meta.codecs)
    shape, chunks = tuple(int(n) for n in arr.shape), tuple(int(n) for n in arr.chunks)
    inner1 = 0
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        sc = codecs[0]
        index = list(sc.index_codecs)
        if (
            sc.index_location != ShardingCodecIndexLocation.end
            or len(index) != 2
            or not isinstance(index[0], BytesCodec)
            or not isinstance(index[1], Crc32cCodec)
            or getattr(index[0].endian, "value", None) != "little"
            or arr.shards is None
        ):
            return None
        shards = tuple(int(n) for n in arr.shards)
        if len(shape) < 2 or not sharded_ok(shape, chunks, shards):
            return None
        codecs, inner1 = list(sc.codecs), chunks[1]
    elif len(shape) != len(chunks) or chunks[1:] != shape[1:]:
        return None
    if not codecs or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[-1], Crc32cCodec):
        return None
    middle = codecs[1:-1]
    if middle and not (len(middle) == 1 and isinstance(middle[0], BloscCodec)):
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.kind not in "fiu" or (
        dtype.itemsize > 1 and getattr(codecs[0].endian, "value", None) != "little"
    ):
        return None
    return LocalChunks(
        os.path.join(guard._local_root, *arr.path.split("/")),
        shape,
        chunks,
        dtype.newbyteorder("<"),
        bool(middle),
        guard._max_bytes,
        inner1,
        guard._shard_index,
        meta.chunk_key_encoding.separator,
    )


def is_chunk_key(key: str) -> bool:
    """True for a zarr v3 chunk key of the default encoding: ``c/0/1`` below an array, ``z/c/0/0/0/0``
    below a group ("/" separator), or ``c.0.1``, ``z/c.0.0.0.0`` ("." separator)."""
    parts = key.split("/")
    if "c" in parts[:-1]:
        return True
    head, dot, rest = parts[-1].partition(".")
    return head == "c" and bool(dot) and all(p.isdigit() for p in rest.split("."))


class ChunkGuard(WrapperStore[Store]):
    """A read-only view of a zarr store that raises :class:`MissingChunkError` for a missing chunk
    (when ``strict``) instead of letting zarr return the fill value, and refuses special files and
    files larger than ``max_bytes`` of a local store (``local_root``) before zarr opens them."""

    def __init__(
        self,
        store: Store,
        *,
        where: str = "",
        strict: bool = True,
        local_root: str | None = None,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__(store)
        self._where = where
        self._strict = strict
        self._local_root = local_root
        self._max_bytes = max_bytes
        self._shard_index: dict[tuple[object, ...], np.ndarray] = {}  # for LocalChunks: checked shard indexes
        # A remote store's shard indexes (the suffix read zarr's sharding codec makes before each inner
        # chunk), by (key, length): a committed shard is never rewritten, so a second read of the same
        # shard in this open store costs one request, not two.  zarr checks the index's CRC32C each time.
        self._remote_index: dict[tuple[str, int], bytes] = {}

    def _with_store(self, store: Store) -> ChunkGuard:
        guard = copy.copy(self)  # the same settings and shard index caches, over ``store``
        guard._store = store
        return guard

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if self._local_root is not None:
            check_regular_file(os.path.join(self._local_root, key), self._max_bytes)
        elif isinstance(byte_range, SuffixByteRequest) and self._strict and is_chunk_key(key):
            cached = self._remote_index.get((key, byte_range.suffix))
            if cached is not None:
                return prototype.buffer.from_bytes(cached)
            buf = await self._store.get(key, prototype, byte_range)
            if buf is not None:
                if len(self._remote_index) >= _SHARD_INDEX_MAX:
                    self._remote_index.clear()
                self._remote_index[(key, byte_range.suffix)] = buf.to_bytes()
            else:
                raise MissingChunkError(
                    f"{self._where}/{key}: chunk is missing (lost or deleted; run actstore verify)"
                )
            return buf
        buf = await self._store.get(key, prototype, byte_range)
        if buf is None and self._strict and is_chunk_key(key):
            raise MissingChunkError(
                f"{self._where}/{key}: chunk is missing (lost or deleted; run actstore verify)"
            )
        return buf

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)


def sharded_ok(shape: Sequence[int], chunks: Sequence[int], shards: Sequence[int]) -> bool:
    """True for the sharding :func:`create_array` writes: shards of rows x every position of axis 1
    (rounded up to whole inner chunks), inner chunks of the shard's rows and a part of axis 1, whole
    along later axes."""
    if len(shape) < 2 or not len(shape) == len(chunks) == len(shards):
        return False
    k1, n1 = int(chunks[1]), int(shape[1])
    return (
        int(chunks[0]) == int(shards[0]) >= 1
        and 1 <= k1 < n1
        and int(shards[1]) == -(-n1 // k1) * k1
        and tuple(chunks[2:]) == tuple(shape[2:]) == tuple(shards[2:])
    )
