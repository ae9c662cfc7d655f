"""HeadScore and TokenScore: the factor-space TokenScore against materialised per-token features, and the
identity  sum_j TokenScore_l(j) + centering_l == sum_h HeadScore_{l,h}  per layer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import FIXTURES, fewrel_store_at
from hypothesis import given, settings
from hypothesis import strategies as st

import actstore
from actstore.cli import main
from actstore.jobs.probe import record_probe
from actstore.query.analyses.attribution import TokenGeometry, contrast_coefficients, token_scores
from actstore.query.analyses.explain import explain_example
from actstore.query.analyses.probe import ProbeConfig, run_probe
from actstore.query.select.selection import Selection

FEWREL_FIXTURE = FIXTURES / "fewrel" / "val_wiki.json"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fewrel_store(store_factory: Callable[..., Path]) -> Path:
    """The same float32 tiny-Llama store of the FewRel fixture as tests/integration/analyses/test_probe.py (built once per session)."""
    return fewrel_store_at(store_factory, FEWREL_FIXTURE)


@pytest.fixture(scope="module")
def runs(fewrel_store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A copy of the store with one small probe run per TokenScore kind (token scores for all predictions)."""
    dst = tmp_path_factory.mktemp("attr") / "store"
    shutil.copytree(fewrel_store, dst)
    store = actstore.open(dst)
    ids = {}
    for kind in ("attn_head", "attn_entity", "attn"):
        cfg = ProbeConfig(kind=kind, top_k=40, epochs=40, episodes=2, seeds=(0,), token_scores="all")
        out = run_probe(store, cfg)
        record_probe(store, out)
        ids[kind] = out.run_id
    return dst, ids


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=7))
def test_contrast_coefficients(logits: list[float]) -> None:
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1)
    pred = probs.argmax()
    c = contrast_coefficients(probs, pred)
    assert c[pred] == 1
    assert abs(float(c.sum())) < 1e-9  # dW = W_hat - (a convex combination of the competitors)
    others = torch.ones_like(c, dtype=torch.bool)
    others[pred] = False
    assert (c[others] <= 0).all()


@pytest.mark.parametrize("kind", ["attn_head", "attn_entity", "attn"])
def test_factor_space_token_scores_equal_materialised_contributions(fewrel_store: Path, kind: str) -> None:
    """TokenScore from (W_O u) . (A V) equals u . Delta_att,h(t, j) materialised per token."""
    store = actstore.open(fewrel_store)
    g = store.geometry
    layers, heads = (1,), (None if kind == "attn" else (0, 2))
    geo = TokenGeometry.of(store, kind, layers, heads)
    ex = [
        int(x)
        for x in store.sql(
            "SELECT example_id FROM examples WHERE subject_start > 0 ORDER BY example_id LIMIT 2"
        )
        .column(0)
        .to_pylist()
    ]
    per = len(geo.heads) * g.d_model if kind != "attn" else g.d_model
    u = torch.randn(2, len(layers) * per, dtype=torch.float32)
    got = token_scores(store, geo, ex, geo.project(u))
    full = Selection.from_ids(store, ex).features(
        "attn_head_token", layers=list(layers), heads=None if kind == "attn" else list(heads or ())
    )
    spans = store.sql(
        f"SELECT subject_start, subject_end FROM examples WHERE example_id IN ({ex[0]}, {ex[1]}) "
        "ORDER BY example_id"
    ).to_pylist()
    for i in range(2):
        X = torch.from_numpy(full[i])  # [l, h, S, d]
        n_src = got[i].shape[1]
        if kind == "attn_entity":
            keep = torch.zeros(X.shape[2])
            keep[spans[i]["subject_start"] : spans[i]["subject_end"]] = 1
            X = X * keep[None, None, :, None]
        if kind == "attn":
            want = torch.einsum("lhsd,ld->ls", X, u[i].view(len(layers), g.d_model))
        else:
            want = torch.einsum("lhsd,lhd->ls", X, u[i].view(len(layers), len(geo.heads), g.d_model))
        np.testing.assert_allclose(got[i], want[:, :n_src].numpy(), rtol=1e-4, atol=1e-4)
        assert (want[:, n_src:] == 0).all()


@pytest.mark.parametrize("kind", ["attn_head", "attn_entity", "attn"])
def test_token_scores_plus_centering_equal_head_scores_per_layer(
    runs: tuple[Path, dict[str, str]], kind: str
) -> None:
    path, ids = runs
    store = actstore.open(path)
    rid = ids[kind]
    ex, seed, episode, stored_pred, stored_total = (
        store.sql(
            f"SELECT example_id, seed, episode, predicted, head_score_total FROM probe_predictions "
            f"WHERE run_id = '{rid}' ORDER BY seed, episode, example_id LIMIT 1"
        )
        .to_pylist()[0]
        .values()
    )
    e = explain_example(store, rid, ex, seed=seed, episode=episode)
    rows = e.layer_table()
    assert len(rows) == store.geometry.n_layers
    for r in rows:
        scale = max(1.0, abs(r["head_score_sum"]), abs(r["token_score_sum"]), abs(r["centering"]))
        assert abs(r["residual"]) <= 1e-4 * scale, r
    # The re-trained episode reproduces the stored prediction and its total head score.
    assert e.predicted == stored_pred
    assert abs(float(e.head_scores.sum()) - stored_total) <= 1e-2 * max(1.0, abs(stored_total))
    assert len(e.tokens) == e.token_scores.shape[1]


