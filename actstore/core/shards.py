"""The fast writer of a segment array's shards (:func:`write_shards`): each inner chunk compressed and
checksummed here and the shard laid out as zarr's sharding codec lays it out, put straight into a group
built in memory (:func:`memory_dict`); :func:`actstore.core.arrays.create_array` calls it."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, MutableMapping, Sequence
from typing import Any

import google_crc32c
import numpy as np
import zarr
import zarr.storage
from numcodecs import blosc
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync


def memory_dict(store: Any) -> Any:
    """The mapping a writable zarr ``MemoryStore`` keeps its objects in (the ``store_dict`` it was made
    with: a segment's group built in memory before it is stored), or None for any other store."""
    if isinstance(store, zarr.storage.MemoryStore) and not store.read_only:
        held = getattr(store, "_store_dict", None)
        return held if isinstance(held, MutableMapping) else None
    return None


def write_shards(
    group: zarr.Group,
    name: str,
    data: np.ndarray,
    inner: Sequence[int],
    zero_blocks: Collection[int] = (),
    separator: str = "/",
    layers: Sequence[int] | None = None,
    n_layers: int = 0,
) -> None:
    """Array ``name`` of ``group`` (created by :func:`create_array` with layer chunks ``inner`` and
    chunk keys of ``separator``) written shard by shard: each inner chunk (padded with zeros at the
    edges) Blosc/LZ4-compressed with byte shuffle and followed by its CRC32C, in C order, then the
    index of (offset, length) uint64 pairs and its CRC32C, exactly as zarr's sharding codec lays them
    out (tests/integration/core/test_local_chunks.py compares the bytes).  Written through the group's
    store, so the store's wrappers see every object.  zarr's own writer takes about 6x longer for
    these many small inner chunks (benchmarks/bench_layer_chunks.py), which a GPU ingest's host side
    would pay; the shards are stored together.  The axis-1 chunks in ``zero_blocks`` (all zero, the
    caller says) take the bytes of one zero chunk compressed once: the same bytes, without reading
    them.  ``layers``: ``data`` holds these positions of axis 1 (of ``n_layers``) only, the others zero
    (:func:`create_array`): each inner chunk is gathered from them, and one that holds none of them is
    a zero chunk."""

    n0 = int(data.shape[0])
    c0, k1 = int(inner[0]), int(inner[1])
    where: dict[int, int] | None = None
    if layers is None:
        n1 = int(data.shape[1])
    else:
        n1 = n_layers
        where = {int(i): k for k, i in enumerate(layers)}
        zero_blocks = set(zero_blocks) | {
            j for j in range(-(-n1 // k1)) if not any(x in where for x in range(j * k1, (j + 1) * k1))
        }
    nb = -(-n1 // k1)
    src = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
    block = np.zeros((c0, k1, *data.shape[2:]), dtype=src.dtype)
    tail = f"{separator}0" * (data.ndim - 1)
    zero_body: bytes | None = None
    store = group.store
    prefix = f"{group.path}/{name}" if group.path else name
    shards: list[tuple[str, Any]] = []
    for i in range(-(-n0 // c0)):
        rows = src[i * c0 : (i + 1) * c0]
        parts: list[bytes] = []
        index = np.empty((nb, 2), dtype="<u8")
        offset = 0
        for j in range(nb):
            if j in zero_blocks:  # (padded at an edge, a zero chunk is the same zero block)
                if zero_body is None:
                    zero_body = _compress(np.zeros(block.shape, src.dtype))
                    zero_body += int(google_crc32c.value(zero_body)).to_bytes(4, "little")
                parts.append(zero_body)
                index[j] = (offset, len(zero_body))
                offset += len(zero_body)
                continue
            if where is not None:  # the chunk's layers gathered from the ones given, zeros elsewhere
                if k1 == 1 and rows.shape[0] == c0:
                    raw = np.ascontiguousarray(rows[:, where[j] : where[j] + 1])
                else:
                    block[...] = 0
                    for layer in range(j * k1, min((j + 1) * k1, n1)):
                        if layer in where:
                            block[: rows.shape[0], layer - j * k1] = rows[:, where[layer]]
                    raw = block
            elif (piece := rows[:, j * k1 : (j + 1) * k1]).shape == block.shape:
                raw = np.ascontiguousarray(piece)
            else:  # an edge chunk: zarr stores it whole, padded with the fill value
                block[...] = 0
                block[: piece.shape[0], : piece.shape[1]] = piece
                raw = block
            # the shuffle's type size is the array's item size (as zarr's codec passes it)
            body = _compress(raw)
            crc = int(google_crc32c.value(body)).to_bytes(4, "little")
            parts += [body, crc]
            index[j] = (offset, len(body) + 4)
            offset += len(body) + 4
        table = index.tobytes()
        parts += [table, int(google_crc32c.value(table)).to_bytes(4, "little")]
        shards.append(
            (f"{prefix}/c{separator}{i}{tail}", default_buffer_prototype().buffer.from_bytes(b"".join(parts)))
        )
    held = memory_dict(store)
    if held is not None:  # a group built in memory: its dict, without a hand-over to zarr's event loop
        held.update(shards)
    else:
        sync(_set_all(store, shards))  # one hand-over to zarr's event loop for the array, not one a shard


async def _set_all(store: Any, items: Sequence[tuple[str, Any]]) -> None:
    await asyncio.gather(*(store.set(key, buf) for key, buf in items))


def _compress(raw: np.ndarray) -> bytes:
    """One inner chunk as zarr's Blosc codec writes it (LZ4, byte shuffle by the item size)."""
    return bytes(blosc.compress(raw.reshape(-1), b"lz4", 5, blosc.SHUFFLE, blosc.AUTOBLOCKS))
