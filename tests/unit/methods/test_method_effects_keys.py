"""Effects relative to p_clean (query/methods/effects.py), key-layer variants (query/methods/keys.py)
and ROME's filter (query/methods/study.py), each against a computation written here."""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from actstore.interventions.trace_results import window_layers
from actstore.query.methods.effects import effect_forms, logit, partial_correlation
from actstore.query.methods.keys import (
    centre_keys,
    lens_keys,
    patch_position_readings,
    rekey,
    trace_window,
    window_contains,
    window_kernel,
    window_range,
)
from actstore.query.methods.metrics import subset_reading
from actstore.query.methods.readings import MethodReading, patch_reading
from actstore.query.methods.study import rome_filter, trace_clean_probabilities, trace_total_effects


class FakeStore:
    """The two calls the readings make of a store (``sql``, ``table_files``) over Arrow tables."""

    url = "fake://"

    def __init__(self, **tables: pa.Table) -> None:
        self.con = duckdb.connect()
        for name, t in tables.items():
            self.con.register(name, t)
        self.names = list(tables)

    def table_files(self) -> dict[str, list[str]]:
        return {n: [f"tables/{n}/x.parquet"] for n in self.names}

    def sql(self, query: str, params: Any = None) -> pa.Table:
        return self.con.sql(query, params=params).to_arrow_table()


# ------------------------------------------------------------------------------------ effects


def _site_effects() -> pa.Table:
    return pa.table(
        {
            "example_id": [1, 1, 2, 3],
            "mode": ["knockout", "knockout", "knockout", "restore"],
            "component": ["mlp", "mlp", "attn", "mlp"],
            "layer": [0, 2, 1, 0],
            "random": [False, True, False, False],
            "p_base": [0.8, 0.8, 0.5, 0.1],
            "p_intervened": [0.2, 0.6, 0.4, 0.3],
            "effect": [0.6, 0.2, 0.1, 0.2],
        }
    )


def test_effect_forms_by_hand() -> None:
    forms = effect_forms(_site_effects(), {3: 0.4})
    # p_clean: facts 1 and 2 from their knock-out rows' p_base only when none is given; here 3 only
    rel = forms["relative"].column("effect").to_pylist()
    assert np.isnan(rel[0]) and rel[3] == pytest.approx(0.2 / 0.4)
    forms = effect_forms(_site_effects())  # p_clean from the knock-out rows
    np.testing.assert_allclose(
        forms["relative"].column("effect").to_pylist()[:3], [0.6 / 0.8, 0.2 / 0.8, 0.1 / 0.5]
    )
    assert np.isnan(forms["relative"].column("effect").to_pylist()[3])  # a restore row has no p_clean there
    lo = forms["logodds"].column("effect").to_pylist()
    assert lo[0] == pytest.approx(
        np.log(0.8 / 0.2) - np.log(0.2 / 0.8)
    )  # knock-out: logit(clean) - logit(out)
    assert lo[3] == pytest.approx(
        np.log(0.3 / 0.7) - np.log(0.1 / 0.9)
    )  # restore: logit(restored) - logit(corrupt)
    assert forms["raw"].equals(_site_effects())
    assert np.isfinite(logit(np.array([0.0, 1.0]))).all()  # clipped


def test_partial_correlation_is_the_residual_correlation() -> None:
    rng = np.random.default_rng(0)
    c = rng.uniform(0.1, 1.0, 300)  # p_clean
    a = 0.9 * c + rng.normal(0, 0.05, 300)  # both effects remove most of p_clean ...
    b = 0.8 * c + rng.normal(0, 0.05, 300)  # ... and nothing else in common
    x = np.stack([np.ones_like(c), c], axis=1)
    ra = a - x @ np.linalg.lstsq(x, a, rcond=None)[0]
    rb = b - x @ np.linalg.lstsq(x, b, rcond=None)[0]
    want = np.corrcoef(ra, rb)[0, 1]
    s = partial_correlation(a, b, c, resamples=500)
    assert s.value == pytest.approx(want, abs=1e-10) and s.n == 300
    assert np.corrcoef(a, b)[0, 1] > 0.9 and abs(s.value) < 0.2  # raw r measures p_clean
    assert s.low < s.value < s.high
    shared = rng.normal(0, 0.05, 300)  # a common part beyond p_clean survives
    assert partial_correlation(a + shared, b + shared, c, resamples=100).value > 0.4
    a[0] = np.nan
    assert partial_correlation(a, b, c, resamples=50).n == 299


