"""Selection.loader(epochs=...): epoch after epoch in one pass, checked against a plain loop over
``epoch_rows`` (each epoch a permutation of the selection, different across epochs, the same for the
same seed, a resumed feed equal to the uninterrupted one in whichever epoch it stopped)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import actstore
from actstore.core.errors import QueryError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sel(store_factory: Callable[..., Path]) -> Any:
    return actstore.open(store_factory("llama", limit=6, storage_dtype="float16")).select()


def ids(feed: Any, n_batches: int | None = None) -> list[int]:
    out: list[int] = []
    for i, _ in itertools.islice(feed, n_batches):
        out += i.tolist()
    return out


KW: dict[str, Any] = dict(batch_size=5, buffer_rows=16, seed=3, with_ids=True, workers=1)


def test_epochs_none_streams_reshuffled_epochs_like_a_plain_loop(sel: Any) -> None:
    n = len(sel)
    plain = sel.loader("resid", layers=[0], **KW)
    want = [plain.epoch_rows(e).tolist() for e in range(4)]  # the plain loop: one epoch a pass
    for e in range(4):
        assert sorted(want[e]) == sorted(sel.rows.column("row").to_pylist())  # a permutation
    assert len({tuple(w) for w in want}) == 4  # reshuffled each epoch
    flat = [r for w in want for r in w]
    forever = sel.loader("resid", layers=[0], epochs=None, **KW)
    per_epoch = -(-n // 5)
    got = ids(forever, 4 * per_epoch)
    # batches never span epochs: the last batch of an epoch may be short
    assert got == flat
    st = forever.state_dict()  # after the last batch of epoch 3 (the epoch advances on the next pull)
    assert (st["epoch"], st["position"]) in ((4, 0), (3, n))
    again = sel.loader("resid", layers=[0], epochs=None, **KW)  # the same seed: the same stream
    assert ids(again, 2 * per_epoch) == flat[: 2 * n]
    other = sel.loader("resid", layers=[0], epochs=None, **{**KW, "seed": 4})
    assert ids(other, per_epoch) != flat[:n]


@pytest.mark.parametrize("stop", [1, 9, 17, 23])  # batches before the checkpoint: epochs 0 to 2
def test_epochs_none_resumes_mid_epoch_in_any_epoch(sel: Any, stop: int) -> None:
    total = 5 * -(-len(sel) // 5)
    uninterrupted = ids(sel.loader("resid", layers=[0], epochs=None, **KW), 30)
    ld = sel.loader("resid", layers=[0], epochs=None, **KW)
    first = ids(ld, stop)
    state = ld.state_dict()
    assert state["epoch"] == (stop * 5 - 1) // total  # the checkpoint lies in epoch 0, 1 or 2
    resumed = sel.loader("resid", layers=[0], epochs=None, **KW)
    resumed.load_state_dict(state)
    assert first + ids(resumed, 30 - stop) == uninterrupted


def test_epochs_k_gives_exactly_k_epochs_and_the_default_one(sel: Any) -> None:
    ld = sel.loader("resid", layers=[0], epochs=3, **KW)
    got = ids(ld)
    assert got == [r for e in range(3) for r in ld.epoch_rows(e).tolist()]
    assert ld.state_dict()["epoch"] == 3
    one = sel.loader("resid", layers=[0], **KW)
    assert ids(one) == one.epoch_rows(0).tolist() and ids(one) == one.epoch_rows(1).tolist()
    with pytest.raises(QueryError, match="epochs must be"):
        sel.loader("resid", layers=[0], epochs=0)
    with pytest.raises(QueryError, match="no rows per epoch"):
        next(iter(sel.loader("resid", layers=[0], epochs=None, batch_size=1000, drop_last=True)))


@pytest.mark.parametrize("workers", [0, 1])
def test_epochs_after_the_first_come_from_the_resident_window_with_the_same_values(
    sel: Any, workers: int
) -> None:
    """One window holds the whole selection: the epochs after the first are gathered from the first
    epoch's window (the store not read again); every batch's values are still the store's rows of its
    ids (Selection.features by position), in each epoch's own order."""
    import numpy as np

    feats = np.asarray(sel.features("resid", layers=[0]), dtype=np.float32)
    where = {r: k for k, r in enumerate(sel.rows.column("row").to_pylist())}
    kw = {**KW, "buffer_rows": len(sel), "workers": workers}
    ld = sel.loader("resid", layers=[0], epochs=3, **kw)
    got: list[int] = []
    for i, x in ld:
        np.testing.assert_array_equal(x.numpy(), feats[[where[r] for r in i.tolist()]])
        got += i.tolist()
    assert got == [r for e in range(3) for r in ld.epoch_rows(e).tolist()]
    assert ld._source.resident is not None  # the epochs after the first were not read from the store
