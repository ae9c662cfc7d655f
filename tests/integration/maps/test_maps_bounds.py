"""MAPS static scores at their edges: k = 1, token ids at the vocabulary's edge, a head subset.

Found by mutation testing (``make mutants``): the brute-force tests in test_maps.py use k = 1 and
10 on all heads with ids well inside the vocabulary, so an off-by-one in the k or vocabulary
check, or a head subset silently widened to every head, went unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import actstore
from actstore.core.errors import MapsError
from actstore.query.maps.pairs import TokenPairs
from actstore.query.maps.projection import VocabProjection
from actstore.query.maps.static import static_scores

pytestmark = pytest.mark.usefixtures("one_thread")


def pairs(src: list[int], dst: list[int], name: str = "r") -> TokenPairs:
    return TokenPairs(
        name,
        np.asarray(src, np.int64),
        np.asarray(dst, np.int64),
        n_pairs=len(src),
        n_multi_token=0,
        n_unknown=0,
    )


@pytest.fixture
def proj(store_factory: Callable[..., Path]) -> VocabProjection:
    return VocabProjection(actstore.open(store_factory("llama", limit=1)))


def test_k_of_one_is_allowed_and_zero_is_not(proj: VocabProjection) -> None:
    p = pairs([5, 6, 7], [8, 9, 10])
    one = static_scores(proj, [p], k_max=1)["r"]
    assert one.k_max == 1 and one.rank_up.shape == (3, *one.rank_up.shape[1:])
    assert set(np.unique(one.rank_up)) <= {0, 1}  # censored at k_max: 0 = top-1, 1 = not in the top 1
    with pytest.raises(MapsError, match="k must be at least 1, not 0"):
        static_scores(proj, [p], k_max=0)


def test_token_ids_must_lie_inside_the_vocabulary(proj: VocabProjection) -> None:
    V = proj.vocab_size
    last = static_scores(proj, [pairs([V - 1, 0], [0, V - 1])], k_max=2)["r"]  # the last id is a valid id
    assert (last.rank_up >= 0).all()
    for src, dst in (([V], [0]), ([0], [V])):
        with pytest.raises(
            MapsError, match=f"token ids exceed the store's vocabulary of {V}: wrong tokenizer"
        ):
            static_scores(proj, [pairs(src, dst)])


def test_a_head_subset_scores_those_heads_only_and_equals_the_full_run(proj: VocabProjection) -> None:
    p = [pairs([5, 6, 7, 5], [8, 9, 10, 11], "a"), pairs([12, 13], [14, 5], "b")]
    full = static_scores(proj, p, k_max=3)
    chosen = [(1, 2), (0, 3)]
    sub = static_scores(proj, p, k_max=3, heads=chosen)
    for name in ("a", "b"):
        mask = np.zeros(full[name].rank_up.shape[1:], bool)
        for layer, h in chosen:
            mask[layer, h] = True
        for attr in ("rank_up", "rank_down"):
            got, want = getattr(sub[name], attr), getattr(full[name], attr)
            np.testing.assert_array_equal(got[:, mask], want[:, mask])
            assert (got[:, ~mask] == -1).all(), f"{name}.{attr}: heads outside the subset were scored"
