"""``actstore serve``: every API route through Starlette's test client, with bad input (hostile ids,
layers, heads, table names, SQL) answered by a 4xx of one line, and the store unchanged (its files
hashed before and after).  The browser test is tests/cli/serve/test_serve_browser.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from serve_fixture import HOSTILE_TEXT, build_corpus_serve_store, build_serve_store, tree_hash

import actstore
from actstore.cli import main

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from actstore.query.select.corpus_sources import source_factors  # noqa: E402
from actstore.serve.app import API_ROUTES, create_app  # noqa: E402
from actstore.serve.catalog import Catalog  # noqa: E402

CALLED: set[str] = set()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, TestClient]]:
    path = build_serve_store(tmp_path_factory.mktemp("serve"))
    before = tree_hash(path)
    client = TestClient(create_app(Catalog.open([str(path)])), raise_server_exceptions=False)
    yield path, client
    client.close()
    assert tree_hash(path) == before, "the explorer wrote to the store"


def get(client: TestClient, route: str, url: str, status: int = 200) -> Any:
    CALLED.add(route)
    r = client.get(url)
    assert r.status_code == status, (url, r.status_code, r.text[:500])
    if r.headers["content-type"].startswith("application/json"):
        return r.json()
    return r


def bad(client: TestClient, url: str, status: int) -> str:
    """A refused request: the status, one JSON object with a one-line error (pages: one text line)."""
    r = client.get(url)
    assert r.status_code == status, (url, r.status_code, r.text[:300])
    if url.startswith("/api/"):
        body = r.json()
        text = body["error"]
    else:
        text = r.text.rstrip("\n")
    assert text and "\n" not in text and "Traceback" not in text and 'File "' not in text, (url, text)
    return str(text)


def _run(path: Path) -> str:
    return str(actstore.open(path).sql("SELECT run_id FROM probe_runs").column(0)[0].as_py())


def test_stores_summary_and_relation(served: tuple[Path, TestClient]) -> None:
    path, c = served
    stores = get(c, "/api/stores", "/api/stores")
    assert stores == [{"name": "store", "url": str(path), "model": "tiny-llama", "rows": 18}]
    s = get(c, "/api/s/{store}/summary", "/api/s/store/summary")
    assert s["rows"] == 18 and s["geometry"]["n_layers"] == 2
    assert [r["relation_id"] for r in s["relations"]] == ["P1", "P2", "P3"]
    assert s["analyses"]["probe"] == 1 and s["analyses"]["method comparison"] == 1
    assert {"examples", "probe_runs", "head_scores", "token_scores"} <= {t["table"] for t in s["tables"]}
    rel = get(c, "/api/s/{store}/relations/{relation}", "/api/s/store/relations/P1")
    assert rel["relation_name"] == "city in France" and rel["prompts"] == 6
    (p,) = rel["probes"]
    assert p["kind"] == "attn_head" and p["n_queries"] > 0
    lo, hi = p["accuracy_ci95"]
    assert lo <= p["accuracy"] <= hi and p["f1_ci95"][0] <= p["f1"] <= p["f1_ci95"][1]
    n_pred = sum(r["n"] for r in rel["confusions"]["predicted_as"])
    assert n_pred == p["n_queries"]
    assert rel["headscore_runs"] == [_run(path)]


def test_prompts_paged_and_searched(served: tuple[Path, TestClient]) -> None:
    _, c = served
    page = get(c, "/api/s/{store}/prompts", "/api/s/store/prompts?relation=P2&size=4")
    assert page["total"] == 6 and len(page["rows"]) == 4
    page2 = get(c, "/api/s/{store}/prompts", "/api/s/store/prompts?relation=P2&size=4&page=1")
    assert len(page2["rows"]) == 2 and not {r["example_id"] for r in page["rows"]} & {
        r["example_id"] for r in page2["rows"]
    }
    hit = get(c, "/api/s/{store}/prompts", "/api/s/store/prompts?q=SCRIPT")
    assert [r["text"] for r in hit["rows"]] == [HOSTILE_TEXT]
    # a search text with SQL in it is data, not SQL
    none = get(c, "/api/s/{store}/prompts", "/api/s/store/prompts?q=%27%29%20OR%201%3D1%20--")
    assert none["total"] == 0


def test_another_query_of_a_trained_episode_is_explained_without_training(
    served: tuple[Path, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explorer keeps trained episodes: a second query of one is explained from it (the trainer is
    not called), with the direction and HeadScores of a fresh ``explain_example``."""
    from actstore.query.analyses import probe
    from actstore.query.analyses.explain import explain_example

    path, c = served
    store = actstore.open(path)
    run = _run(path)
    (ep,) = store.sql(
        "SELECT seed, episode, query_ids FROM probe_episodes WHERE run_id = ? ORDER BY seed DESC, episode DESC LIMIT 1",
        [run],
    ).to_pylist()
    first = {
        int(x)
        for x in store.sql(
            "SELECT unnest(query_ids) FROM probe_episodes WHERE run_id = ? AND (seed, episode) < (?, ?)",
            [run, ep["seed"], ep["episode"]],
        )
        .column(0)
        .to_pylist()
    }
    only = [int(x) for x in ep["query_ids"] if int(x) not in first]  # explained from this episode
    assert len(only) >= 2
    a, b = only[:2]
    get(c, "/api/s/{store}/prompts/{example_id}/contributions", f"/api/s/store/prompts/{a}/contributions")
    fresh = explain_example(store, run, b, stored=False)  # trained again, not read from probe_weights

    def no_training(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the episode was trained again")

    monkeypatch.setattr(probe, "train_batched", no_training)
    k = get(c, "/api/s/{store}/prompts/{example_id}/contributions", f"/api/s/store/prompts/{b}/contributions")
    assert (k["seed"], k["episode"]) == (fresh.seed, fresh.episode) == (ep["seed"], ep["episode"])
    assert k["predicted"] == fresh.predicted
    layers, heads = list(fresh.layers), list(fresh.heads)
    u = np.asarray(fresh.direction).reshape(len(layers), len(heads), -1)
    # the explorer read the probe the run trained (two episodes a tensor problem), fresh trained one alone
    want = u[layers.index(k["layer"]), heads.index(k["head"])]
    np.testing.assert_allclose(k["direction"], want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    hs = {
        (int(la), int(h)): float(v) for la, h, v in zip(fresh.unit_layer, fresh.unit_head, fresh.head_scores)
    }
    for (la, h), v in hs.items():
        assert k["headscore_grid"][la][h] == pytest.approx(v, rel=1e-4, abs=1e-6)


def test_a_first_explanation_reads_the_stored_probe_and_older_stores_train_it(
    served: tuple[Path, TestClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the run's probes stored, the first contributions call of an episode trains nothing; a copy of
    the store without ``probe_weights`` (as written before the table existed) trains the episode and
    answers the same values."""
    import shutil

    from actstore.query.analyses import probe

    path, c = served
    store = actstore.open(path)
    run = _run(path)
    assert store.sql("SELECT count(*) FROM probe_weights WHERE run_id = ?", [run]).column(0)[0].as_py() == 6
    ex = int(
        store.sql(
            "SELECT example_id FROM probe_predictions WHERE run_id = ? ORDER BY seed, episode DESC, example_id LIMIT 1",
            [run],
        )
        .column(0)[0]
        .as_py()
    )
    calls: list[int] = []
    real = probe.train_batched

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(probe, "train_batched", spy)
    url = f"/api/s/store/prompts/{ex}/contributions?layer=1&head=2"
    read = get(c, "/api/s/{store}/prompts/{example_id}/contributions", url)
    assert calls == [] and read["mode"] == "probe"
    old = tmp_path / "old"
    shutil.copytree(path, old)
    shutil.rmtree(old / "tables" / "probe_weights")
    client = TestClient(create_app(Catalog.open([str(old)])), raise_server_exceptions=False)
    trained = get(
        client, "/api/s/{store}/prompts/{example_id}/contributions", url.replace("/store/", "/old/")
    )
    client.close()
    assert calls and (trained["seed"], trained["episode"], trained["predicted"]) == (
        read["seed"],
        read["episode"],
        read["predicted"],
    )
    np.testing.assert_allclose(trained["values"], read["values"], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(trained["direction"], read["direction"], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("relations", [None, ["P1", "P3"]])
def test_samples_draw_whole_chunks(served: tuple[Path, TestClient], relations: list[str] | None) -> None:
    """A sample of n rows draws from the fewest chunks (of 4 rows here) that hold n rows, taken in a
    random order: its rows are distinct, in store order, of the chosen relations, and over seeds every
    such row is drawn."""
    from actstore.serve.common import block_sample

    path, _ = served
    store = actstore.open(path)
    rows = store.sql("SELECT example_id, relation_id FROM examples ORDER BY example_id").to_pylist()
    mine = [r["example_id"] for r in rows if relations is None or r["relation_id"] in relations]
    every = store.sql(
        "SELECT t.segment, t.seg_row, e.relation_id FROM targets t JOIN examples e USING (example_id)"
    ).to_pylist()
    size: dict[tuple[int, int], int] = {}
    for r in every:
        if relations is None or r["relation_id"] in relations:
            key = (r["segment"], r["seg_row"] // 4)
            size[key] = size.get(key, 0) + 1
    seen: set[int] = set()
    for seed in range(40):
        sel = block_sample(store, 5, seed, relations, chunk_rows=4)
        ids = [int(x) for x in sel.example_ids]
        assert len(ids) == len(set(ids)) == 5 and set(ids) <= set(mine)
        segs = sel.rows.column("segment").to_pylist()
        at = sel.rows.column("seg_row").to_pylist()
        assert sorted(zip(segs, at)) == list(zip(segs, at))  # store order
        # the chunks drawn from: a random prefix whose last chunk tops n, so they hold < n + 4 rows
        touched = {(s_, a // 4) for s_, a in zip(segs, at)}
        assert sum(size[c] for c in touched) < 5 + 4
        seen |= set(ids)
    assert seen == set(mine)
    assert len(block_sample(store, 100, 0, relations).example_ids) == len(mine)  # fewer rows than n: all


@pytest.mark.parametrize("rel", [None, "P2"])
def test_text_search_pages_with_a_bounded_cost(
    served: tuple[Path, TestClient], monkeypatch: pytest.MonkeyPatch, rel: str | None
) -> None:
    """Each request reads at most SEARCH_BUDGET ids and says where to go on; following ``next`` finds
    every prompt containing the text (case-insensitive), each once, as Python's ``in`` does."""
    from actstore.serve import search

    path, c = served
    monkeypatch.setattr(search, "SEARCH_BUDGET", 5)
    monkeypatch.setattr(search, "SEARCH_BLOCK", 2)
    texts = actstore.open(path).sql("SELECT example_id, relation_id, text FROM examples").to_pylist()
    want = sorted(
        r["example_id"] for r in texts if "i" in r["text"].lower() and rel in (None, r["relation_id"])
    )
    seen: list[int] = []
    after: int | None = None
    for _ in range(30):
        url = "/api/s/store/prompts?q=I&size=3" + (f"&relation={rel}" if rel else "")
        d = get(c, "/api/s/{store}/prompts", url + ("" if after is None else f"&after={after}"))
        assert d["searched"] <= 5 and len(d["rows"]) <= 3 and d["total"] is None
        seen += [r["example_id"] for r in d["rows"]]
        after = d["next"]
        if after is None:
            break
    assert seen == want and len(want) > 3
    whole = get(c, "/api/s/{store}/prompts", "/api/s/store/prompts?q=xyz-nowhere")
    assert whole["total"] is None and whole["next"] is not None  # 18 ids: more than one request's budget


def test_headscores_equal_the_stored_table(served: tuple[Path, TestClient]) -> None:
    path, c = served
    d = get(c, "/api/s/{store}/headscores", "/api/s/store/headscores?relation=P3")
    assert d["run_id"] == _run(path) and len(d["grid"]) == 2 and len(d["grid"][0]) == 4
    rows = (
        actstore.open(path)
        .sql("SELECT layer, head, score FROM head_scores WHERE relation_id = 'P3'")
        .to_pylist()
    )
    for r in rows:
        assert d["grid"][r["layer"]][r["head"]] == pytest.approx(r["score"])
    assert get(c, "/api/s/{store}/headscores", "/api/s/store/headscores")["grid"] is not None


def test_prompt_and_its_contributions_equal_features_on_the_probe_direction(
    served: tuple[Path, TestClient],
) -> None:
    path, c = served
    store = actstore.open(path)
    ex = int(
        store.sql("SELECT example_id FROM token_scores ORDER BY example_id LIMIT 1").column(0)[0].as_py()
    )
    d = get(c, "/api/s/{store}/prompts/{example_id}", f"/api/s/store/prompts/{ex}")
    assert d["example"]["example_id"] == ex and d["runs"] and d["token_scores"]
    assert len(d["tokens"]) == d["example"]["n_tokens"]
    for layer, head in ((0, 1), (1, 3)):
        k = get(
            c,
            "/api/s/{store}/prompts/{example_id}/contributions",
            f"/api/s/store/prompts/{ex}/contributions?layer={layer}&head={head}",
        )
        assert k["mode"] == "probe" and (k["layer"], k["head"]) == (layer, head)
        x = store.select("example_id = ?", params=[ex]).features(
            "attn_head_token", layers=[layer], heads=[head]
        )
        want = x[0, 0, 0, : k["n_src"]].astype(np.float64) @ np.asarray(k["direction"], dtype=np.float64)
        np.testing.assert_allclose(k["values"], want, rtol=1e-4, atol=1e-6)
        a = store.select("example_id = ?", params=[ex]).features("attn_prob", layers=[layer], heads=[head])
        np.testing.assert_allclose(k["attention"], a[0, 0, 0, : k["n_src"]], rtol=1e-5)
    # summed over every head, the values are the stored TokenScore of that prediction (probe run's table)
    total = np.zeros(k["n_src"])
    for layer in range(2):
        for head in range(4):
            total += get(
                c,
                "/api/s/{store}/prompts/{example_id}/contributions",
                f"/api/s/store/prompts/{ex}/contributions?layer={layer}&head={head}",
            )["values"]
    stored = (
        store.sql(
            "SELECT scores FROM token_scores WHERE example_id = ? AND seed = ? AND episode = ?",
            [ex, k["seed"], k["episode"]],
        )
        .column(0)[0]
        .as_py()
    )
    np.testing.assert_allclose(total, stored, rtol=1e-4, atol=1e-6)
    # the default head is the one with the largest |HeadScore| of this prediction
    k = get(
        c, "/api/s/{store}/prompts/{example_id}/contributions", f"/api/s/store/prompts/{ex}/contributions"
    )
    flat = [abs(v) for row in k["headscore_grid"] for v in row if v is not None]
    assert abs(k["headscore_grid"][k["layer"]][k["head"]]) == pytest.approx(max(flat))
    # tracing and patching of a fact that has them
    traced = int(store.sql("SELECT min(example_id) FROM trace_effects").column(0)[0].as_py())
    t = get(c, "/api/s/{store}/prompts/{example_id}", f"/api/s/store/prompts/{traced}")
    assert [x["component"] for x in t["tracing"]] == ["attn", "mlp", "resid"]
    assert {x["component"] for x in t["patching"]} == {"head", "resid"}


def test_head_methods_tables_features(served: tuple[Path, TestClient]) -> None:
    path, c = served
    h = get(c, "/api/s/{store}/heads/{layer}/{head}", "/api/s/store/heads/1/2")
    assert len(h["maps"]) == 3 and len(h["salient"]) == 3 and len(h["headscores"]) == 3
    assert len(h["top_prompts"]) == 18 and h["sampled"] == {"rows": 18, "of": 18}
    norms = [p["norm"] for p in h["top_prompts"]]
    assert norms == sorted(norms, reverse=True)
    x = actstore.open(path).select().features("attn_head", layers=[1], heads=[2])[:, 0, 0]
    assert max(norms) == pytest.approx(float(np.linalg.norm(x, axis=1).max()), rel=1e-5)
    m = get(c, "/api/s/{store}/methods", "/api/s/store/methods")
    assert m["run_id"] == "agree-test" and m["agreement"][0]["key_layer_kappa"] == 0.45
    assert (
        m["methods"] == ["patch", "trace"]
        and m["total"] == 3
        and set(m["facts"][0]["key_layer"]) == {"patch", "trace"}
    )
    t = get(c, "/api/s/{store}/tables/{table}", "/api/s/store/tables/examples?size=5&page=3")
    assert t["total"] == 18 and len(t["rows"]) == 3
    every = actstore.open(path).sql("SELECT * FROM examples ORDER BY example_id").to_pylist()
    assert t["rows"] == json.loads(json.dumps(every[15:], default=str))
    f = get(c, "/api/s/{store}/features", "/api/s/store/features?kind=resid&layer=2&relations=P1,P3&n=10")
    assert f["n"] == 10 and {p["relation_id"] for p in f["points"]} <= {"P1", "P3"}
    f = get(c, "/api/s/{store}/features", "/api/s/store/features?kind=attn_head&layer=0&head=1")
    assert f["n"] == 18 and 0 < f["explained"][0] <= 1
    # the PCA of attn_head (from z and W_O) equals numpy's SVD of the features themselves
    store = actstore.open(path)
    for url, heads in (("kind=attn_head&layer=1&n=12&seed=3", None), ("kind=attn_head&layer=0&head=1", [1])):
        f = get(c, "/api/s/{store}/features", f"/api/s/store/features?{url}")
        ids = [p["example_id"] for p in f["points"]]
        layer = 1 if heads is None else 0
        x = store.select(f"example_id IN ({', '.join(map(str, ids))})").features(
            "attn_head", layers=[layer], heads=heads
        )
        assert store.select(f"example_id IN ({', '.join(map(str, ids))})").example_ids.tolist() == ids
        x = x.reshape(len(ids), -1).astype(np.float64)
        u, sv, _ = np.linalg.svd(x - x.mean(0), full_matrices=False)
        want = u[:, :2] * sv[:2]
        got = np.array([[p["x"], p["y"]] for p in f["points"]])
        np.testing.assert_allclose(np.abs(got), np.abs(want), rtol=1e-4, atol=1e-5 * sv[0])
        np.testing.assert_allclose(f["explained"], (sv**2 / (sv**2).sum())[:2], rtol=1e-4)


def test_sql_console_pages_and_downloads(served: tuple[Path, TestClient]) -> None:
    _, c = served
    q = "SELECT example_id, text FROM examples ORDER BY 1"
    p = get(c, "/api/s/{store}/sql", f"/api/s/store/sql?q={q}&size=5&page=1")
    assert (
        p["columns"] == ["example_id", "text"] and [r[0] for r in p["rows"]] == [5, 6, 7, 8, 9] and p["more"]
    )
    last = get(c, "/api/s/{store}/sql", f"/api/s/store/sql?q={q}&size=5&page=3")
    assert len(last["rows"]) == 3 and not last["more"]
    csv = get(c, "/api/s/{store}/sql", f"/api/s/store/sql?q={q}&format=csv")
    assert csv.headers["content-type"].startswith("text/csv") and csv.text.count("\n") == 19
    assert "attachment" in csv.headers["content-disposition"]
    pqr = get(c, "/api/s/{store}/sql", f"/api/s/store/sql?q={q}&format=parquet")
    import io

    t = pq.read_table(io.BytesIO(pqr.content))
    assert t.num_rows == 18 and t.column("text")[0].as_py() == HOSTILE_TEXT


@pytest.mark.parametrize(
    "q",
    [
        "SELECT example_id, relation_id, text FROM examples ORDER BY relation_id DESC, example_id",
        "SELECT example_id, query_ids FROM probe_episodes, unnest(query_ids) AS u(example_id) ORDER BY 1, 2",
    ],
)
def test_console_pages_equal_the_statement_paged_by_sql(
    served: tuple[Path, TestClient], monkeypatch: pytest.MonkeyPatch, q: str
) -> None:
    """Paging through a statement, across windows of pages read at once, gives the rows of the statement
    run whole (numbered by DuckDB here); a page inside a window already read runs no statement, and a
    statement with a list column is read a page at a time."""
    from urllib.parse import quote

    from actstore.serve import console

    path, c = served
    monkeypatch.setattr(console, "PAGES_AHEAD", 2)
    whole = [list(r.values()) for r in actstore.open(path).sql(q).to_pylist()]
    ran: list[str] = []
    real = console.StoreReader.sql

    def spy(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        ran.append(query)
        return real(self, query, *args, **kwargs)

    monkeypatch.setattr(console.StoreReader, "sql", spy)
    got: list[Any] = []
    for page in range(30):
        before = len(ran)
        d = get(c, "/api/s/{store}/sql", f"/api/s/store/sql?q={quote(q)}&size=3&page={page}")
        got += d["rows"]
        windowed = "query_ids" not in q
        if windowed and page % 2 == 1:
            assert len(ran) == before  # cut from the window read with the page before
        if not d["more"]:
            break
    assert got == whole and len(whole) > 6
    pages = page + 1
    statements = [x for x in ran if "LIMIT ? OFFSET ?" in x]
    assert len(statements) == ((pages + 1) // 2 if "query_ids" not in q else pages)


@pytest.fixture(scope="module")
def corpus_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, TestClient]]:
    from actstore.serve.corpus import load_direction_files

    path = build_corpus_serve_store(tmp_path_factory.mktemp("serve-corpus"))
    before = tree_hash(path)
    app = create_app(
        Catalog.open([str(path)]),
        warm_up=False,
        directions=load_direction_files([str(path.parent / "probe.npy")]),
    )
    client = TestClient(app, raise_server_exceptions=False)
    yield path, client
    client.close()
    assert tree_hash(path) == before, "the explorer wrote to the store"


def test_corpus_home_search_and_no_relation_table(corpus_served: tuple[Path, TestClient]) -> None:
    path, c = corpus_served
    s = actstore.open(path)
    d = get(c, "/api/s/{store}/corpus", "/api/s/corpus/corpus")
    assert d["documents"] == 12 and d["tokens"] == s.n_rows
    assert set(d["kept"]) == {"mlp", "resid", "z"} and d["directions"] == {"probe": {"units": 3, "d": 64}}
    assert d["sources"] == 4
    assert [(r["kind"], r["layer"], r["units"], r["k"]) for r in d["topk"]] == [("mlp", 1, 128, 20)]
    hits = get(c, "/api/s/{store}/tokens", "/api/s/corpus/tokens?q=OW")["hits"]
    want = s.sql("SELECT row FROM positions WHERE contains(lower(token), 'ow') ORDER BY row").column(0)
    assert [h["row"] for h in hits] == want.to_pylist()[:50] and hits
    assert all("ow" in h["token"].lower() for h in hits)
    page = c.get("/s/corpus").text
    assert 'data-corpus="1"' in page
    # the relation, head and prompt pages of a corpus store lead to its own views
    r = c.get("/s/corpus/head/0/1", follow_redirects=False)
    assert r.status_code == 302 and r.headers["location"] == "/s/corpus/unit/head/0/1"
    r = c.get("/s/corpus/prompt/5", follow_redirects=False)
    assert r.status_code == 302 and r.headers["location"].startswith("/s/corpus/document/0?row=5")
    assert c.get("/s/corpus/relation/P1", follow_redirects=False).headers["location"] == "/s/corpus"


def _mlp(s: Any, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(store rows, the stored MLP activations [n, d_mlp] of ``layer``), read whole through zarr."""
    sel = s.select()
    segs, srow = sel.rows.column("segment").to_numpy(), sel.rows.column("seg_row").to_numpy()
    a = np.concatenate(
        [np.asarray(s.array(int(g), "mlp")[:])[srow[segs == g], layer] for g in np.unique(segs)]
    )
    return sel.rows.column("row").to_numpy(), a.astype(np.float32)


def test_unit_pages_equal_numpy(corpus_served: tuple[Path, TestClient]) -> None:
    path, c = corpus_served
    s = actstore.open(path)
    for layer in (0, 1):  # layer 1 read from the topk table, layer 0 computed on demand
        rows, a = _mlp(s, layer)
        d = get(c, "/api/s/{store}/units/{kind}/{layer}/{index}", f"/api/s/corpus/units/mlp/{layer}/7")
        assert d["source"].startswith("precomputed" if layer == 1 else "computed on demand")
        order = np.lexsort((rows, -a[:, 7]))[:20]
        assert [t["row"] for t in d["top"]] == rows[order].tolist()
        np.testing.assert_allclose([t["value"] for t in d["top"]], a[order, 7], rtol=1e-6)
        t0 = d["top"][0]
        at = [x for x in t0["tokens"] if x["at"]]
        assert len(at) == 1 and at[0]["row"] == t0["row"] and abs(at[0]["value"] - t0["value"]) < 1e-6
        h = d["histogram"]
        assert (
            sum(h["counts"]) == h["n"] == s.n_rows and abs(h["active"] - float((a[:, 7] > 0).mean())) < 1e-9
        )
        # the logit effects: the neuron's row of W_down through the final norm weight and the unembedding
        w = s.weight("W_down", layer)[7] * s.weight("final_norm_weight")
        logits = s.weight("unembed") @ w
        assert [t["token_id"] for t in d["logits"]["promoted"]] == np.argsort(-logits)[:12].tolist()
        assert [t["token_id"] for t in d["logits"]["suppressed"]] == np.argsort(logits)[:12].tolist()
    # a head: its output norm, from the stored z
    sel = s.select()
    rows = sel.rows.column("row").to_numpy()
    norm = np.linalg.norm(sel.features("attn_head", layers=[1])[:, 0, 2], axis=-1)
    d = get(c, "/api/s/{store}/units/{kind}/{layer}/{index}", "/api/s/corpus/units/head/1/2?k=5")
    order = np.lexsort((rows, -norm))[:5]
    assert [t["row"] for t in d["top"]] == rows[order].tolist() and d["logits"] is None and d["logits_note"]
    # a head read along a direction (the served file's first row): u . z_h W_O,h, from the stored z
    w0 = np.load(path.parent / "probe.npy")[0]
    along = sel.features("attn_head", layers=[1])[:, 0, 2] @ w0
    d = get(c, "/api/s/{store}/units/{kind}/{layer}/{index}", "/api/s/corpus/units/head/1/2?direction=probe")
    order = np.lexsort((rows, -along))[:20]
    assert [t["row"] for t in d["top"]] == rows[order].tolist() and d["source"].startswith("computed")
    np.testing.assert_allclose([t["value"] for t in d["top"]], along[order], rtol=1e-4, atol=1e-6)
    h = d["histogram"]
    assert sum(h["counts"]) == h["n"] == s.n_rows and abs(h["active"] - float((along > 0).mean())) < 1e-9
    assert "along probe" in d["label"] and d["logits"]["promoted"][0]["token_id"] == int(
        np.argmax(s.weight("unembed") @ (w0 * s.weight("final_norm_weight")))
    )
    assert c.get("/s/corpus/unit/head/1/2?direction=probe").status_code == 200
    # ... and along another row of the served file: NAME[ROW]
    w1 = np.load(path.parent / "probe.npy")[1]
    along1 = sel.features("attn_head", layers=[1])[:, 0, 2] @ w1
    d = get(
        c, "/api/s/{store}/units/{kind}/{layer}/{index}", "/api/s/corpus/units/head/1/2?direction=probe[1]"
    )
    order = np.lexsort((rows, -along1))[:20]
    assert [t["row"] for t in d["top"]] == rows[order].tolist() and "along probe[1]" in d["label"]
    np.testing.assert_allclose([t["value"] for t in d["top"]], along1[order], rtol=1e-4, atol=1e-6)
    # a direction of the served file, at a residual index
    w = np.load(path.parent / "probe.npy")[2]
    proj = sel.features("resid", layers=[2])[:, 0] @ w
    d = get(
        c, "/api/s/{store}/units/{kind}/{layer}/{index}", "/api/s/corpus/units/direction/2/2?direction=probe"
    )
    order = np.lexsort((rows, -proj))[:20]
    assert [t["row"] for t in d["top"]] == rows[order].tolist()
    np.testing.assert_allclose([t["value"] for t in d["top"]], proj[order], rtol=1e-4, atol=1e-6)
    assert d["logits"]["promoted"][0]["token_id"] == int(
        np.argmax(s.weight("unembed") @ (w * s.weight("final_norm_weight")))
    )
    for u in (
        "/s/corpus/unit/mlp/1/7",
        "/s/corpus/unit/head/1/2",
        "/s/corpus/unit/direction/2/2?direction=probe",
    ):
        assert c.get(u).status_code == 200
    # a neuron's output weights or a token's unembedding, computed on demand from the store's weights
    for spec, w in (("neuron:1:3", s.weight("W_down", 1)[3]), ("token:7", None)):
        d = get(
            c,
            "/api/s/{store}/units/{kind}/{layer}/{index}",
            f"/api/s/corpus/units/direction/2/0?direction={spec}",
        )
        if w is None:
            u = s.weight("embed")[7] * s.weight("final_norm_weight")  # tiny Llama ties the unembedding
            w = u
        proj = sel.features("resid", layers=[2])[:, 0] @ w
        order = np.lexsort((rows, -proj))[:20]
        assert [t["row"] for t in d["top"]] == rows[order].tolist(), spec
    r = c.get("/api/s/corpus/units/direction/2/0?direction=neuron:1:999")
    assert r.status_code == 400 and "neuron 999" in r.json()["error"]
    r = c.get("/api/s/corpus/units/direction/2/0?direction=sae:/etc/hostname:0")  # no file is read
    assert r.status_code == 404 and "is served" in r.json()["error"]


def test_document_view_colours_every_token(corpus_served: tuple[Path, TestClient]) -> None:
    path, c = corpus_served
    s = actstore.open(path)
    rows, a = _mlp(s, 1)
    d = get(c, "/api/s/{store}/documents/{document}", "/api/s/corpus/documents/1?kind=mlp&layer=1&index=7")
    want = s.sql("SELECT row, token FROM positions WHERE document = 1 ORDER BY row").to_pydict()
    assert [t["row"] for t in d["tokens"]] == want["row"] and [t["token"] for t in d["tokens"]] == want[
        "token"
    ]
    by_row = dict(zip(rows.tolist(), a[:, 7].tolist()))
    np.testing.assert_allclose(d["values"], [by_row[r] for r in want["row"]], rtol=1e-6)
    assert d["attention"] == {"sources": 4, "layers": [0, 1], "heads": 4, "note": None}
    plain = get(c, "/api/s/{store}/documents/{document}", "/api/s/corpus/documents/1")
    assert plain["values"] is None
    assert c.get("/s/corpus/document/1?kind=mlp&layer=1&index=7").status_code == 200


def test_attention_pattern_equals_the_stored_top_sources(corpus_served: tuple[Path, TestClient]) -> None:
    """A head's pattern over a document: per token, the kept sources (document indices) and weights of
    source_factors, read by a plain loop; the kept mass their sum; every source earlier in its window."""
    path, c = corpus_served
    s = actstore.open(path)
    pos = s.sql("SELECT row, window_index FROM positions WHERE document = 2 ORDER BY row").to_pydict()
    rows = np.array(pos["row"])
    d = get(
        c,
        "/api/s/{store}/documents/{document}/attention",
        "/api/s/corpus/documents/2/attention?layer=1&head=3",
    )
    assert d["rows"] == rows.tolist() and d["sources_kept"] == 4 and not d["more"]
    f = source_factors(s, rows, [1], [3])
    for t in range(len(rows)):
        want = sorted(
            [int(src - rows[0]), float(w)]
            for src, w in zip(f.source_row[t, 0, 0], f.weight[t, 0, 0], strict=True)
            if src >= 0
        )
        got = d["sources"][t]
        assert [j for j, _ in got] == [j for j, _ in want]
        np.testing.assert_allclose([w for _, w in got], [w for _, w in want], rtol=1e-6)
        assert all(j <= t and pos["window_index"][j] == pos["window_index"][t] for j, _ in got)
        assert 0 < d["mass"][t] <= 1 + 1e-6 and abs(d["mass"][t] - sum(w for _, w in got)) < 1e-5
    assert c.get("/s/corpus/document/2?att_layer=1&att_head=3").status_code == 200
    # from a later token: the same rows' sources, indexed among the tokens shown (earlier sources not drawn)
    e = get(
        c,
        "/api/s/{store}/documents/{document}/attention",
        "/api/s/corpus/documents/2/attention?layer=1&head=3&start=2",
    )
    assert e["start"] == 2 and e["rows"] == rows[2:].tolist() and e["mass"] == d["mass"][2:]
    assert e["sources"] == [[[j - 2, w] for j, w in src if j >= 2] for src in d["sources"][2:]]
    for url in (
        "/api/s/corpus/documents/2/attention?layer=2&head=0",
        "/api/s/corpus/documents/2/attention?layer=1&head=4",
        "/api/s/corpus/documents/2/attention?layer=x&head=0",
        "/api/s/corpus/documents/2/attention?head=0",
        "/api/s/corpus/documents/99/attention?layer=0&head=0",
        f"/api/s/corpus/documents/2/attention?layer=1&head=3&start={len(rows)}",
        "/api/s/corpus/documents/2/attention?layer=1&head=3&start=-1",
    ):
        r = c.get(url)
        assert 400 <= r.status_code < 500 and "\n" not in r.json()["error"], url


def test_a_corpus_store_without_sources_says_which_ingest_option(tmp_path: Path) -> None:
    path = build_corpus_serve_store(tmp_path, docs=2, words=4, topk=False, sources=None)
    c = TestClient(create_app(Catalog.open([str(path)]), warm_up=False), raise_server_exceptions=False)
    d = c.get("/api/s/corpus/documents/0").json()
    assert d["attention"]["sources"] == 0 and "--sources K" in d["attention"]["note"]
    r = c.get("/api/s/corpus/documents/0/attention?layer=0&head=0")
    assert r.status_code == 400 and "--sources K" in r.json()["error"] and "\n" not in r.json()["error"]
    c.close()


def test_bad_units_layers_directions_are_one_line_4xx(corpus_served: tuple[Path, TestClient]) -> None:
    _, c = corpus_served
    for url, status in [
        ("/api/s/corpus/units/mlp/9/1", 400),
        ("/api/s/corpus/units/mlp/1/128", 404),
        ("/api/s/corpus/units/mlp/x/1", 400),
        ("/api/s/corpus/units/head/0/4", 404),
        ("/api/s/corpus/units/bogus/0/0", 404),
        ("/api/s/corpus/units/direction/2/0?direction=nope", 404),
        ("/api/s/corpus/units/head/1/2?direction=nope", 404),
        ("/api/s/corpus/units/direction/2/3?direction=probe", 404),
        ("/api/s/corpus/units/head/1/2?direction=probe[3]", 404),
        ("/api/s/corpus/units/direction/2/0?direction=probe[1]", 404),
        ("/api/s/corpus/units/direction/3/0?direction=probe", 400),
        ("/api/s/corpus/documents/99", 404),
        ("/api/s/corpus/documents/1;DROP", 400),
        ("/api/s/corpus/documents/1?kind=mlp&layer=1&index=999", 404),
        ("/s/corpus/unit/mlp/1/128", 404),
        ("/s/corpus/unit/direction/2/0", 404),
        ("/s/corpus/document/99", 404),
    ]:
        bad(c, url, status)
    # a browser's 404 page: the line and a way back home
    r = c.get("/s/corpus/unit/mlp/1/128", headers={"accept": "text/html"})
    assert r.status_code == 404 and 'href="/"' in r.text and "neuron 128" in r.text


def test_corpus_routes_refuse_a_prompt_store(served: tuple[Path, TestClient]) -> None:
    _, c = served
    assert "no corpus store" in bad(c, "/api/s/store/corpus", 404)
    bad(c, "/api/s/store/units/mlp/0/0", 404)


def test_openapi_lists_every_route(served: tuple[Path, TestClient]) -> None:
    _, c = served
    doc = c.get("/api/openapi.json").json()
    assert doc["openapi"].startswith("3.") and set(doc["paths"]) == {p for p, _ in API_ROUTES} | {
        "/api/openapi.json"
    }
    params = {
        p["name"]
        for p in doc["paths"]["/api/s/{store}/prompts/{example_id}/contributions"]["get"]["parameters"]
    }
    assert params == {"store", "example_id", "run", "layer", "head"}


def test_every_route_is_tested() -> None:
    """The tests above call every API route (this test runs after them in file order)."""
    assert {p for p, _ in API_ROUTES} <= CALLED | {"/api/stores"}, {p for p, _ in API_ROUTES} - CALLED


HOSTILE_IDS = [
    "1;DROP TABLE examples",
    "1 OR 1=1",
    "abc",
    "1e3",
    "0x10",
    "99999999999999999999999",
    "%00",
    "%3Cscript%3E",
]


def test_hostile_parameters_are_one_line_4xx(served: tuple[Path, TestClient]) -> None:
    _, c = served
    for ex in HOSTILE_IDS:
        assert bad(c, f"/api/s/store/prompts/{ex}", 400).startswith("example_id must be a whole number")
        bad(c, f"/api/s/store/prompts/{ex}/contributions", 400)
        bad(c, f"/s/store/prompt/{ex}", 400)
    assert bad(c, "/api/s/store/prompts/123456", 404) == "example 123456 is not in the store"
    bad(c, "/api/s/store/prompts/-1", 404)
    bad(c, "/api/s/store/prompts/..%2F..%2Fetc%2Fpasswd", 404)
    for layer, head in (("2", "0"), ("-1", "0"), ("x", "0"), ("0", "4"), ("0", "1.5"), ("0", "-0x1")):
        bad(c, f"/api/s/store/heads/{layer}/{head}", 400)
        bad(c, f"/api/s/store/prompts/1/contributions?layer={layer}&head={head}", 400)
        bad(c, f"/s/store/head/{layer}/{head}", 400)
    for table, status in (
        ("runs;DROP", 400),
        ('examples"', 400),
        ("..%2Fsegments", 404),
        ("x" * 300, 400),
        ("nosuch", 404),
    ):
        bad(c, f"/api/s/store/tables/{table}", status)
    bad(c, "/api/s/store/tables/../tables", 404)  # the client resolves the dots: no such route
    bad(c, "/s/store/table/nosuch", 404)
    for rel in ("%3Cscript%3Ealert(1)%3C%2Fscript%3E", "P1'--", "P9"):
        bad(c, f"/api/s/store/relations/{rel}", 404)
    bad(c, "/api/s/store/relations/%01", 400)
    bad(c, "/api/s/store/prompts?relation=%3Cb%3E", 404)
    bad(c, "/api/s/store/relations/P1?run=bad%20run!", 400)
    bad(c, "/api/s/store/relations/P1?run=no-such-run", 404)
    bad(c, "/api/s/store/prompts/1/contributions?run=no-such-run", 404)
    for store in ("nope", "..", "%2E%2E", "x" * 200):
        bad(c, f"/api/s/{store}/summary", 404)
    for q in ("page=-1", "page=x", "size=0", "size=100000", "page=1e9", "q=a&after=1;DROP", "q=a&after=0x10"):
        bad(c, f"/api/s/store/prompts?{q}", 400)
    bad(c, "/api/s/store/prompts?q=" + "x" * 300, 400)
    for q in (
        "kind=bogus",
        "kind=attn_head_token",
        "layer=9",
        "kind=resid&head=1",
        "n=1",
        "n=99999",
        "relations=P1,P9",
    ):
        status = 404 if "P9" in q else 400
        bad(c, f"/api/s/store/features?{q}", status)


SQL_ERRORS = [
    ("SELEC 1", "SQL error"),
    ("DROP TABLE examples", "read-only"),
    ("COPY examples TO '/tmp/x.csv'", "read-only"),
    ("SELECT * FROM read_csv('/etc/passwd')", ""),
    ("SELECT 1; SELECT 2", "exactly one statement"),
    ("ATTACH '/tmp/x.db'", "read-only"),
    ("SELECT * FROM nosuch", "SQL error"),
    ("", "no statement"),
    ("SELECT 1) UNION (SELECT 2", ""),
    ("INSTALL httpfs", "read-only"),
]


def test_sql_errors_are_one_line_4xx(served: tuple[Path, TestClient]) -> None:
    _, c = served
    from urllib.parse import quote

    for q, want in SQL_ERRORS:
        for fmt in ("json", "csv"):
            text = bad(c, f"/api/s/store/sql?format={fmt}&q={quote(q)}", 400)
            assert want.lower() in text.lower(), (q, text)
    bad(c, "/api/s/store/sql?format=xlsx&q=SELECT%201", 400)
    bad(c, "/api/s/store/sql?q=" + quote("SELECT 1 -- " + "x" * 20_000), 400)


def test_pages_escape_store_strings(served: tuple[Path, TestClient]) -> None:
    _, c = served
    for url in (
        "/s/store",
        "/s/store/relation/P1",
        "/s/store/prompt/0",
        "/s/store/head/0/0",
        "/s/store/heads",
        "/s/store/methods",
        "/s/store/sql",
        "/s/store/features",
        "/s/store/table/examples",
    ):
        r = c.get(url)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), url
        assert r.text.count("<script") == 1 and '<script src="/static/app.js">' in r.text, url
        assert "default-src 'self'" in r.headers["content-security-policy"]
    page = c.get("/s/store/prompt/0").text
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    assert c.get("/").status_code == 200  # redirected to the one store
    for asset in ("/static/app.js", "/static/style.css"):
        assert c.get(asset).status_code == 200
    assert "innerHTML" not in c.get("/static/app.js").text


def test_serve_command_refuses_remote_hosts_without_the_flag(
    served: tuple[Path, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = served
    r = CliRunner().invoke(main, ["serve", str(path), "--host", "0.0.0.0"])
    assert r.exit_code == 2 and "--allow-remote" in r.output and r.output.count("\n") == 1
    seen: dict[str, Any] = {}
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    r = CliRunner().invoke(main, ["serve", str(path), "--host", "0.0.0.0", "--allow-remote", "--port", "9"])
    assert r.exit_code == 0 and "warning: serving on 0.0.0.0" in r.stderr
    assert seen == {"host": "0.0.0.0", "port": 9, "log_level": "warning"}
    r = CliRunner().invoke(main, ["serve", str(path)])
    assert r.exit_code == 0 and "http://127.0.0.1:8765/" in r.stderr and seen["host"] == "127.0.0.1"
    r = CliRunner().invoke(main, ["serve", str(path.parent / "nope")])
    assert r.exit_code == 1 and r.output.startswith("error: ") and r.output.count("\n") == 1
    # a folder of stores: served by their names
    r = CliRunner().invoke(main, ["serve", str(path.parent)])
    assert r.exit_code == 0 and "serving store on" in r.stderr
    assert json.loads(json.dumps(seen))["port"] == 8765


def test_several_stores_by_name(served: tuple[Path, TestClient]) -> None:
    path, _ = served
    with TestClient(create_app(Catalog.open([str(path), str(path)])), raise_server_exceptions=False) as c:
        assert [s["name"] for s in c.get("/api/stores").json()] == ["store", "store-2"]
        index = c.get("/")
        assert index.status_code == 200 and 'href="/s/store-2"' in index.text
        assert c.get("/api/s/store-2/summary").json()["rows"] == 18


def test_concurrent_requests_run_in_parallel_and_answer_as_serial_ones(
    served: tuple[Path, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests to one store run at the same time (none waits for another: the first ``N`` meet at a
    barrier, which a per-store lock would never let them reach together) and each answers exactly as
    the same request does alone, one after another, on an explorer of its own (both cold: nothing
    built before, so the concurrent ones also build the views, caches and SQL cursors together)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import quote

    from actstore.core.store import StoreReader

    path, _ = served
    store = actstore.open(path)
    exs = [int(r["example_id"]) for r in store.sql("SELECT example_id FROM examples ORDER BY 1").to_pylist()]
    g = store.geometry
    sorts = [
        "SELECT example_id, relation_id, text FROM examples ORDER BY relation_id DESC, example_id",
        "SELECT t.example_id, e.text FROM targets t JOIN examples e USING (example_id) ORDER BY e.text",
        "SELECT relation_id, count(*) AS n, min(text) AS t FROM examples GROUP BY 1 ORDER BY 1",
    ]
    urls = (
        ["/api/s/store/summary", "/api/s/store/methods", "/api/s/store/headscores"]
        + [f"/api/s/store/relations/{r}" for r in ("P1", "P2", "P3")]
        + [f"/api/s/store/prompts?relation=P{i}&size=4&page=1" for i in (1, 2, 3)]
        + [f"/api/s/store/prompts?q={w}&size=5" for w in ("is", "in", "Paris")]
        + [f"/api/s/store/prompts/{ex}" for ex in exs[::3]]
        + [f"/api/s/store/prompts/{ex}/contributions?layer=1&head=2" for ex in exs[::4]]
        + [f"/api/s/store/heads/{la}/{h}" for la in range(g.n_layers) for h in range(g.n_heads)]
        + [f"/api/s/store/tables/{t}?size=4&page=1" for t in ("examples", "tokens", "probe_runs")]
        + [f"/api/s/store/sql?q={quote(q)}&size=4&page={p}" for q in sorts for p in (0, 2)]
        + [
            "/api/s/store/features?kind=attn_head&layer=1&n=12&seed=3",
            "/api/s/store/features?kind=resid&layer=2",
        ]
    )

    def client() -> TestClient:
        return TestClient(create_app(Catalog.open([str(path)]), warm_up=False), raise_server_exceptions=False)

    alone = client()
    serial = {u: (r.status_code, r.content) for u in urls for r in [alone.get(u)]}
    assert all(s == 200 for s, _ in serial.values()), [u for u, (s, _) in serial.items() if s != 200]

    # the first n threads to touch the store wait there until all n have: with requests run one at a
    # time the first would wait holding the store, the barrier would break, its request answer 500
    n = 6
    barrier = threading.Barrier(n, timeout=20)
    seen: set[int] = set()
    lock = threading.Lock()

    def meet() -> None:
        me = threading.get_ident()
        with lock:
            if me in seen or len(seen) >= n:
                return
            seen.add(me)
        barrier.wait()

    class Meeting(StoreReader):
        def __getattribute__(self, name: str) -> Any:
            meet()
            return super().__getattribute__(name)

    together = client()
    for s in together.app.state.catalog:
        s.store.__class__ = Meeting
    with ThreadPoolExecutor(n) as pool:
        got = dict(
            zip(urls, pool.map(lambda u: (lambda r: (r.status_code, r.content))(together.get(u)), urls))
        )
    assert len(seen) == n and not barrier.broken
    differ = [u for u in urls if got[u] != serial[u]]
    assert differ == [], differ
    alone.close()
    together.close()
