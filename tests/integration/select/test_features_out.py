"""Reads and feature blocks written in place (actstore.core.arrays.read_rows/read_ranges, actstore.query.select.features.compute_block).

* ``read_rows`` / ``read_ranges`` with widening equal numpy indexing of the whole array followed by
  :func:`actstore.core.arrays.widen`, for rows in one chunk, across chunk runs, with gaps and repeats,
  float16 and bfloat16 (its uint16 bits), and overlapping, unordered ranges.
* ``compute_block(..., out=view)`` writes each kind's rows into the given rows of a larger matrix,
  leaves the other rows alone, equals the kind computed here with einsum from the stored factors
  (an independent formulation), and zero-fills a source axis longer than the block's, at 1 and 2
  torch threads (``attn_head_token``'s products go through a scratch matrix above one thread).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import actstore
from actstore.core.arrays import create_array, read_ranges, read_rows, widen
from actstore.query.select.features import KINDS, FeatureSpec, compute_block, group_bounds


@pytest.fixture(scope="module")
def arrays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[zarr.Array, np.ndarray]]:
    rng = np.random.default_rng(0)
    group = zarr.open_group(str(tmp_path_factory.mktemp("arr")), mode="w")
    data16 = rng.standard_normal((37, 3, 5)).astype(np.float16)
    bf = (rng.standard_normal((37, 3, 5)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    create_array(group, "f16", data16, 4, logical_dtype="float16")
    create_array(group, "bf16", bf, 4, logical_dtype="bfloat16")
    return {"float16": (group["f16"], data16), "bfloat16": (group["bf16"], bf)}  # type: ignore[dict-item]


@pytest.mark.parametrize("logical", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "rows",
    [
        [5],
        [4, 5, 6, 7],
        [1, 2, 3, 4, 5, 6],
        [0, 3, 9, 10, 30, 36],
        [2, 2, 3, 8, 8, 9],
        list(range(37)),
        [12, 13, 14, 15, 28, 29],
    ],
)
def test_read_rows_equals_numpy_indexing(
    arrays: dict[str, tuple[zarr.Array, np.ndarray]], logical: str, rows: list[int]
) -> None:
    arr, data = arrays[logical]
    got = read_rows(arr, np.array(rows), "t", logical)
    want = widen(data[np.array(rows)], logical)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    raw = read_rows(arr, np.array(rows), "t")
    assert raw.dtype == data.dtype and np.array_equal(raw, data[np.array(rows)])


@pytest.mark.parametrize(
    "ranges", [[(0, 3), (3, 5)], [(10, 4), (2, 3)], [(5, 6), (7, 2), (0, 1)], [(20, 0), (36, 1)]]
)
def test_read_ranges_equals_concatenated_slices(
    arrays: dict[str, tuple[zarr.Array, np.ndarray]], ranges: list[tuple[int, int]]
) -> None:
    arr, data = arrays["float16"]
    got = read_ranges(arr, [s for s, _ in ranges], [n for _, n in ranges], "t", "float16")
    want = np.concatenate([data[s : s + n] for s, n in ranges]).astype(np.float32)
    assert np.array_equal(got, want)


def einsum_kind(store: actstore.Store, kind: str, block: object) -> np.ndarray:
    """The kind for one block, all layers and heads, from the stored factors with plain einsum."""
    g = store.geometry
    b = block
    W = {n: torch.from_numpy(store.weight(n)) for n in ("W_O", "b_O", "W_down", "b_down")}
    kv = torch.arange(g.n_heads) // g.kv_group
    seg, rows = b.segment, b.seg_rows  # type: ignore[attr-defined]
    if kind in ("z", "attn_head", "attn"):
        z = torch.from_numpy(store.read_segment_rows(seg, "z", rows))
        if kind == "z":
            return z.numpy()
        if kind == "attn":
            return (torch.einsum("nlhk,lhkd->nld", z, W["W_O"]) + W["b_O"]).numpy()
        return torch.einsum("nlhk,lhkd->nlhd", z, W["W_O"]).numpy()
    if kind in ("mlp", "mlp_group"):
        a = torch.from_numpy(store.read_segment_rows(seg, "mlp", rows))
        if kind == "mlp":
            return (torch.einsum("nlf,lfd->nld", a, W["W_down"]) + W["b_down"]).numpy()
        bd = group_bounds(g.d_mlp, g.n_heads)
        return torch.stack(
            [
                torch.einsum("nlf,lfd->nld", a[..., lo:hi], W["W_down"][:, lo:hi])
                for lo, hi in zip(bd[:-1], bd[1:])
            ],
            2,
        ).numpy()
    if kind == "resid":
        return store.read_segment_rows(seg, "resid", rows)
    out = []
    for r in range(len(rows)):
        src, n = int(b.src_start[r]), int(b.n_src[r])  # type: ignore[attr-defined]
        lo, hi = 0, n
        if kind == "attn_entity":
            s0 = int(b.subject_start[r])  # type: ignore[attr-defined]
            lo, hi = (s0, int(b.subject_end[r])) if s0 >= 0 else (0, 0)  # type: ignore[attr-defined]
        A = torch.from_numpy(
            store.read_segment_ranges(seg, "attn", np.array([src + lo]), np.array([hi - lo]))
        )
        V = torch.from_numpy(store.read_segment_ranges(seg, "v", np.array([src + lo]), np.array([hi - lo])))[
            :, :, kv
        ]
        if kind == "attn_prob":
            out.append(A.permute(1, 2, 0).numpy())
        elif kind == "attn_entity":
            out.append(torch.einsum("slh,slhk,lhkd->lhd", A, V, W["W_O"]).numpy())
        else:
            out.append(torch.einsum("slh,slhk,lhkd->lhsd", A, V, W["W_O"]).numpy())
    if kind == "attn_entity":
        return np.stack(out)
    S = max(x.shape[2] for x in out)
    return np.stack([np.pad(x, [(0, 0), (0, 0), (0, S - x.shape[2])] + [(0, 0)] * (x.ndim - 3)) for x in out])


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op threads for one test (attn_head_token takes another matmul path above one)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kind", KINDS)
def test_compute_block_writes_into_the_rows_it_is_given(
    tiny_store: Path, kind: str, torch_threads: int
) -> None:
    assert torch.get_num_threads() == torch_threads
    store = actstore.open(tiny_store)
    sel = store.select()
    blocks = [b for _, b in sel.blocks()]
    assert len(blocks) >= 2
    spec = FeatureSpec.parse(store, kind, None, None)
    block = blocks[1]
    want = einsum_kind(store, kind, block)
    n = len(block.seg_rows)
    extra = 3 if kind in ("attn_head_token", "attn_prob") else 0  # a longer source axis than the block's
    shape = list(want.shape)
    if extra:
        shape[3] += extra
    big = np.full((n + 5, *shape[1:]), 7.0, dtype=np.float32)
    got = compute_block(store, spec, block, out=big[2 : 2 + n])
    assert got.base is big or got.base is big.base
    assert np.all(big[:2] == 7.0) and np.all(big[2 + n :] == 7.0)  # other rows untouched
    np.testing.assert_allclose(
        big[2 : 2 + n][..., : want.shape[3], :]
        if extra and kind == "attn_head_token"
        else big[2 : 2 + n][..., : want.shape[3]]
        if extra
        else big[2 : 2 + n],
        want,
        rtol=1e-5,
        atol=1e-6,
    )
    if extra:
        assert np.all(big[2 : 2 + n][:, :, :, want.shape[3] :] == 0)
    alone = compute_block(store, spec, block)
    assert alone.flags.c_contiguous and alone.dtype == np.float32
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(actstore.core.errors.QueryError, match="out is"):
        compute_block(store, spec, block, out=np.zeros((n + 1, *alone.shape[1:]), np.float32))


@pytest.mark.parametrize("kind", ["attn_head", "mlp_group", "attn_entity", "resid"])
def test_load_features_streams_blocks_into_one_matrix(tiny_store: Path, kind: str) -> None:
    from actstore.query.analyses.probe_features import load_features

    store = actstore.open(tiny_store)
    want = store.select().features(kind)
    f32 = load_features(store, kind, batch_rows=3)  # blocks of 3 rows: several per segment, a short last one
    f16 = load_features(store, kind, batch_rows=3, dtype="float16")
    assert f32.data.dtype == torch.float32 and f16.data.dtype == torch.float16
    assert (
        f32.data.shape == (want.shape[0], int(np.prod(want.shape[1:]))) and f32.unit_shape == want.shape[1:]
    )
    np.testing.assert_allclose(f32.data.numpy().reshape(want.shape), want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(
        f16.data.numpy(), f32.data.numpy().astype(np.float16)
    )  # the same numbers, converted
    assert f32.example_ids.tolist() == store.select().example_ids.tolist()
    rel = {
        int(r["example_id"]): r["relation_id"]
        for r in store.sql("SELECT example_id, relation_id FROM examples").to_pylist()
    }
    assert f32.labels == [rel[int(e)] for e in f32.example_ids]