# ------------------------------------------------------------------------------------ key variants


@pytest.mark.parametrize("window", [1, 3, 10])
def test_window_range_is_romes_window(window: int) -> None:
    for label in range(18):
        got = window_range(label, window, 18)
        want = window_layers(label, window, 18)
        assert got == (want.start, want.stop - 1)


def test_centre_keys_by_hand() -> None:
    keys = np.array([8, 0, 17, -1, 4])
    # window 10 on 18 layers: label 8 restores 3..12 (centre 7.5 -> 7), 0 restores 0..4 (2),
    # 17 restores 12..17 (14.5 -> 14), 4 restores 0..8 (4)
    np.testing.assert_array_equal(centre_keys(keys, 10, 18), [7, 2, 14, -1, 4])
    # odd window 3: symmetric, the centre is the label, except where it is clipped (17 restores 16..17)
    np.testing.assert_array_equal(centre_keys(keys, 3, 18), [8, 0, 16, -1, 4])
    np.testing.assert_array_equal(centre_keys(keys, 1, 18), [8, 0, 17, -1, 4])


def _reading(
    method: str, ids: list[int], keys: list[int], mlp: Any = None, attn: Any = None
) -> MethodReading:
    n = len(ids)
    return MethodReading(
        method,
        np.asarray(ids, np.int64),
        np.zeros((n, 4)),
        np.asarray(keys, np.int64),
        np.asarray(["mlp"] * n, dtype=object),
        mlp,
        attn,
    )


def test_window_contains_by_hand() -> None:
    tr = _reading("trace", [1, 2, 3], [5, 5, -1])
    other = _reading("patch", [1, 2, 3], [9, 10, 4])
    ids, inside = window_contains(tr, other, 10, 18)  # label 5 restores 0..9
    np.testing.assert_array_equal(ids, [1, 2])
    np.testing.assert_array_equal(inside, [1.0, 0.0])
    W = window_kernel(10, 18)
    assert W[5, 9] == 1 and W[5, 10] == 0 and W[0].sum() == 5 and W[17].sum() == 6  # clipped at the edges


def test_lens_keys_by_hand() -> None:
    # 2 facts, 4 blocks: residual indices 0..4, index 4 the model's output
    prob = np.array([[0.0, 0.01, 0.2, 0.3, 0.5], [0.0, 0.0, 0.0, 0.1, 0.12]])
    rank = np.array([[900, 50, 3, 0, 0], [800, 12, 9, 2, 0]])
    k = lens_keys(prob, rank)
    np.testing.assert_array_equal(k["top10"], [1, 1])  # block 1's output h_2 is the first with rank < 10
    np.testing.assert_array_equal(k["half"], [2, 2])  # 0.3 >= 0.25 at h_3; 0.1 >= 0.06 at h_3
    never = lens_keys(prob, np.full((2, 5), 20))
    np.testing.assert_array_equal(never["top10"], [-1, -1])


def test_rekey_splits_a_lens_verdict_at_the_new_key() -> None:
    d_mlp = np.array([[0.1, 0.0, 0.5, 0.0]])
    d_attn = np.array([[0.0, 0.3, 0.1, 0.0]])
    lens = MethodReading(
        "logit_lens",
        np.array([1]),
        d_mlp + d_attn,
        np.array([2]),
        np.array(["mlp"], dtype=object),
        d_mlp,
        d_attn,
    )
    assert rekey(lens, np.array([1]), "logit_lens@x").verdict.tolist() == ["attn"]
    assert rekey(lens, np.array([-1]), "logit_lens@x").verdict.tolist() == [""]
    trace = _reading("trace", [1], [2])
    moved = rekey(trace, np.array([0]), "trace@x")
    assert moved.verdict.tolist() == ["mlp"] and moved.key_layer.tolist() == [0] and moved.method == "trace@x"


