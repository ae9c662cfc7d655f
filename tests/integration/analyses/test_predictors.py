"""Predictors of per-relation probe accuracy (real FewRel instances, CoDEx-M as the knowledge graph) and
the lexical shortcut analysis."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import FIXTURES, real_data
from scipy import stats

import actstore
from actstore.cli import main
from actstore.jobs.probe import record_probe
from actstore.query.analyses.predictor_measures import (
    KnowledgeGraph,
    connectivity,
    correlate,
    head_concentration,
    output_ranges,
    tfidf_similarity,
)
from actstore.query.analyses.predictors import relation_predictors, scatter_plots
from actstore.query.analyses.probe import ProbeConfig, run_probe
from actstore.query.analyses.shortcuts import normalize, shortcut_analysis, shortcut_figure

FEWREL_FIXTURE = FIXTURES / "fewrel" / "val_wiki.json"
CODEX_FIXTURE = sorted((FIXTURES / "codex_m").glob("*.txt"))  # test, train, valid
N_RELATIONS = len(json.loads(FEWREL_FIXTURE.read_text(encoding="utf-8")))  # 8 invented relations
pytestmark = pytest.mark.usefixtures("one_thread")


def plain_triples(paths: list[Path]) -> list[tuple[str, str, str]]:
    """The triples of CoDEx files, read without the module under test."""
    out = []
    for p in paths:
        for line in p.read_text(encoding="utf-8").splitlines():
            h, prop, t = line.split("\t")
            out.append((h, prop, t))
    return out


def all_run(
    store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, fewrel: Path
) -> tuple[Path, str]:
    """An n-way 5-shot attn_head run over every relation of the FewRel file ``fewrel`` (10 instances
    each; tiny model, few short episodes), in a copy of its store."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = store_factory("llama", dataset=f"fewrel:{fewrel}", limit=10, segment_size=64)
        dst = tmp_path_factory.mktemp("pred") / "store"
        shutil.copytree(src, dst)
        store = actstore.open(dst)
        n = store.sql("SELECT count(DISTINCT relation_id) FROM examples").column(0)[0].as_py()
        cfg = ProbeConfig(
            kind="attn_head", n_way=n, k_shot=5, queries=5, episodes=2, seeds=(0,), top_k=40, epochs=30
        )
        out = run_probe(store, cfg)
        record_probe(store, out)
    finally:
        torch.set_num_threads(old)
    return dst, out.run_id


@pytest.fixture(scope="module")
def kg() -> KnowledgeGraph:
    return KnowledgeGraph.load(CODEX_FIXTURE)