def test_stored_token_scores_add_up(runs: tuple[Path, dict[str, str]]) -> None:
    path, ids = runs
    store = actstore.open(path)
    rows = store.sql(
        f"SELECT scores, centering, head_score_total FROM token_scores WHERE run_id = '{ids['attn_head']}'"
    ).to_pylist()
    assert len(rows) == 2 * 25  # --token-scores all: every prediction
    for r in rows:
        total = sum(r["scores"]) + r["centering"]
        assert abs(total - r["head_score_total"]) <= 1e-4 * max(1.0, abs(r["head_score_total"]))


def test_cli_tokenscore_json(runs: tuple[Path, dict[str, str]]) -> None:
    path, ids = runs
    store = actstore.open(path)
    ex = store.sql(f"SELECT example_id FROM token_scores WHERE run_id = '{ids['attn_head']}' LIMIT 1").column(
        0
    )[0]
    res = CliRunner().invoke(
        main, ["tokenscore", str(path), "--run", ids["attn_head"], "--example", str(ex), "--json"]
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert {"layer", "head_score_sum", "token_score_sum", "centering"} <= set(d["layers"][0])
    assert len(d["tokens"]) == len(d["token_scores"])
    bad = CliRunner().invoke(
        main, ["tokenscore", str(path), "--run", ids["attn_head"], "--example", "999999"]
    )
    assert bad.exit_code != 0 and "is not a query" in bad.output


@pytest.mark.parametrize("kind", ["attn_head", "attn_entity", "attn"])
def test_stored_probes_reproduce_the_runs_predictions(runs: tuple[Path, dict[str, str]], kind: str) -> None:
    """Each episode's stored probe (``probe_weights``), applied with numpy to the queries' features read
    through ``Selection.features``, gives the run's stored predictions and their probabilities."""
    path, ids = runs
    store = actstore.open(path)
    rid = ids[kind]
    w = store.sql(f"SELECT * FROM probe_weights WHERE run_id = '{rid}' ORDER BY seed, episode").to_pylist()
    eps = store.sql(f"SELECT * FROM probe_episodes WHERE run_id = '{rid}' ORDER BY seed, episode").to_pylist()
    assert [(r["seed"], r["episode"]) for r in w] == [(r["seed"], r["episode"]) for r in eps] and len(w) == 2
    pred = {
        (r["seed"], r["episode"], r["example_id"]): r
        for r in store.sql(f"SELECT * FROM probe_predictions WHERE run_id = '{rid}'").to_pylist()
    }
    for row, ep in zip(w, eps):
        q = [int(x) for x in ep["query_ids"]]
        x = Selection.from_ids(store, q).features(kind)  # rows in store order
        order = store.sql("SELECT example_id FROM examples ORDER BY example_id").column(0).to_pylist()
        rows = sorted(q, key=order.index)
        X = x.reshape(len(q), -1).astype(np.float64)[[rows.index(e) for e in q]]
        f = np.asarray(row["features"])
        assert np.all(np.diff(f) > 0) and row["n_way"] == len(ep["relations"])
        W = np.asarray(row["weight"], dtype=np.float64).reshape(len(f), row["n_way"])
        z = (X[:, f] - np.asarray(row["mean"])) / np.asarray(row["std"])
        logits = z @ W + np.asarray(row["bias"])
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        for i, e in enumerate(q):
            stored = pred[(ep["seed"], ep["episode"], e)]
            assert ep["relations"][int(p[i].argmax())] == stored["predicted"]
            assert p[i].max() == pytest.approx(stored["prob"], rel=1e-4)


@pytest.mark.parametrize("kind", ["attn_head", "attn"])
def test_an_explanation_from_the_stored_probe_equals_a_retrained_one(
    runs: tuple[Path, dict[str, str]], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """explain_example reads a stored probe without training (and loads only the query's row) and
    answers what training the episode again answers."""
    from actstore.query.analyses import probe

    path, ids = runs
    store = actstore.open(path)
    rid = ids[kind]
    queries = (
        store.sql(
            f"SELECT example_id FROM probe_predictions WHERE run_id = '{rid}' ORDER BY seed, episode, example_id LIMIT 4"
        )
        .column(0)
        .to_pylist()
    )
    fresh = [explain_example(store, rid, int(ex), stored=False) for ex in queries]

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the episode was trained again")

    monkeypatch.setattr(probe, "train_batched", no_training)
    kept: dict = {}
    for ex, f in zip(queries, fresh):
        e = explain_example(store, rid, int(ex), episodes=kept)
        assert (e.seed, e.episode, e.predicted) == (f.seed, f.episode, f.predicted)
        assert e.probability == pytest.approx(f.probability, rel=1e-4)
        np.testing.assert_allclose(e.direction, f.direction, rtol=1e-3, atol=1e-5 * np.abs(f.direction).max())
        np.testing.assert_allclose(e.head_scores, f.head_scores, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(e.token_scores, f.token_scores, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(e.centering, f.centering, rtol=1e-3, atol=1e-5)


def test_a_run_without_stored_probes_is_explained_by_training(fewrel_store: Path, tmp_path: Path) -> None:
    """``store_weights=False``: no probe_weights rows for the run, and an explanation trains the episode."""
    from actstore.query.analyses import probe

    dst = tmp_path / "store"
    shutil.copytree(fewrel_store, dst)
    store = actstore.open(dst)
    cfg = ProbeConfig(kind="attn_head", top_k=40, epochs=20, episodes=1, seeds=(0,), store_weights=False)
    out = run_probe(store, cfg)
    record_probe(store, out)
    assert out.weights == [] and not store.table_files().get("probe_weights")
    ex = int(store.sql("SELECT example_id FROM probe_predictions LIMIT 1").column(0)[0].as_py())
    calls = []
    real = probe.train_batched

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(probe, "train_batched", spy)
        e = explain_example(store, out.run_id, ex)
    assert calls and e.direction is not None
