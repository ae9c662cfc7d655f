"""Predictor computations and MAPS dynamic scores on a real Dask LocalCluster (2 worker processes).

Each is compared three ways: the cluster against the same tasks run in this process
(``client=None``), and both against the single-pass computation (the existing functions:
one task over every prompt for MAPS; ``output_ranges``, ``connectivity`` over the whole
knowledge graph, scikit-learn's ``TfidfVectorizer`` and ``head_concentration`` over all rows
for the predictors).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from helpers import FIXTURES

import actstore
from actstore.cli import main
from actstore.query.analyses.predictor_measures import (
    KnowledgeGraph,
    connectivity,
    document_frequencies,
    head_concentration,
    inverse_document_frequency,
    output_ranges,
    tfidf_similarity,
)
from actstore.query.analyses.predictors import relation_predictors

FEWREL_FIXTURE = FIXTURES / "fewrel" / "val_wiki.json"
CODEX_FIXTURE = sorted((FIXTURES / "codex_m").glob("*.txt"))
N_RELATIONS = len(json.loads(FEWREL_FIXTURE.read_text(encoding="utf-8")))  # 8 invented relations
MAPS_DATA = (
    FIXTURES / "maps" / "datasets"
)  # invented pairs in the MAPS layout (the same store as tests/integration/maps/test_maps.py)
RELS = ("country_to_capital_wikidata", "adj_antonym")
RANKS = ("static_up", "static_down", "w_up", "w_down", "wo_up", "wo_down")

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------- MAPS dynamic


@pytest.fixture(scope="module")
def maps_store(store_factory: Callable[..., Path]) -> Path:
    return store_factory(
        "llama", dataset=f"maps:{MAPS_DATA}", template="This is a document about {}", relations=RELS, limit=12
    )


def instances(store: Any) -> list[dict[str, object]]:
    """Every example row, as the predictors read them (an independent query)."""
    return store.sql(
        "SELECT example_id, relation_id, object, text, meta FROM examples ORDER BY example_id"
    ).to_pylist()


def assert_same_ranks(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].templates == b[name].templates
        assert np.array_equal(a[name].example_ids, b[name].example_ids)
        assert np.array_equal(a[name].group, b[name].group)
        for key in RANKS:
            x, y = getattr(a[name], key), getattr(b[name], key)
            assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y), (name, key)


def test_maps_dynamic_on_dask_equals_single_pass(maps_store: Path, client: Any) -> None:
    from actstore.query.maps.dynamic import dynamic_ranks
    from actstore.query.maps.pairs import store_pairs
    from actstore.query.maps.projection import VocabProjection
    from actstore.query.maps.static import pair_ranks

    store = actstore.open(maps_store)
    single = dynamic_ranks(store)  # the existing single pass: every prompt in one task, 256-row chunks
    assert sum(d.group.size for d in single.values()) == 24
    # Tasks of 8 prompts (3 tasks), projected in chunks of 8 rows.
    lines: list[str] = []
    here = dynamic_ranks(store, prompts_per_task=8, rows_per_chunk=8, log=lines.append)
    there = dynamic_ranks(store, prompts_per_task=8, rows_per_chunk=8, client=client)
    assert [m.split(":")[0] for m in lines] == ["task 1/3 done", "task 2/3 done", "task 3/3 done"]
    assert_same_ranks(there, here)
    assert_same_ranks(here, dynamic_ranks(store, rows_per_chunk=8))  # the same chunks in one task
    assert_same_ranks(there, single)  # other chunks, same ranks
    assert_same_ranks(dynamic_ranks(store, client=client), single)  # default: a task per worker thread

    # Independently: the static ranks are MAPS's own pair ranks of the same (source, object) pairs.
    pairs = store_pairs(store)
    up, down = pair_ranks(
        VocabProjection(store), pairs.column("src_id").to_numpy(), pairs.column("dst_id").to_numpy()
    )
    ids = pairs.column("example_id").to_numpy()
    for d in there.values():
        rows = np.searchsorted(ids, d.example_ids)
        assert np.array_equal(d.static_up, up[rows]) and np.array_equal(d.static_down, down[rows])


def test_maps_dynamic_first_mlp_sources_reach_the_workers(maps_store: Path, client: Any) -> None:
    """With the first MLP (a model module, only in this process), the tasks get its source vectors."""
    from actstore.ingest.capture.first_mlp import first_mlp_transform
    from actstore.ingest.models.tiny import tiny_model
    from actstore.query.maps.dynamic import dynamic_ranks
    from actstore.query.maps.projection import VocabProjection

    store = actstore.open(maps_store)
    proj = VocabProjection(store, first_mlp=first_mlp_transform(tiny_model("llama").model))
    single = dynamic_ranks(store, proj=proj)
    there = dynamic_ranks(store, proj=proj, prompts_per_task=8, rows_per_chunk=8, client=client)
    assert_same_ranks(there, single)
    plain = dynamic_ranks(store)
    assert any(not np.array_equal(plain[r].static_up, there[r].static_up) for r in RELS)  # the MLP mattered
    assert all(np.array_equal(plain[r].w_up, there[r].w_up) for r in RELS)  # dynamic ranks do not use it


def test_cli_maps_dynamic_workers(maps_store: Path) -> None:
    """``--workers 2`` starts its own LocalCluster of 2 processes (24 prompts: 1 task per worker)."""
    base = [
        "maps-dynamic",
        str(maps_store),
        "--json",
        "--no-save",
        "--multi-token",
        "first",
        "--min-pairs",
        "1",
    ]
    plain = CliRunner().invoke(main, [*base, "--quiet"])
    assert plain.exit_code == 0, plain.output
    r = CliRunner().invoke(main, [*base, "--workers", "2"], env={"ACTSTORE_PROGRESS": "1"})  # progress piped
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[-1].startswith("task 1/1 done: 24 prompts in tasks of 256")
    a, b = json.loads(plain.stdout), json.loads(r.stdout)
    assert a.pop("run_id") != b.pop("run_id")
    assert a == b


def test_cli_dask_options_bad_input(maps_store: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for extra, want, code in (  # a refused setting is a usage error (2); an unreachable scheduler, 1
        (["--dask", "tcp://127.0.0.1:1", "--workers", "2"], "not both", 2),
        (["--workers", "0"], "--workers: must be at least 1", 2),
        (["--dask", f"tcp://127.0.0.1:{port}"], "cannot reach the Dask scheduler", 1),
    ):
        r = CliRunner().invoke(
            main,
            [
                "maps-dynamic",
                str(maps_store),
                "--no-save",
                "--quiet",
                "--multi-token",
                "first",
                "--min-pairs",
                "1",
                *extra,
            ],
        )
        assert r.exit_code == code, (extra, r.exit_code)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and want in lines[0], r.stderr


# ----------------------------------------------------------------------------------- predictors


@pytest.fixture(scope="module")
def probe_run(
    store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """An 8-way probe run over a store of the FewRel fixture in 5 segments (80 prompts; tiny model,
    one short episode)."""
    from actstore.jobs.probe import record_probe
    from actstore.query.analyses.probe import ProbeConfig, run_probe

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = store_factory("llama", dataset=f"fewrel:{FEWREL_FIXTURE}", limit=10, segment_size=16)
        dst = tmp_path_factory.mktemp("dask-pred") / "store"
        shutil.copytree(src, dst)
        store = actstore.open(dst)
        out = run_probe(
            store,
            ProbeConfig(
                kind="attn_head",
                n_way=N_RELATIONS,
                k_shot=5,
                queries=5,
                episodes=1,
                seeds=(0,),
                top_k=40,
                epochs=5,
            ),
        )
        record_probe(store, out)
    finally:
        torch.set_num_threads(old)
    return dst, out.run_id


@pytest.fixture(scope="module")
def kg_files(probe_run: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The CoDEx-M fixture (it covers part of the FewRel fixture's pairs) plus two files that cover
    about half the store's instances, with each entity's properties spread over both files."""
    store = actstore.open(probe_run[0])
    rng = random.Random(0)
    files = [tmp_path_factory.mktemp("kg") / f"part{i}.tsv" for i in range(2)]
    lines: list[list[str]] = [[], []]
    for r in instances(store):
        m = json.loads(str(r["meta"]))
        if rng.random() < 0.5:
            continue
        for ent in (m["subject_qid"], m["object_qid"]):
            for _ in range(rng.randint(0, 4)):
                lines[rng.randint(0, 1)].append(f"{ent}\tP{rng.randint(1, 6)}\tQx{rng.randint(1, 50)}")
        lines[rng.randint(0, 1)].append(f"{m['subject_qid']}\tP{rng.randint(1, 6)}\t{m['object_qid']}")
    for f, ls in zip(files, lines):
        f.write_text("\n".join(ls) + "\n")
    return [*CODEX_FIXTURE, *files]


