"""Layer weights are stored one layer per chunk and read a layer at a time by a freshly opened store:
the features of a few layers equal those computed here with numpy from the whole stored weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import build_store

import actstore
from actstore.query.select.weights import weights


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("wl") / "s", limit=2)


def test_layer_weights_are_chunked_by_layer(store: Path) -> None:
    s = actstore.open(store)
    L = s.geometry.n_layers
    for name in ("W_O", "b_O", "W_down", "b_down", "W_V"):
        arr = s.weight_array(name)
        assert arr.shape[0] == L and arr.chunks[0] == 1 and s.layer_chunked(name), name
        for layer in range(L):
            np.testing.assert_array_equal(s.weight(name, layer), s.weight(name)[layer])
    assert not s.layer_chunked("embed")


@pytest.mark.parametrize("layers", [[1], [0], [0, 1], [1, 0]])
def test_a_fresh_store_reads_the_layers_it_needs(store: Path, layers: list[int]) -> None:
    s = actstore.open(store)
    sel = s.select()
    got = {k: sel.features(k, layers=layers) for k in ("attn_head", "attn", "mlp")}
    cache = weights(s)
    if len(layers) < s.geometry.n_layers:  # (all layers: the whole weight, one read)
        assert "W_O" not in cache._w and "W_down" not in cache._w  # the whole weights were never loaded
        assert {layer for name, layer in cache._by_layer if name == "W_O"} == set(layers)
    ref = actstore.open(store)
    z = ref.select().features("z", layers=layers).astype(np.float64)  # [n, l, H, dh]
    WO = ref.weight("W_O").astype(np.float64)[layers]
    np.testing.assert_allclose(got["attn_head"], np.einsum("nlhk,lhkd->nlhd", z, WO), rtol=1e-5, atol=1e-6)
    b_O = ref.weight("b_O").astype(np.float64)[layers]
    attn = np.einsum("nlhk,lhkd->nld", z, WO) + b_O[None]
    np.testing.assert_allclose(got["attn"], attn, rtol=1e-5, atol=1e-5)
    assert got["mlp"].shape[1] == len(layers)
