"""``actstore serve`` latency: each API route over real HTTP (uvicorn on 127.0.0.1, a free port), and
the prompt page's load in Chromium.

    python benchmarks/bench_serve.py STORE [STORE ...] --rounds 7 --json out.json

Per store and route, ``--rounds`` URLs with different parameters taken from the store (relations,
pages, prompts that are queries of the newest per-source probe run, heads, layers): ``first_ms`` is
the median of their first calls (nothing of that view cached; the contributions route reads the
prompt's episode probe from ``probe_weights``, or re-trains the episode for a run stored without
it), ``again_ms`` the median of calling them again (the app's cache); and the first call of another
query of an episode that a call just before explained (the explorer keeps episode probes).  The app's
warm-up (the tables' hashes, the relations, the example ids) runs before the clock starts.  The
prompt page: navigation to ``body[data-ready]`` (every API call of the page answered and drawn) for
``--rounds`` prompts not requested before, in Debian's Chromium driven by Playwright (skipped
without either).  The text search answers its first page (it reads at most 100,000 example ids a
request).  ``parallel``: ``2 x rounds`` prompt (and head) views requested one after another, and as
many others by ``--threads`` threads at once (:func:`measure_parallel`).  ``load_after``: the 1-minute load average
when a store's figures were taken.

Corpus stores (``--corpus-tokens 10000,100000``): for each size a tiny-llama corpus store (``ingest
--positions all --kinds mlp,z``, documents of random words, built once under ``--corpus-dir``) with a
precomputed ``topk`` run of MLP layer 1 (k 20); then a unit page with a precomputed top-k
(``/s/NAME/unit/mlp/1/I`` for ``--rounds`` neurons not requested before) is loaded in Chromium until
``body[data-ready]``, and its API route called first for other neurons (``unit_api``); beside it, the
load of a page that calls no API (``no_api_page``: the SQL console), the browser's own share on a
loaded machine.  With ``--sources K`` the stores keep the top-K attention weights per token and head
(``ingest --sources K``), and beside the unit page: a document's attention pattern (its API route
``/documents/D/attention`` and the document page drawing it, distinct documents and heads; a pattern
reads at most 256 positions of one document), and a head read along a direction
(``/unit/head/1/H?direction=neuron:1:I``, a new direction each call: one streaming pass over every
row), its API route and page, its rows/s and its ratio to reading those rows' ``z`` once in the same
blocks (``read_once``, after one read that puts them in the page cache).  ``load_before`` /
``load_after``: the load averages around each store's figures.

    python benchmarks/bench_serve.py --corpus-tokens 10000,100000 --rounds 7
    python benchmarks/bench_serve.py --corpus-tokens 10000,100000,1000000 --sources 16 --rounds 7
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # `python benchmarks/bench_serve.py` from anywhere
from benchmarks.common import emit  # noqa: E402

WORDS = ["the", "city", "of", "river", "king", "music", "war", "film", "team", "church"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(paths: list[str]) -> tuple[Any, str, list[str]]:
    import uvicorn

    from actstore.serve.app import create_app, warm
    from actstore.serve.catalog import Catalog

    catalog = Catalog.open(paths)
    warm(catalog)  # what `actstore serve` does in the background as it starts
    port = _free_port()
    app = create_app(catalog, warm_up=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"127.0.0.1:{port}", catalog.names


def _get(con: http.client.HTTPConnection, url: str) -> tuple[int, bytes, float]:
    try:
        t0 = time.perf_counter()
        con.request("GET", url)
        r = con.getresponse()
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        con.close()  # the server closed an idle keep-alive connection (a browser run in between)
        t0 = time.perf_counter()
        con.request("GET", url)
        r = con.getresponse()
    body = r.read()
    return r.status, body, 1000 * (time.perf_counter() - t0)


def routes(con: http.client.HTTPConnection, name: str, k: int) -> dict[str, list[str]]:
    """Per route, ``k`` URLs with different parameters picked from the store (a first call of each is
    uncached), or one URL for the routes without parameters."""
    base = f"/api/s/{name}"
    summary = json.loads(_get(con, base + "/summary")[1])
    g = summary["geometry"]
    rels = [r["relation_id"] for r in summary["relations"]]
    rel = rels[0]
    q = "SELECT DISTINCT example_id FROM probe_episodes, unnest(query_ids) AS t(example_id) ORDER BY hash(example_id) LIMIT ?"
    sql = json.loads(_get(con, f"{base}/sql?q={quote(q.replace('?', str(3 * k)))}")[1])
    exs = [r[0] for r in sql.get("rows", [])]
    if not exs:  # no probe run: prompts drawn from the examples (contributions then show norms)
        q = f"SELECT example_id FROM examples ORDER BY hash(example_id) LIMIT {3 * k}"
        exs = [r[0] for r in json.loads(_get(con, f"{base}/sql?q={quote(q)}")[1]).get("rows", [])] or [0]
    # pairs of queries whose first episode is the same (the one the explorer explains them from)
    q2 = (
        "WITH q AS (SELECT seed, episode, unnest(query_ids) AS ex FROM probe_episodes), "
        "f AS (SELECT ex, min(seed * 1000000 + episode) AS k FROM q GROUP BY ex), "
        "g AS (SELECT k, list(ex ORDER BY ex) AS xs FROM f GROUP BY k HAVING count(*) >= 2) "
        "SELECT xs[1], xs[2] FROM g ORDER BY hash(k) LIMIT {n}"
    )
    got = json.loads(_get(con, f"{base}/sql?q={quote(q2.format(n=k))}")[1])
    pairs = [(r[0], r[1]) for r in got.get("rows", [])]
    heads = [(layer, h) for layer in range(g["n_layers"]) for h in range(g["n_heads"])]
    heads = [heads[(i * 7919) % len(heads)] for i in range(k)]
    page_sql = quote("SELECT example_id, relation_id, text FROM examples ORDER BY example_id")
    pick = lambda xs, i: xs[i % len(xs)]  # noqa: E731
    return {
        "/api/stores": ["/api/stores"],
        "summary": [f"{base}/summary"],
        "relation": [f"{base}/relations/{quote(pick(rels, i))}" for i in range(k)],
        "prompts (a page of a relation)": [
            f"{base}/prompts?relation={quote(rel)}&page={i}&size=25" for i in range(k)
        ],
        "prompts (searched by text)": [f"{base}/prompts?q={pick(WORDS, i)}&size=25" for i in range(k)],
        "headscores": [f"{base}/headscores?relation={quote(pick(rels, i))}" for i in range(k)],
        "prompt": [f"{base}/prompts/{pick(exs, i)}" for i in range(k)],
        "contributions (an episode not explained before)": [
            f"{base}/prompts/{pick(exs, k + i)}/contributions" for i in range(k)
        ],
        "head": [f"{base}/heads/{layer}/{h}" for layer, h in heads],
        "methods": [f"{base}/methods"],
        "table page": [f"{base}/tables/examples?page={10 + i}&size=50" for i in range(k)],
        "sql page": [f"{base}/sql?q={page_sql}&page={5 + i}&size=100" for i in range(k)],
        # each URL another statement: nothing of it read before (the pages above share windows of 10)
        "sql page (a new statement)": [
            f"{base}/sql?q={quote(f'SELECT example_id, relation_id, text FROM examples WHERE example_id % 97 <> {i} ORDER BY example_id')}&page=5&size=100"
            for i in range(k)
        ],
        "features (PCA, 500 rows)": [
            f"{base}/features?kind=attn_head&layer={i % g['n_layers']}&n=500&seed={i}" for i in range(k)
        ],
        "_page": [f"/s/{name}/prompt/{pick(exs, 2 * k + i)}" for i in range(k)],
        "_pairs": [f"{base}/prompts/{a}/contributions {base}/prompts/{b}/contributions" for a, b in pairs],
    }


def measure_api(host: str, name: str, rounds: int) -> dict[str, Any]:
    """Per route: the median of the first calls of different URLs (``first_ms``: nothing cached for
    that view) and of the same URLs called again (``again_ms``: the app's cache)."""
    con = http.client.HTTPConnection(host, timeout=600)
    out: dict[str, Any] = {}
    listed = routes(con, name, rounds)
    pages = listed.pop("_page")
    pairs = [p.split(" ") for p in listed.pop("_pairs")]
    for label, urls in listed.items():
        first = []
        for url in urls:
            status, body, ms = _get(con, url)
            if status != 200:
                raise SystemExit(f"{url}: {status} {body[:200]!r}")
            first.append(ms)
        again = [_get(con, url)[2] for url in urls]
        out[label] = {
            "calls": len(urls),
            "first_ms": round(statistics.median(first), 1),
            "first_max_ms": round(max(first), 1),
            "again_ms": round(statistics.median(again), 1),
        }
    if pairs:  # another query of an episode trained for the first: explained from the kept episode
        times = []
        for a, b in pairs:
            _get(con, a)
            status, body, ms = _get(con, b)
            if status != 200:
                raise SystemExit(f"{b}: {status} {body[:200]!r}")
            times.append(ms)
        out["contributions (another query of an episode trained before)"] = {
            "calls": len(times),
            "first_ms": round(statistics.median(times), 1),
            "first_max_ms": round(max(times), 1),
        }
    con.close()
    return {"routes": out, "urls": {k: v[0] for k, v in listed.items()}, "page_urls": pages}


def measure_parallel(host: str, name: str, k: int, threads: int) -> dict[str, Any]:
    """Requests at once to one store, per computing route (prompt views of prompts, and head views of
    heads, not requested before; heads only where the store has ``4 k`` of them): ``k`` URLs one after
    another, then ``k`` others by ``threads`` threads at once (a connection each); the wall time of each
    batch and their ratio (the speed-up of parallel requests; with a lock per store it is at most 1)."""
    from concurrent.futures import ThreadPoolExecutor

    con = http.client.HTTPConnection(host, timeout=600)
    base = f"/api/s/{name}"
    g = json.loads(_get(con, f"{base}/summary")[1])["geometry"]
    q = f"SELECT example_id FROM examples ORDER BY hash(example_id + 7919) LIMIT {2 * k}"
    exs = [r[0] for r in json.loads(_get(con, f"{base}/sql?q={quote(q)}&size=500")[1])["rows"]]
    routes = {"prompt": [f"{base}/prompts/{ex}" for ex in exs]}
    heads = [(layer, h) for layer in range(g["n_layers"]) for h in range(g["n_heads"])]
    if len(heads) >= 4 * k:  # other heads than measure_api's (i * 7919 % n for i < rounds)
        picked = [heads[(i * 7919 + 4099) % len(heads)] for i in range(len(heads))]
        routes["head"] = [f"{base}/heads/{layer}/{h}" for layer, h in dict.fromkeys(picked)][: 2 * k]
    local = threading.local()

    def one(url: str) -> int:
        if not hasattr(local, "con"):
            local.con = http.client.HTTPConnection(host, timeout=600)
        return _get(local.con, url)[0]

    out: dict[str, Any] = {"threads": threads, "requests": k}
    for route, urls in routes.items():
        t0 = time.perf_counter()
        codes = [_get(con, url)[0] for url in urls[:k]]
        serial_ms = 1000 * (time.perf_counter() - t0)
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            codes += list(pool.map(one, urls[k : 2 * k]))
            parallel_ms = 1000 * (time.perf_counter() - t0)
        assert codes == [200] * len(codes), (route, codes)
        out[route] = {
            "serial_ms": round(serial_ms, 1),
            "parallel_ms": round(parallel_ms, 1),
            "speedup": round(serial_ms / parallel_ms, 2),
        }
    con.close()
    return out


def measure_page(host: str, name: str, page_urls: list[str]) -> dict[str, Any] | None:
    """Load time of the prompt page (navigation until every API call of the page is drawn), one
    first load per prompt."""
    import shutil

    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if chromium is None:
        return None
    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        pg = browser.new_page()
        pg.goto(f"http://{host}/s/{name}")  # the script and style in the browser's cache, as for a user
        pg.wait_for_selector("body[data-ready]", timeout=120_000)
        for url in page_urls:
            t0 = time.perf_counter()
            pg.goto(f"http://{host}{url}")
            pg.wait_for_selector("body[data-ready]", timeout=120_000)
            times.append(1000 * (time.perf_counter() - t0))
        browser.close()
    return {
        "loads": len(times),
        "median_ms": round(statistics.median(times), 1),
        "max_ms": round(max(times), 1),
    }


def corpus_store(root: Path, tokens: int, sources: int = 0) -> str:
    """A tiny-llama corpus store of about ``tokens`` positions (built once) with a topk run of MLP layer 1
    (``sources``: ``--sources K`` at ingest, the top-K attention weights per token and head)."""
    import random

    import actstore

    path = root / (f"corpus-{tokens}-s{sources}" if sources else f"corpus-{tokens}")
    if (path / "manifest.json").exists():
        return str(path)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(max(1, tokens // 95))]
    text = root / f"corpus-{tokens}.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    extra: dict[str, Any] = {"sources": str(sources)} if sources else {}
    store = actstore.ingest_corpus(
        path,
        model="tiny-llama",
        dataset=f"text:{text}",
        positions="all",
        kinds=("mlp", "z"),
        storage_dtype="float16",
        batch_size=16,
        segment_size=4096,
        **extra,
    )
    from actstore.jobs.settings import TopkConfig
    from actstore.jobs.topk import run_topk

    run_topk(store, TopkConfig(kind="mlp", layer=1, k=20))
    return str(path)


def _first_calls(con: http.client.HTTPConnection, urls: list[str]) -> dict[str, float]:
    ms = []
    for url in urls:
        status, body, t = _get(con, url)
        if status != 200:
            raise SystemExit(f"{url}: {status} {body[:200]!r}")
        ms.append(t)
    return {"calls": len(ms), "first_ms": round(statistics.median(ms), 1), "max_ms": round(max(ms), 1)}


def read_once(path: str, layer: int) -> tuple[float, int]:
    """Seconds to read every row's ``z`` at ``layer`` once (the blocks a head's streaming pass reads,
    without computing anything), and the rows read."""
    from actstore.core.store import open_reader
    from actstore.query.select.selection import Selection

    store = open_reader(path)
    n = 0
    t0 = time.perf_counter()
    for _ids, block in Selection.from_sql(store).blocks(1024):
        n += store.read_segment_rows(block.segment, "z", block.seg_rows, [layer]).shape[0]
    return time.perf_counter() - t0, n


def measure_corpus(host: str, name: str, rounds: int, path: str, head_rounds: int) -> dict[str, Any]:
    """A precomputed unit page (first API calls and first page loads in Chromium, distinct neurons);
    a document's attention pattern (first API calls and document pages with the pattern, distinct
    documents and heads); a head read along a direction (``neuron:1:I``, each a new direction: one
    streaming pass over every row), its API and page, against reading those rows' ``z`` once."""
    con = http.client.HTTPConnection(host, timeout=600)
    base = f"/api/s/{name}"
    unit_api = _first_calls(con, [f"{base}/units/mlp/1/{100 + i}" for i in range(rounds)])
    page = measure_page(host, name, [f"/s/{name}/unit/mlp/1/{i}" for i in range(rounds)])
    # the browser's own share at the same moment: a page that calls no API (the SQL console, empty)
    baseline = measure_page(host, name, [f"/s/{name}/sql?r={i}" for i in range(rounds)])
    q = f"SELECT DISTINCT document FROM positions ORDER BY hash(document) LIMIT {4 * rounds}"
    docs = [r[0] for r in json.loads(_get(con, f"{base}/sql?q={quote(q)}&size=500")[1])["rows"]]
    out: dict[str, Any] = {"unit_api": unit_api, "unit_page": page, "no_api_page": baseline}
    g = json.loads(_get(con, f"{base}/summary")[1])["geometry"]
    if corpus_sources_of(path):
        H = g["n_heads"]
        out["attention_api"] = _first_calls(
            con,
            [f"{base}/documents/{docs[i]}/attention?layer={i % 2}&head={i % H}" for i in range(rounds)],
        )
        out["document_attention_page"] = measure_page(
            host,
            name,
            [
                f"/s/{name}/document/{docs[rounds + i]}?att_layer={i % 2}&att_head={(i + 1) % H}"
                for i in range(rounds)
            ],
        )
        n_pos = sql_one(con, base, f"SELECT count(*) FROM positions WHERE document = {docs[0]}")
        out["attention_tokens_of_a_document"] = min(256, int(n_pos))
    # a head read along a direction: one streaming pass each (a new direction each: nothing cached)
    layer = 1
    read_once(path, layer)  # the rows in the page cache, as they are for the pass after it
    heads = [(i % g["n_heads"], 10 + i) for i in range(2 * head_rounds)]
    api = _first_calls(
        con, [f"{base}/units/head/{layer}/{h}?direction=neuron:1:{i}" for h, i in heads[:head_rounds]]
    )
    along_page = measure_page(
        host,
        name,
        [f"/s/{name}/unit/head/{layer}/{h}?direction=neuron:1:{i}" for h, i in heads[head_rounds:]],
    )
    t_read, rows = read_once(path, layer)
    out["head_along_direction"] = {
        "api": api,
        "page": along_page,
        "rows": rows,
        "api_rows_per_s": round(rows / (api["first_ms"] / 1000)),
        "read_once_s": round(t_read, 3),
        "read_once_rows_per_s": round(rows / t_read),
        "api_vs_read_once": round(api["first_ms"] / 1000 / t_read, 2),
    }
    out["load_after"] = os.getloadavg()
    con.close()
    return out


def sql_one(con: http.client.HTTPConnection, base: str, q: str) -> Any:
    return json.loads(_get(con, f"{base}/sql?q={quote(q)}")[1])["rows"][0][0]


def corpus_sources_of(path: str) -> int:
    from actstore.core.store import open_reader

    return int(open_reader(path).manifest.ingest.get("sources") or 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="*")
    ap.add_argument(
        "--corpus-tokens", default="", help="comma-separated corpus store sizes (tokens) to build and time"
    )
    ap.add_argument("--corpus-dir", default="/tmp/serve-corpus-bench")
    ap.add_argument(
        "--sources", type=int, default=0, help="build the corpus stores with --sources K (attention pattern)"
    )
    ap.add_argument(
        "--head-rounds",
        type=int,
        default=3,
        help="heads read along a new direction (API calls and pages each)",
    )
    ap.add_argument("--build-only", action="store_true", help="build the corpus stores and stop")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument(
        "--threads", type=int, default=4, help="requests at once in the parallel measurement (1: skip it)"
    )
    a = ap.parse_args(argv)
    if a.corpus_tokens:
        sizes = [int(x) for x in a.corpus_tokens.split(",")]
        paths = [corpus_store(Path(a.corpus_dir), n, a.sources) for n in sizes]
        if a.build_only:
            return
        server, host, names = start(paths)
        out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "corpus": {}}
        try:
            from actstore.core.store import open_reader

            for path, name in zip(paths, names):
                out["corpus"][name] = {
                    "tokens": open_reader(path).n_rows,
                    "load_before": os.getloadavg(),
                    **measure_corpus(host, name, a.rounds, path, a.head_rounds),
                }
                print(f"{name}: {out['corpus'][name]}", file=sys.stderr)
        finally:
            server.should_exit = True
        emit(out, a.json_out)
        return
    if not a.stores:
        ap.error("give a STORE or --corpus-tokens")
    server, host, names = start(a.stores)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "stores": {}}
    try:
        for path, name in zip(a.stores, names):
            from actstore.core.store import open_reader

            rows = open_reader(path).n_rows
            api = measure_api(host, name, a.rounds)
            page = measure_page(host, name, api.pop("page_urls"))
            parallel = measure_parallel(host, name, 2 * a.rounds, a.threads) if a.threads > 1 else None
            load = os.getloadavg()[0]
            result["stores"][name] = {
                "path": path,
                "rows": rows,
                **api,
                "prompt_page": page,
                "parallel": parallel,
                "load_after": load,
            }
            print(f"{name}: {rows} rows", file=sys.stderr)
    finally:
        server.should_exit = True
    emit(result, a.json_out)


if __name__ == "__main__":
    main()