def frames_equal(a: Any, b: Any) -> None:
    pd.testing.assert_frame_equal(a.to_pandas(), b.to_pandas(), check_exact=True)


def test_predictors_on_dask_equal_in_process(
    probe_run: tuple[Path, str], kg_files: list[Path], client: Any
) -> None:
    path, rid = probe_run
    store = actstore.open(path)
    assert len(store.commits) == 5
    here = relation_predictors(store, rid, kb=kg_files)  # one task of each kind, in this process
    there = relation_predictors(store, rid, kb=kg_files, client=client)  # 3 row tasks, 4 relation tasks
    small = relation_predictors(
        store, rid, kb=kg_files, client=client, segments_per_task=1, relations_per_task=3
    )
    split_here = relation_predictors(store, rid, kb=kg_files, segments_per_task=2, relations_per_task=5)
    for other in (there, small, split_here):
        frames_equal(here.relations, other.relations)
        frames_equal(here.correlations, other.correlations)
        assert other.kb_files == here.kb_files == tuple(str(f) for f in kg_files)
        assert other.kb_coverage == here.kb_coverage
    # The share of instances whose subject and object are both in some file, counted with plain Python.
    entities = {
        e
        for f in kg_files
        for line in f.read_text(encoding="utf-8").splitlines()
        for e in line.split("\t")[::2]
    }
    metas = [json.loads(str(r["meta"])) for r in instances(store)]
    covered = sum(m["subject_qid"] in entities and m["object_qid"] in entities for m in metas)
    assert here.kb_coverage == covered / len(metas)
    # CoDEx alone covers less than CoDEx plus the synthetic files, which cover about half the instances.
    assert relation_predictors(store, rid, kb=CODEX_FIXTURE).kb_coverage < here.kb_coverage < 1


