"""Agreement against chance (query/methods/chance.py): a planted signal checked against a hand
computation, the exact chance against brute-force enumeration of the within-stratum shuffles and
against the Monte Carlo permutations, and the pair table's columns."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from actstore.query.methods.chance import (
    coded_chance,
    coded_consensus_chance,
    consensus_chance,
    consensus_share,
    pair_chance,
    shuffles_within,
    stratum_chance,
    tolerance_kernel,
)
from actstore.query.methods.readings import MethodReading


def _reading(method: str, ids: list[int], keys: list[int], verdicts: list[str]) -> MethodReading:
    n = len(ids)
    return MethodReading(
        method,
        np.asarray(ids, np.int64),
        np.zeros((n, 6)),
        np.asarray(keys, np.int64),
        np.asarray(verdicts, dtype=object),
    )


# Two synthetic "methods" that agree on half of the facts, in two strata of 6 facts.
#   stratum s (facts 0-5):  A 0 1 2 3 4 5   B 0 1 2 4 5 3   agree on facts 0, 1, 2
#   stratum t (facts 6-11): A 2 2 2 3 3 3   B 2 2 2 0 0 0   agree on facts 6, 7, 8
A = [0, 1, 2, 3, 4, 5, 2, 2, 2, 3, 3, 3]
B = [0, 1, 2, 4, 5, 3, 2, 2, 2, 0, 0, 0]
STRATA = [0] * 6 + [1] * 6
# By hand (exact key layers):
#   observed 6 / 12 = 0.5
#   chance in s: every code once in A and in B -> sum_x h_A(x) h_B(x) / 36 = 6 / 36 = 1/6
#   chance in t: code 2 three times in both -> 9 / 36 = 1/4;   chance = (6/6 + 6/4) / 12 = 5/24
#   excess = 1/2 - 5/24 = 7/24
#   pooled: h_A = (1, 1, 4, 4, 1, 1), h_B = (4, 1, 4, 1, 1, 1) -> p_e = (4+1+16+4+1+1) / 144 = 27/144
#   kappa = (1/2 - 27/144) / (1 - 27/144) = 45 / 117 = 5/13
HAND = {"value": 0.5, "chance": 5 / 24, "excess": 7 / 24, "chance_pooled": 27 / 144, "kappa": 5 / 13}


def test_planted_signal_gives_the_hand_computed_kappa_and_excess() -> None:
    f = coded_chance(np.array(A), np.array(B), np.array(STRATA), tolerance_kernel(6, 0), resamples=500)
    for name, want in HAND.items():
        assert getattr(f, name) == pytest.approx(want, abs=1e-12), name
    assert f.n == 12
    assert f.excess_low <= f.excess <= f.excess_high and f.kappa_low <= f.kappa <= f.kappa_high
    assert f.null_low <= f.chance <= f.null_high
    # the same facts through MethodReadings and verdict-free pairs: the same figure
    ra = _reading("trace", list(range(12)), A, [""] * 12)
    rb = _reading("patch", list(range(12)), B, [""] * 12)
    got = pair_chance(ra, rb, 0, {i: "st"[s] for i, s in enumerate(STRATA)}, resamples=200)
    assert got["key_layer"].excess == pytest.approx(7 / 24) and got["key_layer"].kappa == pytest.approx(
        5 / 13
    )
    assert got["verdict"].n == 0 and np.isnan(got["verdict"].value)


def test_planted_verdicts_give_cohens_kappa() -> None:
    # 10 facts, one stratum; the verdicts agree on half: A mlp x6 attn x4, B equal on facts 0-4.
    a = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    b = np.array([0, 0, 0, 0, 0, 1, 0, 0, 0, 0])
    f = coded_chance(a, b, np.zeros(10, np.int64), np.eye(2), resamples=200)
    # p_o = 0.5, p_e = 0.6 x 0.9 + 0.4 x 0.1 = 0.58, kappa = (0.5 - 0.58) / 0.42
    assert f.value == pytest.approx(0.5) and f.chance_pooled == pytest.approx(0.58)
    assert f.kappa == pytest.approx(-0.08 / 0.42) and f.chance == pytest.approx(0.58)
    assert f.excess == pytest.approx(-0.08)


def test_strata_matter() -> None:
    """Keys that depend on the stratum alone agree above the pooled chance but not above the
    within-stratum chance."""
    groups = np.repeat(np.arange(4), 25)
    rng = np.random.default_rng(0)
    a = groups * 3  # each stratum its own key
    b = groups * 3 + rng.integers(0, 2, 100)  # same, plus a jitter unrelated to the fact
    f = coded_chance(a, b, groups, tolerance_kernel(12, 0), resamples=200)
    assert f.kappa > 0.3 and f.excess == pytest.approx(0.0, abs=1e-12)
    assert f.p_value > 0.1


def test_exact_chance_equals_the_enumerated_shuffles() -> None:
    """Every within-stratum permutation of B enumerated (strata of 3 and 2 facts): the mean share
    is the exact chance, for a tolerance kernel."""
    a, b = np.array([0, 3, 5, 1, 1]), np.array([1, 5, 2, 0, 4])
    groups = np.array([0, 0, 0, 1, 1])
    W = tolerance_kernel(6, 1)
    shares = []
    for p0 in itertools.permutations([0, 1, 2]):
        for p1 in itertools.permutations([3, 4]):
            perm = np.array(list(p0) + list(p1))
            shares.append(W[a, b[perm]].mean())
    assert stratum_chance(a, b, groups, W).mean() == pytest.approx(np.mean(shares), abs=1e-12)


def test_shuffles_stay_within_strata_and_average_to_the_exact_chance() -> None:
    rng = np.random.default_rng(1)
    groups = rng.integers(0, 5, 60)
    a, b = rng.integers(0, 8, 60), rng.integers(0, 8, 60)
    perms = shuffles_within(groups, 4000, np.random.default_rng(2))
    assert (groups[perms] == groups[None, :]).all()
    assert all(sorted(p) == list(range(60)) for p in perms[:20])  # permutations
    assert len({tuple(p) for p in perms[:50]}) == 50  # and random
    W = tolerance_kernel(8, 1)
    mc = W[a[None, :], b[perms]].mean(axis=1)
    exact = stratum_chance(a, b, groups, W).mean()
    assert abs(mc.mean() - exact) < 4 * mc.std() / np.sqrt(mc.size)


def test_consensus_chance_by_enumeration_and_as_a_pair() -> None:
    # three methods, one stratum of 3 facts: shuffling methods 2 and 3 gives 3! x 3! arrangements
    keys = np.array([[0, 2, 4], [1, 2, 5], [4, 0, 2]])
    shares = []
    for p in itertools.permutations(range(3)):
        for q in itertools.permutations(range(3)):
            k = np.stack([keys[0], keys[1, list(p)], keys[2, list(q)]])
            shares.append(np.mean(k.max(axis=0) - k.min(axis=0) <= 2))
    f = coded_consensus_chance(keys, np.zeros(3, np.int64), 2, permutations=300, resamples=100)
    assert f.chance == pytest.approx(np.mean(shares), abs=1e-12)
    assert f.value == pytest.approx(np.mean(keys.max(axis=0) - keys.min(axis=0) <= 2))
    # for two methods the consensus formula is the pair's
    rng = np.random.default_rng(4)
    a, b, g = rng.integers(0, 10, 80), rng.integers(0, 10, 80), rng.integers(0, 3, 80)
    pair = coded_chance(a, b, g, tolerance_kernel(10, 2), resamples=300, seed=5)
    cons = coded_consensus_chance(np.stack([a, b]), g, 2, resamples=300, seed=5)
    for name in (
        "value",
        "chance",
        "kappa",
        "chance_pooled",
        "excess_low",
        "kappa_high",
        "null_low",
        "p_value",
    ):
        assert getattr(cons, name) == pytest.approx(getattr(pair, name), abs=1e-12), name


def test_consensus_share_of_independent_keys() -> None:
    F = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])  # two methods, keys in {0, 1} and {1, 2}
    assert consensus_share(F, 0) == pytest.approx(0.25)  # both at 1
    assert consensus_share(F, 1) == pytest.approx(0.75)  # all but (0, 2)
    assert consensus_share(F, 2) == pytest.approx(1.0)


def test_consensus_from_readings_skips_undefined_keys() -> None:
    r1 = _reading("trace", [1, 2, 3, 4], [0, 5, 3, -1], [""] * 4)
    r2 = _reading("patch", [1, 2, 3, 4, 5], [1, 5, 0, 2, 2], [""] * 5)
    f = consensus_chance([r1, r2], 1, None, permutations=100, resamples=100)
    assert f.n == 3 and f.value == pytest.approx(2 / 3)


def test_a_strong_signal_beats_every_shuffle() -> None:
    rng = np.random.default_rng(7)
    a = rng.integers(0, 18, 300)
    f = coded_chance(
        a, a.copy(), np.zeros(300, np.int64), tolerance_kernel(18, 2), permutations=1000, resamples=300
    )
    assert f.value == 1.0 and f.kappa == pytest.approx(1.0)
    assert f.p_value == pytest.approx(1 / 1001) and f.null_high < 0.5
    assert f.excess_low > 0.5
    # ... and independent keys sit at chance
    g = coded_chance(
        a, rng.integers(0, 18, 300), np.zeros(300, np.int64), tolerance_kernel(18, 2), resamples=300
    )
    assert g.excess_low < 0 < g.excess_high and g.kappa_low < 0 < g.kappa_high


def test_compute_metrics_writes_the_chance_columns() -> None:
    from actstore.query.methods.tables import CHANCE_COLUMNS, PAIRS, compute_metrics

    ra = _reading("trace", list(range(12)), A, ["mlp"] * 6 + ["attn"] * 6)
    rb = _reading("patch", list(range(12)), B, ["mlp"] * 12)
    strata = {"relation": {i: "r" for i in range(12)}, "stratum": {i: "st"[s] for i, s in enumerate(STRATA)}}
    res = compute_metrics([ra, rb], strata, tolerance=0, resamples=200)
    assert res.pairs.schema.equals(PAIRS) and res.null_grouping == "stratum"
    rows = {r["metric"]: r for r in res.pairs.to_pylist()}
    assert rows["key_layer"]["value"] == pytest.approx(0.5)  # the raw figure is kept
    assert rows["key_layer"]["excess"] == pytest.approx(7 / 24)
    assert rows["key_layer"]["kappa"] == pytest.approx(5 / 13)
    assert rows["consensus"]["chance"] == pytest.approx(5 / 24)  # two methods: the pair's chance
    assert rows["verdict"]["kappa"] == pytest.approx(0.0)  # B says mlp always: p_e = p_o
    assert all(rows["key_layer"][c] is not None for c in CHANCE_COLUMNS)
    # without the stratum grouping the null falls back to the relation (one stratum here)
    res2 = compute_metrics([ra, rb], {"relation": strata["relation"]}, tolerance=0, resamples=200)
    rows2 = {r["metric"]: r for r in res2.pairs.to_pylist()}
    assert res2.null_grouping == "relation" and rows2["key_layer"]["chance"] == pytest.approx(27 / 144)
