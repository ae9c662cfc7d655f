"""Corpus-wide statistics on a real Dask LocalCluster (2 worker processes) equal the in-process result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import actstore
from actstore.query.analyses.dask_tasks import Moments, feature_moments, relation_scores


def numpy_moments(
    store: Path, kind: str, where: str | None = None, **kw: Any
) -> tuple[np.ndarray, np.ndarray]:
    x = actstore.open(store).select(where).features(kind, **kw).astype(np.float64)
    return x.mean(0), x.var(0)


def test_moments_on_dask_equal_single_process(tiny_store: Path, client: Any) -> None:
    s = actstore.open(tiny_store)
    assert len(s.commits) >= 3  # several tasks
    for kind, kw in (
        ("attn_head", {"layers": [1]}),
        ("resid", {}),
        ("mlp_group", {"groups": 4, "heads": [0, 3]}),
    ):
        here = feature_moments(str(tiny_store), kind, client=None, **kw)
        there = feature_moments(str(tiny_store), kind, client=client, **kw)
        assert here.count == there.count == s.n_rows
        assert np.array_equal(here.mean, there.mean) and np.array_equal(here.m2, there.m2), kind
        mean, var = numpy_moments(tiny_store, kind, **kw)
        np.testing.assert_allclose(there.mean, mean, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(there.var, var, rtol=1e-9, atol=1e-12)


def test_grouped_moments_and_relation_scores(tiny_store: Path, client: Any) -> None:
    where = "relation_id IS NOT NULL"
    by_rel = feature_moments(
        str(tiny_store),
        "attn_head",
        rows=actstore.open(tiny_store).select(where),
        layers=[0],
        by="relation_id",
        client=client,
        rows_per_task=4,
    )
    s = actstore.open(tiny_store)
    sel = s.select(where)
    x = sel.features("attn_head", layers=[0]).astype(np.float64)
    rel = {
        r["example_id"]: r["relation_id"]
        for r in s.sql("SELECT example_id, relation_id FROM examples").to_pylist()
    }
    labels = np.array([rel[int(i)] for i in sel.example_ids])
    assert sorted(by_rel) == sorted(set(labels))
    for g, m in by_rel.items():
        np.testing.assert_allclose(m.mean, x[labels == g].mean(0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(m.var, x[labels == g].var(0), rtol=1e-9, atol=1e-12)

    names, d = relation_scores(str(tiny_store), "attn_head", rows=sel, layers=[0], client=client)
    names_here, d_here = relation_scores(str(tiny_store), "attn_head", rows=sel, layers=[0])
    assert names == names_here and np.array_equal(d, d_here)
    # Cohen's d with the pooled within-group variance, computed directly.
    from actstore.query.analyses.relspec import POOLED_EPS

    for i, g in enumerate(names):
        a, b = x[labels == g], x[labels != g]
        pooled = (np.square(a - a.mean(0)).sum(0) + np.square(b - b.mean(0)).sum(0)) / (len(x) - 2)
        want = (a.mean(0) - b.mean(0)) / np.sqrt(pooled + POOLED_EPS * x.var(0) + 1e-30)
        np.testing.assert_allclose(d[i], want, rtol=1e-7, atol=1e-9)


def test_moments_merge_is_exact_on_splits() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3, 2)) * 10 + 5
    parts = [Moments.of(x[i : i + 7]) for i in range(0, 50, 7)]
    m = parts[0]
    for p in parts[1:]:
        m = m.merge(p)
    np.testing.assert_allclose(m.mean, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(m.var, x.var(0), rtol=1e-12)
