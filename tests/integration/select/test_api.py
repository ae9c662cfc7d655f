"""The Python API (issue 15): lazy selections, labelled and chunked features, the torch dataset, Store.sql.

Every result is compared with a computation that does not go through the selection's plan: numpy
masks over the ``examples`` and ``targets`` tables read whole, ``Selection.features`` of the same
rows, and the attention probabilities themselves (positive exactly on the stored sources).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
from actstore.core.errors import ActstoreError, QueryError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def store_path(store_factory: Callable[..., Path]) -> Path:
    """Tiny Llama over the demo corpus, 6 facts per relation: 36 rows in 5 segments of at most 8."""
    return store_factory("llama", limit=6)


@pytest.fixture(scope="module")
def store(store_path: Path) -> actstore.Store:
    return actstore.open(store_path)


@pytest.fixture(scope="module")
def frame(store: actstore.Store) -> pd.DataFrame:
    """Every target row with its example's columns, read whole, in store row order."""
    t = store.table("targets").to_pandas()
    e = store.table("examples").to_pandas().drop(columns=["segment"])
    return t.merge(e, on="example_id").sort_values("row").reset_index(drop=True)


# -- lazy composition ---------------------------------------------------------------------------

# Filters with their numpy meaning, over the frame above.
FILTERS: list[tuple[str, Callable[[Any], Any], Callable[[pd.DataFrame, Any], np.ndarray]]] = [
    ("subject_start >= $k", lambda v: {"k": v}, lambda f, v: (f.subject_start >= v).to_numpy()),
    ("length(text) < ?", lambda v: [v + 25], lambda f, v: (f.text.str.len() < v + 25).to_numpy()),
    ("n_tokens % 2 = $m", lambda v: {"m": v % 2}, lambda f, v: (f.n_tokens % 2 == v % 2).to_numpy()),
    ("example_id <> ?", lambda v: [v], lambda f, v: (f.example_id != v).to_numpy()),
]

