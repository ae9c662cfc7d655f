"""Episodic probes: episodes, RelSpec, the batched trainer against the plain reference, result tables, CLI."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import FIXTURES, fewrel_store_at, real_data

import actstore
from actstore.cli import main
from actstore.core.errors import InvalidSetting, QueryError
from actstore.jobs.probe import record_probe
from actstore.query.analyses.episodes import sample_episodes, sample_seeds
from actstore.query.analyses.probe import ProbeConfig, run_probe, run_reference
from actstore.query.analyses.probe_features import load_features
from actstore.query.analyses.probe_training import _Adam, train_batched, train_reference
from actstore.query.analyses.relspec import gather_standardized, select_features, smd_scores

FEWREL_FIXTURE = FIXTURES / "fewrel" / "val_wiki.json"
N_RELATIONS = len(json.loads(FEWREL_FIXTURE.read_text(encoding="utf-8")))  # 8 invented relations
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fewrel_store(store_factory: Callable[..., Path]) -> Path:
    """The FewRel fixture (tests/data/fewrel: 8 relations x 10 kept instances)."""
    return fewrel_store_at(store_factory, FEWREL_FIXTURE)


@pytest.fixture()
def store_copy(fewrel_store: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(fewrel_store, dst)
    return dst


# ----------------------------------------------------------------------------------- episodes
def test_episodes_are_deterministic_and_well_formed() -> None:
    labels = [f"R{i % 6}" for i in range(60)]
    a = sample_episodes(labels, n_way=4, k_shot=3, queries=2, episodes=30, seed=7)
    b = sample_episodes(labels, n_way=4, k_shot=3, queries=2, episodes=30, seed=7)
    c = sample_episodes(labels, n_way=4, k_shot=3, queries=2, episodes=30, seed=8)
    for f in ("classes", "support", "query"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(a.support, c.support)
    lab = np.asarray(labels)
    for e in range(len(a)):
        assert len(set(a.classes[e])) == 4
        assert not set(a.support[e]) & set(a.query[e])
        rel = np.asarray(a.relations)[a.classes[e]]
        assert (lab[a.support[e]] == rel[a.support_labels]).all()
        assert (lab[a.query[e]] == rel[a.query_labels]).all()
    both = sample_seeds(labels, n_way=4, k_shot=3, queries=2, episodes=30, seeds=[7, 8])
    assert len(both) == 60 and np.array_equal(both.support[30:], c.support)


def test_episode_errors_are_clear() -> None:
    labels = ["A"] * 10 + ["B"] * 10 + ["C"] * 4
    with pytest.raises(InvalidSetting, match="^n_way: 4 is larger than the number of relations"):
        sample_episodes(labels, n_way=4, k_shot=2, queries=2, episodes=1, seed=0)
    with pytest.raises(QueryError, match=r"C \(4\)"):
        sample_episodes(labels, n_way=2, k_shot=3, queries=2, episodes=1, seed=0)


# ----------------------------------------------------------------------------------- RelSpec
def test_smd_is_cohens_d_and_selection_is_the_union_of_top_k() -> None:
    g = torch.Generator().manual_seed(0)
    n, k, F = 3, 4, 40
    x = torch.randn(2, n * k, F, generator=g) * torch.rand(F, generator=g) * 5 + 50 * torch.randn(
        F, generator=g
    )
    d, mean, std = smd_scores(x.clone(), n, k)
    X = x.double().numpy()
    for b in range(2):
        for c in range(n):
            cls = X[b, c * k : (c + 1) * k]
            rest = np.delete(X[b], range(c * k, (c + 1) * k), 0)
            pooled = (((cls - cls.mean(0)) ** 2).sum(0) + ((rest - rest.mean(0)) ** 2).sum(0)) / (n * k - 2)
            np.testing.assert_allclose(
                d[b, c].numpy(), (cls.mean(0) - rest.mean(0)) / np.sqrt(pooled), rtol=2e-3, atol=1e-3
            )
    np.testing.assert_allclose(mean.numpy(), X.mean(1), rtol=1e-5)
    np.testing.assert_allclose(std.numpy(), X.std(1), rtol=1e-4)
    sel = select_features(x, n, k, top_k=5)
    for b in range(2):
        want = set(np.argsort(-np.abs(d[b].numpy()), axis=1)[:, :5].reshape(-1).tolist())
        got = sel.index[b][sel.valid[b]].tolist()
        assert set(got) == want and got == sorted(got)
    # Standardised with support statistics, zero on padding.
    xs = gather_standardized(x.reshape(-1, F), torch.arange(2 * n * k).reshape(2, -1), sel)
    valid = sel.valid[:, None].expand_as(xs)
    assert torch.allclose(xs.mean(1)[sel.valid], torch.zeros(()), atol=1e-4)
    assert (xs[~valid] == 0).all()


def test_planted_feature_is_selected() -> None:
    x = torch.randn(1, 10, 200)
    x[0, :5, 17] += 10.0  # class 0 only
    sel = select_features(x, 2, 5, top_k=1)
    assert 17 in sel.index[0][sel.valid[0]].tolist()


# ----------------------------------------------------------------------------------- trainers
@pytest.mark.parametrize("fused", [True, False])
def test_batched_trainer_equals_plain_loop_and_ignores_padding(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Adam, "use_fused", fused)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 12, 30, generator=g)
    xs[1, :, 20:] = 0  # episode 1 has 20 real features, the rest padding
    y = torch.arange(3).repeat_interleave(4)
    W, b = train_batched(xs, y, 3, epochs=60, lr=1e-2)
    for e in range(3):
        F = 20 if e == 1 else 30
        Wr, br = train_reference(xs[e, :, :F], y, 3, epochs=60, lr=1e-2)
        torch.testing.assert_close(W[e, :F], Wr, atol=1e-5, rtol=1e-4)
        # With balanced classes the bias gradient is 0 up to rounding, which Adam scales to steps of
        # +-lr: the biases of two correct implementations differ by a few lr (the weights do not).
        assert (b[e] - br).abs().max() < 3 * 1e-2
        assert torch.equal((xs[e, :, :F] @ W[e, :F] + b[e]).argmax(1), (xs[e, :, :F] @ Wr + br).argmax(1))
    assert (W[1, 20:] == 0).all()


def check_batched_probe_agrees_with_reference(path: Path) -> None:
    store = actstore.open(path)
    fm = load_features(store, "attn_head")
    cfg = ProbeConfig(kind="attn_head", top_k=40, epochs=50, episodes=6, seeds=(3,), token_scores="none")
    ep = sample_seeds(fm.labels, n_way=5, k_shot=5, queries=5, episodes=6, seeds=[3])
    out = run_probe(store, cfg, features=fm, episodes=ep)
    acc, pred, prob = run_reference(fm, ep, cfg)
    assert np.array_equal(out.pred, pred)
    np.testing.assert_allclose(out.episode_accuracy, acc)
    np.testing.assert_allclose(out.prob, np.take_along_axis(prob, pred[..., None], 2)[..., 0], atol=2e-3)
    assert (out.n_selected <= 5 * 40).all() and (out.n_selected > 40).all()
    assert out.accuracy > 0.2  # chance is 0.2; the tiny random model still separates some relations


def test_batched_probe_agrees_with_reference_on_the_same_episodes(fewrel_store: Path) -> None:
    check_batched_probe_agrees_with_reference(fewrel_store)


@pytest.mark.real_data
def test_batched_probe_agrees_with_reference_on_real_fewrel(store_factory: Callable[..., Path]) -> None:
    """The same on 10 instances of each of the 16 real FewRel validation relations."""
    path = fewrel_store_at(store_factory, real_data("fewrel/val_wiki.json"))
    store = actstore.open(path)
    counts = store.sql("SELECT relation_id, count(*) AS n FROM examples GROUP BY 1").to_pylist()
    assert len(counts) == 16 and {r["n"] for r in counts} == {10}
    check_batched_probe_agrees_with_reference(path)


# ----------------------------------------------------------------------------------- tables, CLI
def test_result_tables_are_sql_visible(store_copy: Path) -> None:
    store = actstore.open(store_copy)
    cfg = ProbeConfig(kind="attn", top_k=30, epochs=30, episodes=4, seeds=(0, 1))
    out = run_probe(store, cfg)
    record_probe(store, out)
    rid = out.run_id
    r = store.sql(
        f"SELECT accuracy, ci95_low, ci95_high, episodes FROM probe_runs WHERE run_id = '{rid}'"
    ).to_pylist()[0]
    assert r["episodes"] == 8 and r["ci95_low"] <= r["accuracy"] <= r["ci95_high"]
    n = store.sql(
        f"SELECT count(*) AS n, avg(correct::INT) AS a FROM probe_predictions WHERE run_id = '{rid}'"
    )
    assert n.column("n")[0].as_py() == 8 * 25
    assert abs(n.column("a")[0].as_py() - out.accuracy) < 1e-9
    assert store.sql(f"SELECT count(*) FROM probe_episodes WHERE run_id = '{rid}'").column(0)[0].as_py() == 8
    f1 = store.sql(f"SELECT relation_id, f1 FROM relation_metrics WHERE run_id = '{rid}'").to_pylist()
    assert len(f1) == N_RELATIONS and all(0 <= x["f1"] <= 1 for x in f1)
    hs = store.sql(f"SELECT DISTINCT layer, head FROM head_scores WHERE run_id = '{rid}'").num_rows
    assert hs == store.geometry.n_layers  # attn: one unit per layer
    assert store.sql(f"SELECT kind FROM runs WHERE run_id = '{rid}'").column(0)[0].as_py() == "probe"


def test_cli_probe_json_and_headscore(store_copy: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "probe",
            str(store_copy),
            "--kind",
            "attn_head",
            "--episodes",
            "3",
            "--seeds",
            "2",
            "--epochs",
            "20",
            "--top-k",
            "30",
            "--token-scores",
            "none",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert 0 <= d["accuracy"] <= 1 and d["episodes"] == 6 and len(d["ci95"]) == 2 and d["run_id"]
    out = runner.invoke(
        main,
        [
            "sql",
            str(store_copy),
            f"SELECT episodes FROM probe_runs WHERE run_id = '{d['run_id']}'",
            "--format",
            "json",
        ],
    )
    assert json.loads(out.output) == [{"episodes": 6}]
    store = actstore.open(store_copy)
    rel, n = (
        store.sql(
            f"SELECT relation_id, count(*) FROM probe_predictions WHERE run_id = '{d['run_id']}' "
            "GROUP BY 1 ORDER BY 1 LIMIT 1"
        )
        .to_pylist()[0]
        .values()
    )
    hs = runner.invoke(
        main, ["headscore", str(store_copy), "--run", d["run_id"], "--relation", rel, "--json"]
    )
    assert hs.exit_code == 0, hs.output
    h = json.loads(hs.output)
    assert np.asarray(h["scores"]).shape == (2, 4) and h["predictions"] == n
    hs = runner.invoke(main, ["headscore", str(store_copy), "--run", d["run_id"], "--json"])
    assert json.loads(hs.output)["predictions"] == 6 * 25


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kind", "attn_prob"], "'attn_prob' is not one of 'attn_head'"),
        (["--kind", "nope"], "'nope' is not one of 'attn_head'"),
        (["--kind", "attn", "--n-way", str(N_RELATIONS + 1)], "larger than the number of relations"),
        (["--kind", "attn", "--k-shot", "8", "--queries", "5"], "fewer than k-shot + queries = 13"),
        (["--kind", "attn", "--where", "relation_id = 'P177'"], "larger than the number of relations"),
    ],
)
def test_cli_probe_bad_input_is_one_line(fewrel_store: Path, args: list[str], message: str) -> None:
    res = CliRunner().invoke(
        main, ["probe", str(fewrel_store), "--episodes", "1", "--seeds", "1", "--no-save", *args]
    )
    assert res.exit_code != 0
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.output


def test_cli_unknown_run_and_relation(store_copy: Path) -> None:
    runner = CliRunner()
    for cmd in (
        ["headscore", str(store_copy), "--run", "nope"],
        ["correlate", str(store_copy), "--run", "nope"],
        ["shortcuts", str(store_copy), "--run", "nope"],
        ["tokenscore", str(store_copy), "--run", "nope", "--example", "0"],
    ):
        res = runner.invoke(main, cmd)
        assert res.exit_code != 0 and res.output.startswith("error:") and len(res.output.splitlines()) == 1, (
            res.output
        )
    d = json.loads(
        runner.invoke(
            main,
            [
                "probe",
                str(store_copy),
                "--kind",
                "attn",
                "--episodes",
                "1",
                "--seeds",
                "1",
                "--epochs",
                "5",
                "--json",
            ],
        ).output
    )
    res = runner.invoke(main, ["headscore", str(store_copy), "--run", d["run_id"], "--relation", "P0"])
    assert res.exit_code != 0 and "unknown relation 'P0'" in res.output
    res = runner.invoke(main, ["probe", str(store_copy), "--kind", "attn_head", "--heads", "9"])
    assert res.exit_code != 0 and "head 9 out of range" in res.output


@pytest.mark.parametrize("episodes", [0, -3])
def test_sample_episodes_refuses_too_few_episodes_naming_the_setting(episodes: int) -> None:
    """The library's own check (the command line's option refuses these values before it is reached)."""
    from actstore.core.errors import InvalidSetting
    from actstore.query.analyses.episodes import sample_episodes

    labels = [r for r in "abcdef" for _ in range(10)]
    with pytest.raises(InvalidSetting) as e:
        sample_episodes(labels, n_way=5, k_shot=1, queries=1, episodes=episodes, seed=0)
    assert e.value.setting == "episodes"
    assert str(e.value) == f"episodes: must be at least 1 (got {episodes})"
