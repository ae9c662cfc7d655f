"""Predictors of per-relation probe accuracy (real FewRel instances, CoDEx-M as the knowledge graph) and
the lexical shortcut analysis."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy import stats

import actstore
from actstore.cli import main
from query.predictors import (
    KnowledgeGraph,
    connectivity,
    correlate,
    head_concentration,
    output_ranges,
    relation_predictors,
    scatter_plots,
    tfidf_similarity,
)
from query.probe import ProbeConfig, run_probe, write_probe_tables
from query.shortcuts import normalize, shortcut_analysis, shortcut_figure

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FEWREL = DATA / "fewrel" / "val_wiki.json"
CODEX = sorted((DATA / "codex_m").glob("*.txt"))
pytestmark = [pytest.mark.skipif(not FEWREL.exists() or not CODEX, reason="FewRel / CoDEx-M data not present"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def kg() -> KnowledgeGraph:
    return KnowledgeGraph.load(CODEX)


@pytest.fixture(scope="module")
def run16(store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 16-way 5-shot attn_head run over all 16 FewRel relations (tiny model, few short episodes)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = store_factory("llama", dataset=f"fewrel:{FEWREL}", limit=10, segment_size=64)
        dst = tmp_path_factory.mktemp("pred") / "store"
        shutil.copytree(src, dst)
        store = actstore.open(dst)
        cfg = ProbeConfig(kind="attn_head", n_way=16, k_shot=5, queries=5, episodes=2, seeds=(0,), top_k=40, epochs=30)
        out = run_probe(store, cfg)
        write_probe_tables(store, out)
    finally:
        torch.set_num_threads(old)
    return dst, out.run_id


def test_knowledge_graph_shared_properties(kg: KnowledgeGraph) -> None:
    h, p, t = (CODEX[0].read_text(encoding="utf-8").splitlines()[0]).split("\t")
    assert p in kg.properties[h] and t in kg.entities
    assert kg.shared(h, t) == len(kg.properties[h] & kg.properties.get(t, frozenset()))
    assert kg.shared(h, "Q-not-an-entity") is None
    assert kg.n_triples > 200_000
    rows = [{"relation_id": "R", "meta": json.dumps({"subject_qid": h, "object_qid": t})},
            {"relation_id": "R", "meta": json.dumps({"subject_qid": "Qnope", "object_qid": t})},
            {"relation_id": "S", "meta": "{}"}]
    conn = connectivity(rows, kg)
    assert conn["R"][1] == 0.5 and conn["R"][2] == 1 and conn["R"][0] == kg.shared(h, t)
    assert conn["S"][1] == 0 and np.isnan(conn["S"][0])


def test_kg_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("Q1\tP1\n")
    with pytest.raises(ValueError, match="expected head<TAB>property<TAB>tail"):
        KnowledgeGraph.load([bad])
    with pytest.raises(ValueError, match="no knowledge-graph files"):
        KnowledgeGraph.load([])


def test_output_range_tfidf_and_concentration() -> None:
    rows: list[dict[str, str | None]] = [
        {"relation_id": "A", "object": "Paris", "text": "the capital of france is", "meta": '{"object_qid": "Q90"}'},
        {"relation_id": "A", "object": "paris", "text": "the capital of france is", "meta": '{"object_qid": "Q90"}'},
        {"relation_id": "A", "object": "Rome", "text": "the capital of italy is", "meta": "{}"},
        {"relation_id": "B", "object": "x", "text": "a cat sat on", "meta": None},
        {"relation_id": "B", "object": "x", "text": "quantum flux rises", "meta": None},
    ]
    assert output_ranges(rows) == {"A": (3, 2), "B": (2, 1)}
    sim = tfidf_similarity(rows)
    assert sim["A"] > sim["B"] >= 0 and sim["B"] == pytest.approx(0.0)
    assert head_concentration(np.array([1.0, 0, 0])) == 1
    assert head_concentration(np.array([1.0, 1, 1, 1])) == 4
    assert head_concentration(np.array([10.0, 1.0, -0.1])) == 2
    assert head_concentration(np.zeros(3)) == 0


def test_correlate_matches_scipy_and_skips_nan() -> None:
    x = [1.0, 2.0, 3.0, 4.0, float("nan"), 6.0]
    y = [2.0, 1.0, 4.0, 3.0, 5.0, 7.0]
    c = correlate(x, y)
    xs, ys = [1, 2, 3, 4, 6], [2, 1, 4, 3, 7]
    assert c["n"] == 5
    assert c["spearman_rho"] == pytest.approx(stats.spearmanr(xs, ys).statistic)
    assert c["pearson_p"] == pytest.approx(stats.pearsonr(xs, ys).pvalue)
    assert np.isnan(correlate([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])["spearman_rho"])


def test_relation_predictors_on_fewrel_with_codex(run16: tuple[Path, str], tmp_path: Path) -> None:
    path, rid = run16
    store = actstore.open(path)
    res = relation_predictors(store, rid, kb=CODEX)
    rel = res.relations.to_pylist()
    assert len(rel) == 16 and {r["n_instances"] for r in rel} == {10}
    assert all(0 <= r["f1"] <= 1 and 1 <= r["output_range"] <= 10 and 0 <= r["tfidf_similarity"] <= 1 for r in rel)
    assert all(1 <= r["head_concentration"] <= 8 for r in rel)  # 2 layers x 4 heads
    assert 0 <= res.kb_coverage < 0.5  # CoDEx-M covers few FewRel entity pairs; it is reported, not hidden
    names = res.correlations.column("predictor").to_pylist()
    assert names == ["output_range", "output_range_ratio", "connectivity", "tfidf_similarity", "head_concentration"]
    tf = res.correlations.to_pylist()[3]
    assert tf["n"] == 16 and -1 <= tf["spearman_rho"] <= 1 and 0 <= tf["spearman_p"] <= 1
    png = scatter_plots(res, tmp_path / "plots")[3]
    assert Path(png).stat().st_size > 1000


def test_shortcuts_on_stored_error_token_scores(run16: tuple[Path, str], tmp_path: Path) -> None:
    path, rid = run16
    store = actstore.open(path)
    res = shortcut_analysis(store, rid, n_cues=10)
    n_err = store.sql(f"SELECT count(*) FROM probe_predictions WHERE run_id = '{rid}' AND NOT correct").column(0)[0]
    s = res.summary.to_pylist()[0]
    assert s["n_errors"] == n_err.as_py() > 0
    assert -1 <= s["spearman_rho"] <= 1 and 0 <= s["mass"] <= 1 and 0 <= s["strong_align"] <= 1
    assert 0 < s["mass_baseline"] < 1
    assert Path(shortcut_figure(res, tmp_path / "fig.png")).stat().st_size > 1000
    assert normalize(" The") == "the" and normalize(" ,") is None


def test_cli_correlate_and_shortcuts_write_tables(run16: tuple[Path, str], tmp_path: Path) -> None:
    path, rid = run16
    runner = CliRunner()
    small = [str(p) for p in CODEX if p.name != "train.txt"]  # valid + test: 20k triples, quick to load
    res = runner.invoke(main, ["correlate", str(path), "--run", rid, "--kb", small[0], *small[1:],
                               "--plots", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert len(d["relations"]) == 16 and len(d["correlations"]) == 5 and len(d["plots"]) == 5
    res = runner.invoke(main, ["shortcuts", str(path), "--run", rid, "--json"])
    assert res.exit_code == 0, res.output
    assert 0 <= json.loads(res.output)["strong_align"] <= 1
    store = actstore.open(path)
    assert store.sql(f"SELECT count(*) FROM correlations WHERE run_id = '{rid}'").column(0)[0].as_py() == 5
    assert store.sql(f"SELECT count(*) FROM relation_predictors WHERE run_id = '{rid}'").column(0)[0].as_py() == 16
    assert store.sql(f"SELECT n_errors FROM shortcut_summary WHERE run_id = '{rid}'").num_rows == 1
    bad = runner.invoke(main, ["correlate", str(path), "--run", rid, "--kb", str(tmp_path / "missing.txt")])
    assert bad.exit_code != 0 and bad.output.startswith("error:") and "no such file" in bad.output
