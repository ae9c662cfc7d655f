"""Layer and head subsets of every feature kind equal the same slice of the full features.

``actstore.query.select.features`` reads contiguous layer/head ranges as views and other selections by
indexing; both paths must give the numbers of the full computation, in the order asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import actstore
from actstore.query.select.features import HEAD_KINDS, KINDS

LAYER_SETS = [[0], [1], [0, 1], [1, 0]]
HEAD_SETS = [None, [1, 2], [2, 0], [3]]


@pytest.mark.parametrize("kind", KINDS)
def test_subsets_match_full(tiny_store: Path, kind: str) -> None:
    store = actstore.open(tiny_store)
    sel = store.select()
    full = sel.features(kind)
    n_slots = store.geometry.n_layers + (1 if kind == "resid" else 0)
    layer_sets = [*LAYER_SETS, [n_slots - 1, 0]] if kind == "resid" else LAYER_SETS
    for layers in layer_sets:
        for heads in HEAD_SETS if kind in HEAD_KINDS else [None]:
            got = sel.features(kind, layers=layers, heads=heads)
            want = full[:, layers]
            if heads is not None:
                want = want[:, :, heads]
            if kind in ("attn_head_token", "attn_prob"):  # sources are padded to the longest row either way
                want = want[:, :, :, : got.shape[3]]
            assert got.shape == want.shape, (kind, layers, heads)
            np.testing.assert_allclose(
                got,
                want,
                rtol=1e-5,
                atol=1e-6 * float(np.abs(full).max()),
                err_msg=f"{kind} layers={layers} heads={heads}",
            )