def test_predictors_equal_single_pass_functions(
    probe_run: tuple[Path, str], kg_files: list[Path], client: Any
) -> None:
    """The task results equal the existing whole-corpus functions: bitwise, except TF-IDF (1e-12)."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    path, rid = probe_run
    store = actstore.open(path)
    res = relation_predictors(store, rid, kb=kg_files, client=client)
    rel = {r["relation_id"]: r for r in res.relations.to_pylist()}
    rows = instances(store)  # the probe ran over the whole store (no where)
    ranges = output_ranges(rows)
    conn = connectivity(rows, KnowledgeGraph.load(kg_files))
    # the default concentration: each relation's predicted rows, mean |HeadScore| per unit (pred_abs_score)
    hs = store.sql(
        f"SELECT relation_id, pred_abs_score AS score FROM head_scores WHERE run_id = '{rid}' AND pred_n > 0"
    ).to_pandas()
    assert len(rel) == N_RELATIONS
    for name, r in rel.items():
        assert (r["n_instances"], r["output_range"]) == (ranges[name][0], ranges[name][1])
        assert (r["connectivity"], r["connectivity_coverage"], r["connectivity_covered"]) == conn[name] or (
            np.isnan(r["connectivity"]) and conn[name][2] == 0
        )
        assert r["head_concentration"] == head_concentration(
            hs.loc[hs["relation_id"] == name, "score"].to_numpy()
        )
    assert sum(r["connectivity_covered"] for r in rel.values()) > 20

    # TF-IDF: the module's whole-corpus function bit for bit; scikit-learn's vectorizer to 1e-12,
    # because it keeps each row's terms in first-seen order and sums them in that order.
    sims = tfidf_similarity(rows)
    assert all(rel[n]["tfidf_similarity"] == sims[n] for n in rel)
    texts = [str(r["text"]) for r in rows]
    vec = TfidfVectorizer()
    X = vec.fit_transform(texts)
    terms, idf = inverse_document_frequency(document_frequencies(texts), len(texts))
    assert terms == vec.get_feature_names_out().tolist() and np.array_equal(idf, vec.idf_)
    labels = np.asarray([r["relation_id"] for r in rows])
    for name in rel:
        idx = np.flatnonzero(labels == name)
        sim = (X[idx] @ X[idx].T).toarray()
        want = (sim.sum() - np.trace(sim)) / (idx.size * (idx.size - 1))
        assert abs(rel[name]["tfidf_similarity"] - want) <= 1e-12
        assert 0 < want < 1


def test_cli_correlate_dask(probe_run: tuple[Path, str], kg_files: list[Path], client: Any) -> None:
    path, rid = probe_run
    base = ["correlate", str(path), "--run", rid, "--kb", *map(str, kg_files), "--no-save", "--json"]
    plain = CliRunner().invoke(main, base)
    assert plain.exit_code == 0, plain.output
    r = CliRunner().invoke(main, [*base, "--dask", client.scheduler.address])
    assert r.exit_code == 0, r.output
    assert json.loads(plain.stdout) == json.loads(r.stdout)
    bad = CliRunner().invoke(main, [*base, "--workers", "2", "--dask", "tcp://127.0.0.1:1"])
    # under --json the error is one JSON object on stdout (docs/commands.md, "Errors and exit codes")
    assert bad.exit_code == 2 and bad.stderr == "" and len(bad.stdout.splitlines()) == 1  # a usage error
    err = json.loads(bad.stdout)
    assert err["exit_code"] == 2 and err["error"].startswith("--workers: give a Dask scheduler address")


def test_cli_correlate_kb_by_name(probe_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--kb codex-m`` reads the public CoDEx-M graph through the data set registry (here from
    $ACTSTORE_DATA): the same result as naming its three triple files."""
    path, rid = probe_run
    monkeypatch.setenv("ACTSTORE_DATA", str(FIXTURES))
    base = ["correlate", str(path), "--run", rid, "--no-save", "--json"]
    by_name = CliRunner().invoke(main, [*base, "--kb", "codex-m"])
    assert by_name.exit_code == 0, by_name.output
    files = [str(FIXTURES / "codex_m" / f"{s}.txt") for s in ("train", "valid", "test")]
    by_files = CliRunner().invoke(main, [*base, "--kb", *files])
    assert by_files.exit_code == 0, by_files.output
    got, want = json.loads(by_name.stdout), json.loads(by_files.stdout)
    assert got == want and want["kb_coverage"] > 0