@pytest.fixture(scope="module")
def run_all(store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An 8-way run over every relation of the FewRel fixture."""
    return all_run(store_factory, tmp_path_factory, FEWREL_FIXTURE)


def check_shared_properties(kg: KnowledgeGraph, h: str, p: str, t: str) -> None:
    assert p in kg.properties[h] and t in kg.entities
    assert kg.shared(h, t) == len(kg.properties[h] & kg.properties.get(t, frozenset()))
    assert kg.shared(h, "Q-not-an-entity") is None
    rows = [
        {"relation_id": "R", "meta": json.dumps({"subject_qid": h, "object_qid": t})},
        {"relation_id": "R", "meta": json.dumps({"subject_qid": "Qnope", "object_qid": t})},
        {"relation_id": "S", "meta": "{}"},
    ]
    conn = connectivity(rows, kg)
    assert conn["R"][1] == 0.5 and conn["R"][2] == 1 and conn["R"][0] == kg.shared(h, t)
    assert conn["S"][1] == 0 and np.isnan(conn["S"][0])


def test_knowledge_graph_shared_properties(kg: KnowledgeGraph) -> None:
    triples = plain_triples(CODEX_FIXTURE)
    h, p, t = triples[0]
    check_shared_properties(kg, h, p, t)
    assert kg.n_triples == len(triples)
    assert kg.entities == {e for a, _, b in triples for e in (a, b)}
    out: dict[str, set[str]] = {}
    for a, prop, _ in triples:
        out.setdefault(a, set()).add(prop)
    assert kg.properties == out  # direction="out": the properties an entity has as head
    both = KnowledgeGraph.load(CODEX_FIXTURE, direction="both")
    for a, prop, b in triples:
        assert prop in both.properties[a] and prop in both.properties[b]
    # Some fixture instances share properties, so the counting is exercised with non-zero values.
    assert max(kg.shared(a, b) or 0 for a, _, b in triples) > 0


@pytest.mark.real_data
def test_knowledge_graph_real_codex() -> None:
    files = sorted(real_data("codex_m").glob("*.txt"))
    kg = KnowledgeGraph.load(files)
    h, p, t = files[0].read_text(encoding="utf-8").splitlines()[0].split("\t")
    check_shared_properties(kg, h, p, t)
    assert kg.n_triples > 200_000


def test_kg_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("Q1\tP1\n")
    with pytest.raises(ValueError, match="expected head<TAB>property<TAB>tail"):
        KnowledgeGraph.load([bad])
    with pytest.raises(ValueError, match="no knowledge-graph files"):
        KnowledgeGraph.load([])


def test_output_range_tfidf_and_concentration() -> None:
    rows: list[dict[str, str | None]] = [
        {
            "relation_id": "A",
            "object": "Paris",
            "text": "the capital of france is",
            "meta": '{"object_qid": "Q90"}',
        },
        {
            "relation_id": "A",
            "object": "paris",
            "text": "the capital of france is",
            "meta": '{"object_qid": "Q90"}',
        },
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


def check_relation_predictors(
    path: Path, rid: str, kb: list[Path], n_relations: int, tmp_path: Path
) -> tuple[float, dict[str, dict[str, Any]]]:
    store = actstore.open(path)
    res = relation_predictors(store, rid, kb=kb)
    rel = res.relations.to_pylist()
    assert len(rel) == n_relations and {r["n_instances"] for r in rel} == {10}
    assert all(
        0 <= r["f1"] <= 1 and 1 <= r["output_range"] <= 10 and 0 <= r["tfidf_similarity"] <= 1 for r in rel
    )
    assert all(1 <= r["head_concentration"] <= 8 for r in rel)  # 2 layers x 4 heads
    names = res.correlations.column("predictor").to_pylist()
    assert names == [
        "output_range",
        "output_range_ratio",
        "connectivity",
        "tfidf_similarity",
        "head_concentration",
    ]
    tf = res.correlations.to_pylist()[3]
    assert tf["n"] == n_relations and -1 <= tf["spearman_rho"] <= 1 and 0 <= tf["spearman_p"] <= 1
    png = scatter_plots(res, tmp_path / "plots")[3]
    assert Path(png).stat().st_size > 1000
    return res.kb_coverage, {str(r["relation_id"]): r for r in rel}


def test_relation_predictors_on_fewrel_with_codex(run_all: tuple[Path, str], tmp_path: Path) -> None:
    path, rid = run_all
    coverage, rel = check_relation_predictors(path, rid, CODEX_FIXTURE, N_RELATIONS, tmp_path)
    # Coverage, connectivity and output range against plain loops over the fixture files and the examples.
    triples = plain_triples(CODEX_FIXTURE)
    entities = {e for a, _, b in triples for e in (a, b)}
    props: dict[str, set[str]] = {}
    for a, prop, _ in triples:
        props.setdefault(a, set()).add(prop)
    rows = actstore.open(path).sql("SELECT relation_id, meta FROM examples").to_pylist()
    per: dict[str, list[int]] = {}
    objects: dict[str, set[str]] = {}
    n_cov = 0
    for r in rows:
        m = json.loads(r["meta"])
        objects.setdefault(r["relation_id"], set()).add(m["object_qid"])
        per.setdefault(r["relation_id"], [])
        if m["subject_qid"] in entities and m["object_qid"] in entities:
            n_cov += 1
            per[r["relation_id"]].append(
                len(props.get(m["subject_qid"], set()) & props.get(m["object_qid"], set()))
            )
    assert coverage == n_cov / len(rows) and 0 < coverage < 1  # reported, not hidden
    for name, vals in per.items():
        assert rel[name]["connectivity_covered"] == len(vals)
        assert rel[name]["connectivity_coverage"] == len(vals) / 10
        if vals:
            assert rel[name]["connectivity"] == pytest.approx(sum(vals) / len(vals), rel=1e-12)
        else:
            assert np.isnan(rel[name]["connectivity"])
        assert rel[name]["output_range"] == len(objects[name])
    assert any(not v for v in per.values()) and any(v and sum(v) > 0 for v in per.values())


@pytest.mark.real_data
def test_relation_predictors_on_real_fewrel_with_codex(
    store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """16-way over the real FewRel validation relations with the real CoDEx-M."""
    path, rid = all_run(store_factory, tmp_path_factory, real_data("fewrel/val_wiki.json"))
    coverage, _ = check_relation_predictors(
        path, rid, sorted(real_data("codex_m").glob("*.txt")), 16, tmp_path
    )
    assert 0 <= coverage < 0.5  # CoDEx-M covers few FewRel entity pairs; it is reported, not hidden


def test_shortcuts_on_stored_error_token_scores(run_all: tuple[Path, str], tmp_path: Path) -> None:
    path, rid = run_all
    store = actstore.open(path)
    res = shortcut_analysis(store, rid, n_cues=10)
    n_err = store.sql(
        f"SELECT count(*) FROM probe_predictions WHERE run_id = '{rid}' AND NOT correct"
    ).column(0)[0]
    s = res.summary.to_pylist()[0]
    assert s["n_errors"] == n_err.as_py() > 0
    assert -1 <= s["spearman_rho"] <= 1 and 0 <= s["mass"] <= 1 and 0 <= s["strong_align"] <= 1
    assert 0 < s["mass_baseline"] < 1
    assert Path(shortcut_figure(res, tmp_path / "fig.png")).stat().st_size > 1000
    assert normalize(" The") == "the" and normalize(" ,") is None


def test_cli_correlate_and_shortcuts_write_tables(run_all: tuple[Path, str], tmp_path: Path) -> None:
    path, rid = run_all
    runner = CliRunner()
    small = [str(p) for p in CODEX_FIXTURE if p.name != "train.txt"]  # valid + test
    res = runner.invoke(
        main,
        [
            "correlate",
            str(path),
            "--run",
            rid,
            "--kb",
            small[0],
            *small[1:],
            "--figures",
            str(tmp_path / "p"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert len(d["relations"]) == N_RELATIONS and len(d["correlations"]) == 5 and len(d["plots"]) == 5
    assert d["probe_run"] == rid and d["run_id"].startswith("correlate-")
    res = runner.invoke(main, ["shortcuts", str(path), "--run", rid, "--json"])
    assert res.exit_code == 0, res.output
    sc = json.loads(res.output)
    assert 0 <= sc["strong_align"] <= 1 and sc["run_id"].startswith("shortcuts-")
    store = actstore.open(path)
    corr_run, sc_run = d["run_id"], sc["run_id"]

    def count(table: str, run: str) -> int:
        return int(
            store.sql(f"SELECT count(*) FROM {table} WHERE run_id = ? AND probe_run = ?", [run, rid])[0][
                0
            ].as_py()
        )

    assert count("correlations", corr_run) == 5
    assert count("relation_predictors", corr_run) == N_RELATIONS
    assert count("shortcut_summary", sc_run) == 1
    runs = store.sql(
        "SELECT run_id, kind, config FROM runs WHERE run_id IN (?, ?) ORDER BY kind", [corr_run, sc_run]
    )
    assert runs.column("kind").to_pylist() == ["correlate", "shortcuts"]
    assert all(json.loads(c)["probe_run"] == rid for c in runs.column("config").to_pylist())
    bad = runner.invoke(main, ["correlate", str(path), "--run", rid, "--kb", str(tmp_path / "missing.txt")])
    assert bad.exit_code != 0 and bad.output.startswith("error:") and "no such file" in bad.output