def _patch_effects() -> pa.Table:
    rows = []
    # fact 7: the subject's last token peaks at layer 0 (MLP), the last token at layer 3 (attention)
    sub = {"mlp": [0.9, 0.2, 0.0, 0.0], "attn": [0.1, 0.0, 0.0, 0.0]}
    last = {"mlp": [0.0, 0.0, 0.1, 0.2], "attn": [0.0, 0.0, 0.3, 0.95]}
    for pos, grid in (("subject_last", sub), ("last", last)):
        for comp, vals in grid.items():
            for layer, v in enumerate(vals):
                rows.append(("p1", 7, comp, layer, -1, pos, v))
    rows.append(("p1", 7, "attn", 3, 0, "last", 5.0))  # a head row: never read
    cols = list(zip(*rows))
    return pa.table(
        {
            "run_id": list(cols[0]),
            "example_id": list(cols[1]),
            "component": list(cols[2]),
            "layer": pa.array(cols[3], pa.int32()),
            "head": pa.array(cols[4], pa.int32()),
            "position": list(cols[5]),
            "recovery": list(cols[6]),
        }
    )


def test_patch_readings_per_position() -> None:
    store = FakeStore(patch_effects=_patch_effects())
    both = patch_reading(store, "p1", plateau=1.0)
    v = patch_position_readings(store, ["p1"], plateau=1.0)
    assert v["patch@subject_last"].key_layer.tolist() == [0] and v["patch@subject_last"].verdict.tolist() == [
        "mlp"
    ]
    assert v["patch@last"].key_layer.tolist() == [3] and v["patch@last"].verdict.tolist() == ["attn"]
    assert both.key_layer.tolist() == [3]  # the max over positions: 0.95 at the last token
    np.testing.assert_allclose(both.mlp[0], [0.9, 0.2, 0.1, 0.2])  # max over the two positions
    with pytest.raises(Exception, match="unknown patch position"):
        patch_reading(store, "p1", position="subject_first")


def _trace_facts() -> pa.Table:
    return pa.table(
        {
            "run_id": ["t1", "t1", "t1", "t2"],
            "example_id": [1, 2, 3, 4],
            "total_effect": [0.3, 0.0, -0.1, 0.05],
            "p_clean": [0.4, 0.2, 0.1, 0.9],
            "window": pa.array([10, 10, 10, 10], pa.int32()),
        }
    )


def test_rome_filter_and_its_counts() -> None:
    store = FakeStore(trace_facts=_trace_facts())
    te = trace_total_effects(store, ["t1", "t2"])
    assert te == {1: 0.3, 2: 0.0, 3: -0.1, 4: 0.05}
    assert trace_clean_probabilities(store, ["t2"]) == {4: 0.9}
    assert trace_window(store, ["t1", "t2"]) == 10
    f = rome_filter(te, {1: "a", 2: "a", 3: "b", 4: "b"})
    assert f.kept.tolist() == [1, 4] and f.removed.tolist() == [2, 3]  # TE <= 0 removed (0 included)
    assert f.removed_per_stratum == {"a": 1, "b": 1} and f.facts_per_stratum == {"a": 2, "b": 2}
    strict = rome_filter(te, {1: "a", 2: "a", 3: "b", 4: "b"}, threshold=0.1)
    assert strict.kept.tolist() == [1] and strict.removed_per_stratum == {"a": 1, "b": 2}
    r = subset_reading(_reading("trace", [1, 2, 3, 4], [0, 1, 2, 3]), f.kept)
    assert r.example_ids.tolist() == [1, 4] and r.key_layer.tolist() == [0, 3]
