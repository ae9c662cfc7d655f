"""Selection.loader's batches, epoch after epoch, against a plain loop over the documented order
(docs/loader.md, "The order of an epoch"), written here without the loader's plan: units of whole
chunks permuted by ``default_rng([seed, epoch])``, the rank's share, windows of ``buffer_rows``
permuted by ``default_rng([seed, epoch, rank, window])``, batches of consecutive rows that never
span two epochs.  Every batch's ids and values must be the plain loop's, whatever the worker count,
whether one window holds the whole selection (the resident window) or not; an abandoned endless
iteration leaves no thread; a chunk that fails its checksum in a window read by the background
thread is the same one line in the consumer."""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import actstore
from actstore.core.errors import CorruptStoreError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def store(store_factory: Callable[..., Path]) -> Any:
    """36 rows in 5 segments of 8, chunks of 4 rows, float16."""
    return actstore.open(store_factory("llama", limit=6, storage_dtype="float16"))


def plain_batches(
    sel: Any,
    chunk_rows: int,
    *,
    epoch: int,
    seed: int,
    batch: int,
    buffer: int,
    unit_chunks: int = 1,
    rank: int = 0,
    world: int = 1,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """The documented order of one epoch, as a list of batches of selection positions."""
    seg = sel.rows.column("segment").to_pylist()
    srow = sel.rows.column("seg_row").to_pylist()
    units: list[list[int]] = []
    for k in range(len(seg)):
        key = (seg[k], srow[k] // (chunk_rows * unit_chunks))
        if k and key == (seg[k - 1], srow[k - 1] // (chunk_rows * unit_chunks)):
            units[-1].append(k)
        else:
            units.append([k])
    seq = [p for u in np.random.default_rng([seed, epoch]).permutation(len(units)) for p in units[u]]
    n = len(seq)
    if drop_last:
        share = seq[rank * (n // world) : rank * (n // world) + (n // world) // batch * batch]
    else:
        share = seq[rank * n // world : (rank + 1) * n // world]
    out: list[int] = []
    for w, a in enumerate(range(0, len(share), buffer)):
        win = share[a : a + buffer]
        out += [win[i] for i in np.random.default_rng([seed, epoch, rank, w]).permutation(len(win))]
    return [np.array(out[a : a + batch], dtype=np.int64) for a in range(0, len(out), batch)]


CASES = [  # (batch, buffer, world, rank, drop_last, unit_chunks)
    (5, 16, 1, 0, False, 1),  # windows smaller than the selection: batches span windows
    (7, 36, 1, 0, False, 1),  # one window holds everything: later epochs from the resident window
    (4, 100, 1, 0, False, 2),  # the same, a window larger than the selection, units of two chunks
    (3, 10, 2, 1, False, 1),  # rank 1 of 2
    (4, 8, 1, 0, True, 1),  # drop_last: every batch full, the rows beyond skipped
    (36, 36, 1, 0, True, 1),  # drop_last with one batch of everything: resident and full
]


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("case", CASES)
def test_batches_follow_the_documented_order_epoch_after_epoch(
    store: Any, case: tuple[int, int, int, int, bool, int], workers: int
) -> None:
    batch, buffer, world, rank, drop_last, unit_chunks = case
    sel = store.select()
    chunk = store.manifest.chunk_rows
    feats = sel.features("resid", layers=[1])[:, 0]  # float32 of the stored float16: exact
    row_ids = sel.rows.column("row").to_numpy()
    kw: dict[str, Any] = dict(batch_size=batch, buffer_rows=buffer, seed=7, rank=rank, world_size=world)
    kw.update(drop_last=drop_last, unit_rows=chunk * unit_chunks, workers=workers)
    want = [
        b
        for e in range(4)
        for b in plain_batches(
            sel,
            chunk,
            epoch=e,
            seed=7,
            batch=batch,
            buffer=buffer,
            unit_chunks=unit_chunks,
            rank=rank,
            world=world,
            drop_last=drop_last,
        )
    ]
    for dtype in ("float32", "float16"):
        feed = sel.loader("resid", layers=[1], epochs=None, with_ids=True, flatten=True, dtype=dtype, **kw)
        got = list(itertools.islice(feed, len(want)))
        assert len(got) == len(want)
        for (ids, x), pos in zip(got, want):
            assert ids.tolist() == row_ids[pos].tolist()
            assert x.dtype == getattr(torch, dtype) and x.shape == (pos.size, feats.shape[1])
            np.testing.assert_array_equal(x.float().numpy(), feats[pos].astype(dtype).astype(np.float32))
        # without ids: the same tensors
        plain = sel.loader("resid", layers=[1], epochs=None, flatten=True, dtype=dtype, **kw)
        for x, (_, y) in zip(itertools.islice(plain, len(want)), got):
            assert torch.equal(x, y)


@pytest.mark.parametrize("buffer", [9, 36])
def test_resuming_an_endless_feed_in_a_later_epoch_gives_the_same_batches(store: Any, buffer: int) -> None:
    """A checkpoint in epoch 2 (the resident window's epochs where ``buffer`` holds everything)."""
    sel = store.select()
    kw: dict[str, Any] = dict(batch_size=5, buffer_rows=buffer, seed=1, epochs=None, with_ids=True)
    full = [i.tolist() for i, _ in itertools.islice(sel.loader("resid", layers=[1], **kw), 30)]
    feed = sel.loader("resid", layers=[1], **kw)
    it = iter(feed)
    first = [next(it)[0].tolist() for _ in range(19)]
    state = feed.state_dict()
    assert state["epoch"] == 2
    del it
    again = sel.loader("resid", layers=[1], **kw)
    again.load_state_dict(state)
    assert first + [i.tolist() for i, _ in itertools.islice(again, 11)] == full


@pytest.mark.parametrize("workers", [1, 3])
def test_an_abandoned_endless_feed_leaves_no_thread(store: Any, workers: int) -> None:
    """The background thread runs windows (and epochs) ahead; breaking out stops it and joins it."""
    sel = store.select()
    before = threading.active_count()
    for buffer in (6, 36):
        feed = sel.loader("resid", layers=[1], batch_size=4, buffer_rows=buffer, epochs=None, workers=workers)
        for k, _x in enumerate(feed):
            if k == 25:  # a few epochs in
                break
        assert threading.active_count() <= before
        it = iter(feed)
        next(it)
        del it
        assert threading.active_count() <= before


def test_a_corrupt_chunk_read_in_the_background_is_one_line(
    store_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The first window reads clean chunks (in the consumer's thread); the last segment's chunk fails
    its CRC32C in a window the background thread reads: the consumer gets the same one line, after the
    batches before it."""
    src = store_factory("llama", limit=6, storage_dtype="float16")
    dst = tmp_path / "s"
    shutil.copytree(src, dst)
    segs = sorted(p.name for p in (dst / "segments").iterdir())
    shard = dst / "segments" / segs[-1] / "resid" / "c.0.0.0"
    data = bytearray(shard.read_bytes())
    for k in range(20, len(data) - 400, 97):
        data[k] ^= 0xFF
    shard.write_bytes(bytes(data))
    sel = actstore.open(dst).select()
    for workers in (1, 2):
        given = 0
        with pytest.raises(CorruptStoreError) as e:
            for _x in sel.loader(
                "resid", layers=[1], batch_size=4, buffer_rows=8, shuffle=False, workers=workers
            ):
                given += 1
        assert given >= 2  # the windows before the corrupt one were handed out
        assert "\n" not in str(e.value) and "chunk read failed" in str(e.value) and "resid" in str(e.value)