step = st.one_of(
    st.tuples(st.just("filter"), st.integers(0, len(FILTERS) - 1), st.integers(0, 12)),
    st.tuples(st.just("relations"), st.lists(st.integers(0, 5), min_size=1, max_size=3), st.just(0)),
    st.tuples(st.just("limit"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("sample"), st.integers(0, 40), st.integers(0, 2**31)),
    st.tuples(st.just("split"), st.sampled_from([(0.5, 0.5), (0.7, 0.2), 3]), st.integers(0, 2**31)),
)


# A composed relations() step may name a relation with no rows left: that warning is tested in
# tests/cli/cli/test_examples.py; here only the rows count.
@pytest.mark.filterwarnings("ignore::actstore.core.errors.EmptySelectionWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, max_size=5), base=st.sampled_from([None, "split = ''", "subject_start > 2"]))
def test_composition_equals_numpy_masks(
    store: actstore.Store, frame: pd.DataFrame, steps: list[Any], base: str | None
) -> None:
    """Filters, relations and limits give exactly the rows numpy picks from the whole tables; samples
    and split parts are subsets of the rows numpy says they draw from, of the stated sizes."""
    rels = sorted(frame.relation_id.unique())
    sel = store.select(base)
    keep = (
        np.ones(len(frame), bool)
        if base is None
        else {
            "split = ''": (frame.split == "").to_numpy(),
            "subject_start > 2": (frame.subject_start > 2).to_numpy(),
        }[base]
    )
    now = np.flatnonzero(keep)  # positions in frame, store order
    for kind, a, b in steps:
        if kind == "filter":
            text, params, mask = FILTERS[a]
            sel = sel.filter(text, params(b))
            now = now[mask(frame, b)[now]]
        elif kind == "relations":
            names = [rels[i] for i in a]
            sel = sel.relations(names)
            now = now[np.isin(frame.relation_id.to_numpy()[now], names)]
        elif kind == "limit":
            sel = sel.limit(a)
            now = now[:a]
        elif kind == "sample":
            sel = sel.sample(a, seed=b)
            got = frame.index[frame.row.isin(sel.rows.column("row").to_numpy())].to_numpy()
            assert len(got) == min(a, len(now)) and set(got) <= set(now)
            now = got
        else:
            parts = sel.split(a, seed=b)
            sizes = [len(p) for p in parts]
            fr = (1 / 3,) * 3 if a == 3 else a
            cum = np.floor(np.cumsum(fr) * len(now) + 0.5).astype(int)
            if abs(sum(fr) - 1) < 1e-9:
                cum[-1] = len(now)
            assert sizes == np.diff(np.concatenate([[0], cum])).tolist()
            seen = [set(p.rows.column("row").to_pylist()) for p in parts]
            assert all(not (x & y) for i, x in enumerate(seen) for y in seen[i + 1 :])  # disjoint
            assert set().union(*seen) <= set(frame.row.to_numpy()[now])
            sel = parts[0]
            now = frame.index[frame.row.isin(seen[0])].to_numpy()
    want = frame.iloc[now]
    assert sel.example_ids.tolist() == want.example_id.tolist()
    assert sel.rows.column("row").to_pylist() == want.row.tolist()  # store order throughout


def test_nothing_is_read_until_asked(store: actstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import actstore.query.select.features
    import actstore.query.select.plan as plan
    import actstore.query.select.selection as qs

    calls: list[str] = []
    real_sql, real_block = plan.run_sql, qs.compute_block

    def sql(*a: Any, **k: Any) -> Any:
        calls.append("sql")
        return real_sql(*a, **k)

    def block(*a: Any, **k: Any) -> Any:
        calls.append("block")
        return real_block(*a, **k)

    monkeypatch.setattr(plan, "run_sql", sql)  # the plan's steps run the selection's SQL
    monkeypatch.setattr(qs, "compute_block", block)
    monkeypatch.setattr(actstore.query.select.features, "compute_block", block)
    sel = (
        store.select("subject_start > $k", params={"k": 1})
        .filter("n_tokens > ?", [5])
        .relations(["city_country", "element_symbol"])
        .sample(8, seed=3)
    )
    train, test = sel.split((0.75, 0.25), seed=1)
    assert calls == []  # a plan only
    assert sel.plan[-1] == "sample(8, seed=3)" and len(train.plan) == 5
    n_train, n_test = len(train), len(test)
    assert calls.count("sql") == 2  # the base query and the one filter, run once for both parts
    assert n_train + n_test == len(sel) == 8 and calls.count("sql") == 2
    assert "block" not in calls
    train.features("attn_head", layers=[0])
    assert "block" in calls


def test_plan_arguments_are_checked_when_made(store: actstore.Store) -> None:
    sel = store.select()
    for bad in (
        lambda: sel.filter("1) UNION SELECT (1"),
        lambda: sel.filter("x = 1; DROP VIEW examples"),
        lambda: sel.limit(-1),
        lambda: sel.sample(2.5),  # type: ignore[arg-type]
        lambda: sel.split((0.8, 0.4)),
        lambda: sel.split(1),
        lambda: sel.relations([]),
        lambda: sel.split(by="split"),  # type: ignore[arg-type]
        lambda: sel.filter("relation_id = ?", "P17"),
    ):  # a string is not a parameter list
        with pytest.raises(QueryError):
            bad()


def test_filter_values_are_bound_not_pasted(store: actstore.Store, frame: pd.DataFrame) -> None:
    rel = frame.relation_id.iloc[0]
    assert len(store.select().filter("relation_id = ?", [rel])) == int((frame.relation_id == rel).sum())
    assert len(store.select().filter("relation_id = ?", [f"{rel}' OR '1'='1"])) == 0
    with pytest.warns(actstore.EmptySelectionWarning, match="no rows for"):  # a value, named as such
        assert len(store.select().relations([f"{rel}' OR '1'='1"])) == 0


def test_split_by_relation_and_stratified(store: actstore.Store, frame: pd.DataFrame) -> None:
    sel = store.select()
    counts = frame.relation_id.value_counts()
    for seed in range(4):
        a, b = sel.split((0.5, 0.5), seed=seed, by="relation")
        ra, rb = (
            set(a.table(["relation_id"]).column(0).to_pylist()),
            set(b.table(["relation_id"]).column(0).to_pylist()),
        )
        assert not ra & rb and ra | rb == set(counts.index) and len(ra) == len(rb) == len(counts) // 2
        assert len(a) == int(counts[list(ra)].sum())
        parts = sel.split((0.5, 0.5), seed=seed, stratify=True)
        for p in parts:
            per = pd.Series(p.table(["relation_id"]).column(0).to_pylist()).value_counts()
            assert (per.reindex(counts.index) == counts // 2).all()  # 6 facts per relation: 3 and 3
    a1, _ = sel.split(seed=5)
    a2, _ = sel.split(seed=5)
    a3, _ = sel.split(seed=6)
    assert a1.example_ids.tolist() == a2.example_ids.tolist() != a3.example_ids.tolist()


def test_table_is_the_examples_rows_in_selection_order(store: actstore.Store, frame: pd.DataFrame) -> None:
    sel = store.select().sample(11, seed=2)
    t = sel.table().to_pandas()
    want = frame[frame.row.isin(sel.rows.column("row").to_numpy())]
    assert t.row.tolist() == want.row.tolist()
    for c in ("example_id", "relation_id", "text", "subject", "subject_start"):
        assert t[c].tolist() == want[c].tolist(), c
    with pytest.raises(QueryError, match="no column"):
        sel.table(["no_such_column"])


# -- features: numpy, torch, xarray, dask ---------------------------------------------------------

CASES = [
    ("attn_head_token", {"layers": [1], "heads": [0, 2]}, ("row", "layer", "head", "source", "d_model")),
    ("attn_prob", {}, ("row", "layer", "head", "source")),
    ("attn_head", {"layers": [0, 1]}, ("row", "layer", "head", "d_model")),
    ("z", {"heads": [3, 1]}, ("row", "layer", "head", "d_head")),
    ("mlp_group", {"groups": 4, "heads": [1, 3]}, ("row", "layer", "group", "d_model")),
    ("resid", {"layers": [0, 2]}, ("row", "layer", "d_model")),
    ("attn", {}, ("row", "layer", "d_model")),
]


@pytest.mark.parametrize(("kind", "kw", "dims"), CASES, ids=[c[0] for c in CASES])
def test_xarray_equals_numpy_with_the_tables_coordinates(
    store: actstore.Store, frame: pd.DataFrame, kind: str, kw: dict[str, Any], dims: tuple[str, ...]
) -> None:
    sel = store.select("subject_start > 1").limit(20)
    x = sel.features(kind, **kw)
    da = sel.to_xarray(kind, **kw)
    assert da.dims == dims and da.name == kind
    np.testing.assert_array_equal(da.values, x)
    np.testing.assert_array_equal(sel.features(kind, output="xarray", **kw).values, x)
    assert torch.equal(sel.features(kind, output="torch", **kw), torch.from_numpy(x))
    want = frame[frame.subject_start > 1].head(20)
    assert da.example_id.values.tolist() == want.example_id.tolist()
    assert da.relation_id.values.tolist() == want.relation_id.tolist()
    g = store.geometry
    n_layers = g.n_layers + 1 if kind == "resid" else g.n_layers
    assert da.layer.values.tolist() == kw.get("layers", list(range(n_layers)))
    if "head" in dims:
        assert da["head"].values.tolist() == kw.get("heads", list(range(g.n_heads)))
    if "group" in dims:
        assert da.group.values.tolist() == kw["heads"]
    if "source" in dims:
        S = int(want.n_src.max())
        assert da.sizes["source"] == S
        mask = np.arange(S)[None, :] < want.n_src.to_numpy()[:, None]
        np.testing.assert_array_equal(da.mask.values, mask)
        other = tuple(i for i, d in enumerate(dims) if d not in ("row", "source"))
        if kind == "attn_prob":  # softmax: positive on every stored source, and nowhere else
            np.testing.assert_array_equal((x > 0).all(axis=other), mask)
            np.testing.assert_allclose(x.sum(axis=3), 1.0, rtol=1e-5)
        else:
            assert not np.abs(x).max(axis=other)[~mask].any()  # padding is zero
            assert (np.abs(x).max(axis=other)[mask] > 0).all()
        # a labelled selection works on names: the padded sources drop out of a masked mean
        masked = da.where(da.mask).mean("source", skipna=True)
        np.testing.assert_allclose(
            masked.values,
            x.sum(axis=3) / want.n_src.to_numpy().reshape((-1,) + (1,) * (x.ndim - 2)),
            rtol=1e-5,
            atol=1e-7,
        )


@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("attn_head_token", {"layers": [1]}),
        ("attn_prob", {"heads": [2]}),
        ("mlp", {}),
        ("z", {"layers": [0]}),
    ],
)
def test_dask_chunks_by_segment_and_equals_features(
    store: actstore.Store, frame: pd.DataFrame, kind: str, kw: dict[str, Any]
) -> None:
    sel = store.select().filter("example_id % 3 <> 0")
    d = sel.to_dask(kind, **kw)
    x = sel.features(kind, **kw)
    want = frame[frame.example_id % 3 != 0]
    assert d.chunks[0] == tuple(want.groupby("segment").size().tolist())  # one chunk per segment
    assert d.shape == x.shape and d.dtype == x.dtype
    np.testing.assert_array_equal(d.compute(scheduler="synchronous"), x)
    lab = sel.to_xarray(kind, chunked=True, **kw)
    assert lab.chunks is not None and lab.chunks[0] == d.chunks[0]
    np.testing.assert_array_equal(lab.compute(scheduler="synchronous").values, x)
    # dask's default threaded scheduler: torch's matmuls split the work differently when blocks run
    # concurrently (float32 sums in another order), so equal to rounding
    np.testing.assert_allclose(lab.compute().values, x, rtol=1e-5, atol=1e-8)
    assert lab.example_id.values.tolist() == want.example_id.tolist()
    d4 = sel.to_dask(kind, batch_rows=4, **kw)
    assert max(d4.chunks[0]) <= 4 and sum(d4.chunks[0]) == len(want)
    # smaller matrix products round differently (float32): equal to rounding
    np.testing.assert_allclose(d4.compute(scheduler="threads"), x, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(d4.mean(axis=0).compute(), x.mean(axis=0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_rows", [1, 5, 9, 10_000])
def test_dask_chunk_rows_joins_consecutive_segments(
    store: actstore.Store, frame: pd.DataFrame, chunk_rows: int
) -> None:
    """``chunk_rows``: runs of consecutive segments of at most that many rows (a larger segment alone),
    the values those of ``features``."""
    sel = store.select().filter("example_id % 3 <> 0")
    sizes = frame[frame.example_id % 3 != 0].groupby("segment").size().tolist()
    want: list[int] = []
    for n in sizes:  # an independent grouping of the per-segment sizes
        if want and want[-1] + n <= chunk_rows:
            want[-1] += n
        else:
            want.append(n)
    d = sel.to_dask("resid", layers=[1], chunk_rows=chunk_rows)
    assert d.chunks[0] == tuple(want)
    np.testing.assert_array_equal(d.compute(scheduler="synchronous"), sel.features("resid", layers=[1]))
    with pytest.raises(QueryError, match="chunk_rows must be at least 1"):
        sel.to_dask("resid", chunk_rows=0)


def test_dask_missing_names_the_extra(store: actstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dask", None)
    monkeypatch.setitem(sys.modules, "dask.array", None)
    with pytest.raises(QueryError, match=r"actstore\[dask\]"):
        store.select().to_dask("z")


def test_one_segment_is_returned_without_a_copy(
    store: actstore.Store, frame: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    import actstore.query.select.selection as qs

    made: list[np.ndarray] = []
    real = qs.compute_block

    def spy(*a: Any, **k: Any) -> np.ndarray:
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(qs, "compute_block", spy)
    seg = int(frame.segment.iloc[-1])
    for kind in ("resid", "attn_head", "attn_head_token"):
        made.clear()
        x = store.select("segment = ?", params=[seg]).features(kind, layers=[1])
        assert len(made) == 1 and x is made[0] and np.shares_memory(x, made[0]), kind
    made.clear()
    x = store.select().features("attn_head_token", layers=[0])  # several segments: written once
    assert len(made) == frame.segment.nunique()
    at = 0
    for part in made:  # each block in its place, padded with zeros
        np.testing.assert_array_equal(x[at : at + len(part), :, :, : part.shape[3]], part)
        assert not x[at : at + len(part), :, :, part.shape[3] :].any()
        at += len(part)
    assert at == len(x)


# -- the torch dataset ----------------------------------------------------------------------------


def _stack(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    return torch.stack([a for a, _ in items]).numpy(), torch.stack([b for _, b in items]).numpy()


def test_feature_dataset_streams_the_rows_in_order(store: actstore.Store, frame: pd.DataFrame) -> None:
    sel = store.select().filter("subject_start >= 1")
    ds = actstore.FeatureDataset(sel, "attn_head_token", layers=[1], batch_rows=3)
    x = sel.features("attn_head_token", layers=[1])
    xs, ys = _stack(list(ds))
    assert len(ds) == len(xs) == len(x)
    np.testing.assert_array_equal(xs, x)
    rel = frame[frame.subject_start >= 1].relation_id.tolist()
    assert ds.classes == sorted(set(rel)) and [ds.classes[i] for i in ys] == rel
    loader = torch.utils.data.DataLoader(ds, batch_size=5)
    batches = list(loader)
    assert [len(b[0]) for b in batches][:-1] == [5] * (len(batches) - 1)
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), x)
    flat = actstore.FeatureDataset(sel, "mlp", label="split", flatten=True)
    fx, fy = _stack(list(flat))
    np.testing.assert_array_equal(fx, sel.features("mlp").reshape(len(sel), -1))
    assert flat.classes == sorted(set(frame[frame.subject_start >= 1].split)) and (fy >= 0).all()
    none = actstore.FeatureDataset(sel, "z", label=None)
    assert (_stack(list(none))[1] == -1).all()


def _positions(xs: np.ndarray, x: np.ndarray) -> list[int]:
    """For each row of ``xs`` the row of ``x`` it equals (rows of ``x`` are all different)."""
    flat = x.reshape(len(x), -1)
    return [int(np.flatnonzero((flat == r.reshape(-1)).all(axis=1))[0]) for r in xs]


def test_feature_dataset_shuffles_a_permutation_per_epoch(store: actstore.Store) -> None:
    sel = store.select()
    x = sel.features("attn_head", layers=[1])
    ds = actstore.FeatureDataset(sel, "attn_head", layers=[1], batch_rows=4, shuffle=True, seed=7)
    order0 = _positions(_stack(list(ds))[0], x)
    assert sorted(order0) == list(range(len(x))) and order0 != list(range(len(x)))
    assert _positions(_stack(list(ds))[0], x) == order0  # the same epoch, the same order
    ds.set_epoch(1)
    order1 = _positions(_stack(list(ds))[0], x)
    assert sorted(order1) == list(range(len(x))) and order1 != order0
    # the labels travel with their rows
    ys = _stack(list(ds))[1]
    rel = sel.table(["relation_id"]).column(0).to_pylist()
    assert [ds.classes[i] for i in ys] == [rel[i] for i in order1]


@pytest.mark.parametrize(
    ("kind", "batch_size", "shuffle"),
    [("attn_head_token", 5, False), ("attn_head", 3, True), ("mlp", 4, True), ("z", 1000, False)],
)
def test_feature_dataset_batches_equal_the_collated_rows(
    store: actstore.Store, kind: str, batch_size: int, shuffle: bool
) -> None:
    """``batch_size``: the batches a DataLoader collates from the row dataset, the same rows in the same
    order (shuffled too), batches cut across blocks of ``batch_rows`` rows; and the plain features."""
    sel = store.select().filter("subject_start >= 1")
    args: dict[str, Any] = dict(layers=[1], batch_rows=4, shuffle=shuffle, seed=3, flatten=kind == "mlp")
    rows = actstore.FeatureDataset(sel, kind, **args)
    batched = actstore.FeatureDataset(sel, kind, batch_size=batch_size, **args)
    for epoch in (0, 1):
        rows.set_epoch(epoch)
        batched.set_epoch(epoch)
        want = list(torch.utils.data.DataLoader(rows, batch_size=batch_size))
        got = list(torch.utils.data.DataLoader(batched, batch_size=None))
        assert len(got) == len(want) == len(batched) == -(-len(sel) // batch_size)
        for (gx, gy), (wx, wy) in zip(got, want):
            np.testing.assert_array_equal(gx.numpy(), wx.numpy())
            np.testing.assert_array_equal(gy.numpy(), wy.numpy())
    if not shuffle:
        x = sel.features(kind, layers=[1])
        np.testing.assert_array_equal(
            torch.cat([b[0] for b in got]).numpy(), x.reshape(len(x), *got[0][0].shape[1:])
        )
    with pytest.raises(QueryError, match="batch_size must be at least 1"):
        actstore.FeatureDataset(sel, kind, batch_size=0)


def test_feature_dataset_with_worker_processes(store: actstore.Store) -> None:
    sel = store.select()
    x = sel.features("z", layers=[0])
    ds = actstore.FeatureDataset(sel, "z", layers=[0], batch_rows=4)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = _positions(np.stack([a.numpy() for a, _ in loader]), x)
    assert sorted(got) == list(range(len(x)))  # every row once, whichever worker read it


# -- Store.sql and the facade ---------------------------------------------------------------------


def test_sql_formats_agree_and_bind_parameters(store: actstore.Store, frame: pd.DataFrame) -> None:
    q = "SELECT example_id, relation_id FROM examples WHERE subject_start >= $k ORDER BY example_id"
    arrow = store.sql(q, {"k": 4})
    pdf = store.sql(q, {"k": 4}, format="pandas")
    rel = store.sql(q, {"k": 4}, format="relation")
    want = frame[frame.subject_start >= 4].sort_values("example_id")
    assert arrow.column("example_id").to_pylist() == pdf.example_id.tolist() == want.example_id.tolist()
    assert rel.fetchall() == list(zip(want.example_id, want.relation_id))
    first = rel.filter("relation_id = 'city_country'").aggregate("count(*) AS n").fetchall()[0][0]
    assert first == int((want.relation_id == "city_country").sum())
    hostile = store.sql(
        "SELECT count(*) FROM examples WHERE relation_id = ?", ["x' OR '1'='1"], format="relation"
    )
    assert hostile.fetchall() == [(0,)]
    with pytest.raises(actstore.ReadOnlySQLError):
        store.sql("COPY examples TO 'x.csv'", format="relation")
    with pytest.raises(QueryError):
        store.sql("SELECT 1", format="json")  # type: ignore[call-overload]


def test_facade_names_and_ingest(tmp_path: Path) -> None:
    from actstore.query.select.feature_dataset import FeatureDataset
    from actstore.query.select.selection import Selection

    assert actstore.Selection is Selection and actstore.FeatureDataset is FeatureDataset
    assert callable(actstore.open) and callable(actstore.ingest_corpus)
    s = actstore.ingest_corpus(
        tmp_path / "s",
        model="tiny-llama",
        dataset="demo",
        limit_per_relation=2,
        storage_dtype="float32",
        batch_size=4,
        segment_size=8,
    )
    assert isinstance(s, actstore.Store)
    per = s.sql("SELECT relation_id, count(*) AS n FROM examples GROUP BY 1", format="pandas")
    assert len(per) == 6 and set(per.n) == {2} and s.n_rows == 12
    assert s.manifest.model["name"] == "tiny-llama" and s.manifest.storage_dtype == "float32"
    with pytest.raises(ActstoreError, match="unknown setting"):
        actstore.ingest_corpus(tmp_path / "t", model="tiny-llama", no_such_option=1)
