"""Local chunk reads without zarr's dispatch (:func:`actstore.core.chunks.local_chunks`) against zarr itself.

The oracle is zarr's own decoding of the same array (``arr[:]``, through its codec pipeline): every
segment array of stores in each storage dtype (float16, bfloat16 bits, float32) and of two
architectures is read row by row selection and layer subset through :func:`read_rows` /
:func:`read_ranges` (the fast path) and compared bit for bit.  Chunk order, the partial last chunk and
the layer subset are each exercised (a read that swapped two chunks, dropped the tail or applied the
layers to the wrong axis would differ).  The fast path must be the one taken for these local stores and
never for arrays it cannot vouch for (no guard, a lenient guard, other codecs); damaged chunks
are covered by tests/cli/core/test_corruption.py (every byte of a chunk flipped) and tests/cli/cli/test_hostile_inputs.py
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
from actstore.core.arrays import WIDEN_BLOCK, read_ranges, read_rows, widen, widen_into
from actstore.core.chunks import ChunkGuard, local_chunks
from actstore.core.errors import CorruptStoreError


@pytest.mark.parametrize(
    ("arch", "dtype", "chunk_layers"),
    [
        ("llama", "float16", 1),
        ("llama", "bfloat16", 1),
        ("gpt2", "float32", 1),
        ("llama", "float16", 0),
        ("gpt2", "float16", 3),
    ],
)
def test_fast_reads_equal_zarr(
    store_factory: Callable[..., Path], arch: str, dtype: str, chunk_layers: int
) -> None:
    path = store_factory(arch, storage_dtype=dtype, segment_size=8, limit=4, chunk_layers=chunk_layers)
    store = actstore.open(path)
    rng = np.random.default_rng(0)
    checked = several = 0
    for seg in store.commits:
        for name in ("z", "mlp", "resid", "attn", "v"):
            arr = store.array(seg, name)
            fast = local_chunks(arr)
            assert fast is not None, f"{seg}/{name}: the fast path is not taken"
            assert fast.blosc and fast.chunks[0] == int(arr.chunks[0])
            assert fast.chunks[1] == (min(chunk_layers, arr.shape[1]) if chunk_layers else arr.shape[1])
            truth = widen(np.asarray(arr[:]), dtype)  # zarr's codec pipeline
            n = truth.shape[0]
            rows = np.sort(rng.choice(n, size=max(1, n // 2), replace=False))
            layers = sorted(rng.choice(truth.shape[1], size=min(2, truth.shape[1]), replace=False).tolist())
            np.testing.assert_array_equal(read_rows(arr, rows, name, dtype), truth[rows])
            again = np.sort(np.r_[rows, rows[::3], n - 1])  # sorted, some rows twice
            np.testing.assert_array_equal(read_rows(arr, again, name, dtype), truth[again])
            several += n > int(arr.chunks[0])
            for sel in (rows, np.arange(n)):  # into a given array: one run of chunks, and several
                buf = np.full(truth[sel].shape, -7.0, dtype=np.float32)
                assert read_rows(arr, sel, name, dtype, out=buf) is buf
                np.testing.assert_array_equal(buf, truth[sel])
            with pytest.raises(ValueError, match="read_rows: out is"):
                read_rows(arr, rows, name, dtype, out=np.empty((rows.size + 1, *truth.shape[1:]), np.float32))
            np.testing.assert_array_equal(read_rows(arr, rows, name, dtype, layers), truth[rows][:, layers])
            np.testing.assert_array_equal(
                read_rows(arr, np.arange(n), name, dtype), truth
            )  # every chunk, in order
            starts, lengths = [n - 1, 0], [1, min(3, n)]  # out of order: the tail first
            np.testing.assert_array_equal(
                read_ranges(arr, starts, lengths, name, dtype),
                np.concatenate([truth[n - 1 : n], truth[: min(3, n)]]),
            )
            checked += 1
    assert checked >= 10 and several >= 1


def test_widen_equals_numpys_conversion() -> None:
    """float16 -> float32 (torch's conversion, ``WIDEN_BLOCK`` values a copy) against numpy's
    ``astype`` bit for bit, on the layouts reads hand it: contiguous, one layer of several (strided),
    rows wider than a block, every other row, read-only and reversed (numpy's path), a small read;
    NaN, infinities, signed zeros and subnormals included."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3 * WIDEN_BLOCK // 64 + 5, 4, 16)) * 100).astype(np.float16)
    x.reshape(-1)[:7] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 6e-8, -6e-8]
    wide = rng.standard_normal((3, WIDEN_BLOCK + 9)).astype(np.float16)
    frozen = x.copy()
    frozen.flags.writeable = False
    for data in (x, x[:, 2], x[:, 1:3], x[::2], wide, frozen, x[::-1], x[:10]):
        want = data.astype(np.float32)
        got = widen(data, "float16")
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        out = np.full(data.shape, -1.0, dtype=np.float32)
        widen_into(out, data)
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


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
        np.testing.assert_array_equal(got, widen(np.asarray(arr[n - 2 : n]), "float16"))


def test_fast_path_only_where_it_can_vouch(tiny_store: Path, tmp_path: Path) -> None:
    store = actstore.open(tiny_store)
    arr = store.array(0, "z")
    assert local_chunks(arr) is not None
    plain = zarr.open_array(str(tiny_store / "segments" / "000000" / "z"), mode="r")
    assert local_chunks(plain) is None  # not read through ChunkGuard: no missing-chunk check
    seg = tiny_store / "segments" / "000000"
    lenient = zarr.open_group(
        store=ChunkGuard(LocalStore(str(seg), read_only=True), strict=False, local_root=str(seg)), mode="r"
    )
    assert local_chunks(lenient["z"]) is None  # a missing chunk reads as zeros there: zarr decides
    zarr.create_array(
        str(tmp_path / "raw"),
        shape=(4, 3),
        chunks=(2, 3),
        dtype="float32",
        serializer=BytesCodec(),
        compressors=None,
    )
    guarded = zarr.open_array(
        store=ChunkGuard(LocalStore(str(tmp_path), read_only=True), local_root=str(tmp_path)),
        path="raw",
        mode="r",
    )
    assert local_chunks(guarded) is None  # no CRC32C: not this module's codecs


def test_a_valid_frame_of_the_wrong_size_is_refused(
    store_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A chunk replaced by a well-formed Blosc frame (valid CRC32C) of fewer bytes than the chunk holds
    must be an error, not a partly filled array."""
    import shutil

    import google_crc32c
    from numcodecs import Blosc

    path = tmp_path / "s"
    shutil.copytree(store_factory("llama", storage_dtype="float16", segment_size=8, limit=4), path)
    chunk = path / "segments" / "000000" / "z" / "c.0.0.0.0"
    frame = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE).encode(np.zeros(10, dtype=np.float16))
    chunk.write_bytes(bytes(frame) + int(google_crc32c.value(bytes(frame))).to_bytes(4, "little"))
    store = actstore.open(path)
    with pytest.raises(CorruptStoreError, match="chunk read failed for rows 0:"):
        store.read_segment_rows(0, "z", np.arange(2))


def _axis1_chunked(
    tmp_path: Path, shape: tuple[int, ...], chunk0: int, chunk1: int
) -> tuple[zarr.Array, zarr.Array, np.ndarray]:
    """An array written by :func:`create_array` with ``chunk1`` positions of axis 1 per chunk, opened twice:
    through a strict guard (the fast path) and plainly (zarr's own reads); and the data written."""
    from actstore.core.arrays import create_array

    data = np.random.default_rng(1).standard_normal(shape).astype(np.float16)
    group = zarr.open_group(str(tmp_path / "g"), mode="w")
    create_array(group, "a", data, chunk0, logical_dtype="float16", chunk1=chunk1)
    guarded = zarr.open_array(
        store=ChunkGuard(LocalStore(str(tmp_path / "g"), read_only=True), local_root=str(tmp_path / "g")),
        path="a",
        mode="r",
    )
    return guarded, zarr.open_array(str(tmp_path / "g" / "a"), mode="r"), data


@pytest.mark.parametrize(
    "layers", [None, [0], [6], [2, 3, 4], [0, 6], [5, 1], [-1, 3], [3, 4, 5, 6], list(range(7))]
)
def test_layer_chunked_reads_equal_numpy(tmp_path: Path, layers: list[int] | None) -> None:
    """Axis 1 of 7 in chunks of 3 (the last chunk holds one position, padded by zarr): any layer subset,
    in any order, through the fast path and through zarr, equals numpy indexing of the data written."""
    fast, plain, data = _axis1_chunked(tmp_path, (11, 7, 2, 3), 4, 3)
    assert local_chunks(fast) is not None and local_chunks(plain) is None
    assert tuple(fast.chunks) == (4, 3, 2, 3)
    for rows in (np.arange(11), np.array([0, 5, 6, 10]), np.array([9])):
        want = data[rows] if layers is None else data[rows][:, layers]
        for arr in (fast, plain):
            got = read_rows(arr, rows, "a", "float16", layers)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want.astype(np.float32))
    with pytest.raises(IndexError):
        read_rows(fast, np.arange(3), "a", "float16", [7])


def test_a_layer_read_fetches_only_its_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of layer chunks: reading layers 3-4 of 9 (chunks of 2) decodes the inner chunks of axis-1
    block 1 and 2 only, and reading every layer decodes the whole grid; counted at the decoder.  Each chunk
    of rows is one file (a shard), as in a store without layer chunks."""
    from actstore.core.chunks import LocalChunks

    fast, _, data = _axis1_chunked(tmp_path, (8, 9, 5), 4, 2)
    seen: list[tuple[int, int]] = []
    original = LocalChunks._decode

    def counting(self: LocalChunks, i: int, j: int, data: bytes, dest: np.ndarray) -> None:
        seen.append((i, j))
        original(self, i, j, data, dest)

    monkeypatch.setattr(LocalChunks, "_decode", counting)
    got = read_rows(fast, np.arange(8), "a", "float16", [3, 4])
    np.testing.assert_array_equal(got, data[:, 3:5].astype(np.float32))
    assert sorted(seen) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    seen.clear()
    read_rows(fast, np.array([5]), "a", "float16", [8])
    assert seen == [(1, 4)]
    seen.clear()
    read_rows(fast, np.arange(8), "a", "float16")
    assert sorted(seen) == [(i, j) for i in range(2) for j in range(5)]
    assert sorted(p.name for p in (tmp_path / "g" / "a" / "c").rglob("*") if p.is_file()) == ["0", "0"]
    assert fast.shards == (4, 10, 5) and fast.chunks == (4, 2, 5)


def test_a_shard_index_that_lies_is_refused(tmp_path: Path) -> None:
    """A shard whose index (with a valid CRC32C) marks an inner chunk as never written, or points past the
    shard's data, is an error on the fast path, not zeros or bytes of another chunk."""
    import google_crc32c

    _axis1_chunked(tmp_path, (8, 4, 3), 4, 1)
    shard = tmp_path / "g" / "a" / "c" / "0" / "0" / "0"
    good = shard.read_bytes()
    n_idx = 16 * 4 + 4

    def with_entry(j: int, off: int, n: int) -> bytes:
        table = np.frombuffer(good[-n_idx:-4], dtype="<u8").copy().reshape(4, 2)
        table[j] = (off, n)
        body = table.tobytes()
        return good[:-n_idx] + body + int(google_crc32c.value(body)).to_bytes(4, "little")

    def reopen() -> zarr.Array:  # a fresh view (an open one keeps the indexes it has checked)
        root = str(tmp_path / "g")
        return zarr.open_array(
            store=ChunkGuard(LocalStore(root, read_only=True), local_root=root), path="a", mode="r"
        )

    missing = (1 << 64) - 1
    for damaged, needle in (
        (with_entry(2, missing, missing), r"inner chunk 2 \(layers 2:3\) is missing"),
        (with_entry(1, len(good), 8), "points past the data"),
    ):
        shard.write_bytes(damaged)
        with pytest.raises(CorruptStoreError, match=needle):
            read_rows(reopen(), np.arange(4), "a", "float16", [2, 1])
        with pytest.raises(CorruptStoreError, match=needle):
            read_rows(reopen(), np.arange(4), "a", "float16")  # the whole-shard read checks the same entries
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptStoreError, match="shard index fails its CRC32C"):
        read_rows(reopen(), np.arange(4), "a", "float16", [0])


def test_an_open_array_reads_a_shard_index_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second read of a few layers through the same open array is one pread per shard (the index checked
    by the first read is kept); the values are the same either way."""
    import os

    fast, _, data = _axis1_chunked(tmp_path, (8, 6, 5), 4, 1)
    calls: list[int] = []
    original = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        calls.append(n)
        return original(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting)
    first = read_rows(fast, np.arange(8), "a", "float16", [3, 4])
    assert len(calls) == 4  # two shards: index, then layers 3-4 in one read
    calls.clear()
    second = read_rows(fast, np.arange(8), "a", "float16", [3, 4])
    assert len(calls) == 2
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(second, data[:, 3:5].astype(np.float32))


@pytest.mark.parametrize(
    ("shape", "chunk0", "chunk1", "dtype"),
    [
        ((11, 7, 2, 3), 4, 3, "float16"),
        ((8, 31, 5), 4, 1, "float16"),
        ((3, 4, 6), 32, 2, "uint16"),
        ((9, 5, 4), 4, 1, "float32"),
    ],
)
@pytest.mark.parametrize("zero", [False, True])
def test_shards_are_written_byte_for_byte_as_zarr_writes_them(
    tmp_path: Path, shape: tuple[int, ...], chunk0: int, chunk1: int, dtype: str, zero: bool
) -> None:
    """:func:`write_shards` (the fast writer) against zarr's own sharding codec writing the same array:
    every file under the array is identical, the partial last chunk of rows and of layers included;
    ``zero``: the first and last layer chunks are zeros the writer is told of (``zero_blocks``: one
    compressed zero chunk reused), and the bytes are those it writes when it compresses every chunk
    (zarr itself leaves an empty inner chunk out of a shard, which a store's reader takes as lost)."""
    from actstore.core.arrays import create_array

    rng = np.random.default_rng(3)
    data = (
        rng.integers(0, 1 << 16, size=shape).astype(np.uint16)
        if dtype == "uint16"
        else rng.standard_normal(shape).astype(dtype)
    )
    n_blocks = -(-shape[1] // chunk1)
    zero_blocks = {0, n_blocks - 1} if zero else set()
    for j in zero_blocks:
        data[:, j * chunk1 : (j + 1) * chunk1] = 0
    ours = zarr.open_group(str(tmp_path / "ours"), mode="w")
    create_array(
        ours,
        "a",
        data,
        chunk0,
        logical_dtype="bfloat16" if dtype == "uint16" else dtype,
        chunk1=chunk1,
        zero_blocks=zero_blocks,
    )
    (tmp_path / "theirs" / "a").mkdir(parents=True)  # the same metadata, the chunks written by zarr
    (tmp_path / "theirs" / "a" / "zarr.json").write_bytes(
        (tmp_path / "ours" / "a" / "zarr.json").read_bytes()
    )
    if zero:  # the reference: the same writer compressing every chunk
        create_array(
            zarr.open_group(str(tmp_path / "theirs"), mode="w"),
            "a",
            data,
            chunk0,
            logical_dtype="bfloat16" if dtype == "uint16" else dtype,
            chunk1=chunk1,
        )
    else:
        zarr.open_array(str(tmp_path / "theirs" / "a"), mode="r+")[...] = data
    files = {
        p.relative_to(tmp_path / "ours"): p.read_bytes()
        for p in (tmp_path / "ours").rglob("*")
        if p.is_file() and p.parent.name != "ours"
    }
    chunks = [k for k in files if "c" in k.parts]
    assert len(chunks) == -(-shape[0] // min(chunk0, shape[0]))
    for key in chunks:
        assert (tmp_path / "theirs" / key).read_bytes() == files[key], key
    np.testing.assert_array_equal(
        np.asarray(zarr.open_array(str(tmp_path / "ours" / "a"), mode="r")[...]), data
    )


@pytest.mark.parametrize(
    ("chunk1", "layers"),
    [(1, [5, 0, 3]), (2, [6, 1, 2]), (3, [4]), (1, []), (0, [1, 6])],
)
@pytest.mark.parametrize("memory", [False, True])
def test_given_layers_write_the_array_the_whole_one_writes(
    tmp_path: Path, chunk1: int, layers: list[int], memory: bool
) -> None:
    """:func:`create_array` given only some layers of axis 1 (``layers``, in any order; a corpus store's
    kept layers) against the same array made whole with numpy (zeros elsewhere) and written by the
    same function compressing every chunk: every object is the same bytes, with layer chunks of 1, 2
    (the last one partial) and 3, none kept, and no layer chunks (zarr's own writer, given it whole);
    rows end in a partial chunk; on disk and in a memory store (a segment's group)."""
    from actstore.core.arrays import create_array

    rng = np.random.default_rng(4)
    given = rng.standard_normal((10, len(layers), 5)).astype(np.float16)
    whole = np.zeros((10, 7, 5), np.float16)
    for k, i in enumerate(layers):
        whole[:, i] = given[:, k]
    objects: dict[str, dict[str, bytes]] = {}
    for name, data, kw in (
        ("given", given, {"layers": layers, "n_layers": 7}),
        ("whole", whole, {}),
    ):
        if memory:
            held: dict = {}
            group = zarr.open_group(store=zarr.storage.MemoryStore(held), mode="w")
        else:
            group = zarr.open_group(str(tmp_path / name), mode="w")
        create_array(group, "a", data, 4, logical_dtype="float16", chunk1=chunk1, separator=".", **kw)
        if memory:
            objects[name] = {k: v.to_bytes() for k, v in held.items() if k.startswith("a/")}
        else:
            objects[name] = {
                str(p.relative_to(tmp_path / name)): p.read_bytes()
                for p in sorted((tmp_path / name).rglob("*"))
                if p.is_file() and p.parent.name == "a"
            }
        np.testing.assert_array_equal(group["a"][...], whole)
    assert len(objects["whole"]) == 4  # zarr.json and 3 chunks of rows (shards where chunk1)
    assert objects["given"] == objects["whole"]
