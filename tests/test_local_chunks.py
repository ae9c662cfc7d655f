"""Local chunk reads without zarr's dispatch (:func:`actstore.arrays.local_chunks`) against zarr itself.

The oracle is zarr's own decoding of the same array (``arr[:]``, through its codec pipeline): every
segment array of stores in each storage dtype (float16, bfloat16 bits, float32) and of two
architectures is read row by row selection and layer subset through :func:`read_rows` /
:func:`read_ranges` (the fast path) and compared bit for bit.  Chunk order, the partial last chunk and
the layer subset are each exercised (a read that swapped two chunks, dropped the tail or applied the
layers to the wrong axis would differ).  The fast path must be the one taken for these local stores and
never for arrays it cannot vouch for (no guard, a lenient guard, other codecs); damaged chunks
are covered by tests/test_corruption.py (every byte of a chunk flipped) and tests/test_hostile_inputs.py
(missing, named pipe), which go through the same reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec
from zarr.storage import LocalStore

import actstore
from actstore.arrays import ChunkGuard, local_chunks, read_ranges, read_rows, widen
from actstore.errors import CorruptStoreError


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float16"), ("llama", "bfloat16"), ("gpt2", "float32")])
def test_fast_reads_equal_zarr(store_factory: Callable[..., Path], arch: str, dtype: str) -> None:
    path = store_factory(arch, storage_dtype=dtype, segment_size=8, limit=4)
    store = actstore.open(path)
    rng = np.random.default_rng(0)
    checked = 0
    for seg in store.commits:
        for name in ("z", "mlp", "resid", "attn", "v"):
            arr = store.array(seg, name)
            fast = local_chunks(arr)
            assert fast is not None, f"{seg}/{name}: the fast path is not taken"
            assert fast.blosc and fast.chunks[0] == int(arr.chunks[0])
            truth = widen(np.asarray(arr[:]), dtype)  # zarr's codec pipeline
            n = truth.shape[0]
            rows = np.sort(rng.choice(n, size=max(1, n // 2), replace=False))
            layers = sorted(rng.choice(truth.shape[1], size=min(2, truth.shape[1]), replace=False).tolist())
            np.testing.assert_array_equal(read_rows(arr, rows, name, dtype), truth[rows])
            np.testing.assert_array_equal(read_rows(arr, rows, name, dtype, layers), truth[rows][:, layers])
            np.testing.assert_array_equal(read_rows(arr, np.arange(n), name, dtype), truth)  # every chunk, in order
            starts, lengths = [n - 1, 0], [1, min(3, n)]  # out of order: the tail first
            np.testing.assert_array_equal(read_ranges(arr, starts, lengths, name, dtype),
                                          np.concatenate([truth[n - 1:n], truth[:min(3, n)]]))
            checked += 1
    assert checked >= 10


def test_partial_last_chunk(store_factory: Callable[..., Path]) -> None:
    """An array whose length is not a multiple of its chunk: the last chunk is stored whole (zarr pads it)
    and the fast read must cut it at the array's end."""
    store = actstore.open(store_factory("llama", storage_dtype="float16", segment_size=8, limit=4))
    arrays = [store.array(seg, "attn") for seg in store.commits]
    ragged = [a for a in arrays if a.shape[0] % a.chunks[0]]
    assert ragged, "the flat per-source arrays end inside a chunk"
    for arr in ragged:
        n = int(arr.shape[0])
        got = read_rows(arr, np.arange(n - 2, n), "attn", "float16")
        np.testing.assert_array_equal(got, widen(np.asarray(arr[n - 2:n]), "float16"))


def test_fast_path_only_where_it_can_vouch(tiny_store: Path, tmp_path: Path) -> None:
    store = actstore.open(tiny_store)
    arr = store.array(0, "z")
    assert local_chunks(arr) is not None
    plain = zarr.open_array(str(tiny_store / "segments" / "000000" / "z"), mode="r")
    assert local_chunks(plain) is None  # not read through ChunkGuard: no missing-chunk check
    seg = tiny_store / "segments" / "000000"
    lenient = zarr.open_group(store=ChunkGuard(LocalStore(str(seg), read_only=True), strict=False,
                                               local_root=str(seg)), mode="r")
    assert local_chunks(lenient["z"]) is None  # a missing chunk reads as zeros there: zarr decides
    zarr.create_array(str(tmp_path / "raw"), shape=(4, 3), chunks=(2, 3), dtype="float32",
                      serializer=BytesCodec(), compressors=None)
    guarded = zarr.open_array(store=ChunkGuard(LocalStore(str(tmp_path), read_only=True), local_root=str(tmp_path)),
                              path="raw", mode="r")
    assert local_chunks(guarded) is None  # no CRC32C: not this module's codecs


def test_a_valid_frame_of_the_wrong_size_is_refused(store_factory: Callable[..., Path], tmp_path: Path) -> None:
    """A chunk replaced by a well-formed Blosc frame (valid CRC32C) of fewer bytes than the chunk holds
    must be an error, not a partly filled array."""
    import shutil

    import google_crc32c
    from numcodecs import Blosc

    path = tmp_path / "s"
    shutil.copytree(store_factory("llama", storage_dtype="float16", segment_size=8, limit=4), path)
    chunk = path / "segments" / "000000" / "z" / "c" / "0" / "0" / "0" / "0"
    frame = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE).encode(np.zeros(10, dtype=np.float16))
    chunk.write_bytes(bytes(frame) + int(google_crc32c.value(bytes(frame))).to_bytes(4, "little"))
    store = actstore.open(path)
    with pytest.raises(CorruptStoreError, match="chunk read failed for rows 0:"):
        store.read_segment_rows(0, "z", np.arange(2))
