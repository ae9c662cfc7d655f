"""``actstore serve`` latency: each API route over real HTTP (uvicorn on 127.0.0.1, a free port), and
the prompt page's load in Chromium.

    python benchmarks/bench_serve.py STORE [STORE ...] --rounds 7 --json out.json

Per store and route: the first call (``cold_ms``: the view's caches empty, the store's tables not yet
registered with DuckDB for that statement) and the median of the next ``--rounds`` calls
(``median_ms``; the summary and head views are cached by the app, so their warm figure is the cache).
The parameters are taken from the store: its first relation, the HeadScore run's hottest head for it,
a prompt that is a query of the newest per-source probe run (so the contributions route re-trains that
episode on its first call), a paged SQL statement.  The prompt page: navigation to
``body[data-ready]`` (every API call of the page answered and drawn), first load and the median of
``--rounds`` reloads, in Debian's Chromium driven by Playwright (skipped without either).
"""

from __future__ import annotations

import argparse
import http.client
import json
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(paths: list[str]) -> tuple[Any, str, list[str]]:
    import uvicorn

    from actstore.serve.app import create_app
    from actstore.serve.catalog import Catalog

    catalog = Catalog.open(paths)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(catalog), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"127.0.0.1:{port}", catalog.names


def _get(con: http.client.HTTPConnection, url: str) -> tuple[int, bytes, float]:
    t0 = time.perf_counter()
    con.request("GET", url)
    r = con.getresponse()
    body = r.read()
    return r.status, body, 1000 * (time.perf_counter() - t0)


def routes(con: http.client.HTTPConnection, name: str) -> list[tuple[str, str]]:
    """(route, URL) for every API route, with parameters picked from the store."""
    base = f"/api/s/{name}"
    summary = json.loads(_get(con, base + "/summary")[1])
    rel = summary["relations"][0]["relation_id"]
    hs = json.loads(_get(con, f"{base}/headscores?relation={quote(rel)}")[1])
    layer, head = summary["geometry"]["n_layers"] - 1, 0
    if hs.get("grid"):
        cells = [(v, i, j) for i, row in enumerate(hs["grid"]) for j, v in enumerate(row) if v is not None]
        _, layer, head = max(cells)
    q = "SELECT example_id FROM probe_episodes, unnest(query_ids) AS t(example_id) LIMIT 1"
    sql = json.loads(_get(con, f"{base}/sql?q={quote(q)}")[1])
    ex = sql["rows"][0][0] if sql.get("rows") else 0
    page_sql = quote("SELECT example_id, relation_id, text FROM examples ORDER BY example_id")
    return [
        ("/api/stores", "/api/stores"),
        ("summary", f"{base}/summary"),
        ("relation", f"{base}/relations/{quote(rel)}"),
        ("prompts (page 3, searched)", f"{base}/prompts?relation={quote(rel)}&q=the&page=3&size=25"),
        ("headscores", f"{base}/headscores?relation={quote(rel)}"),
        ("prompt", f"{base}/prompts/{ex}"),
        ("contributions", f"{base}/prompts/{ex}/contributions?layer={layer}&head={head}"),
        ("head", f"{base}/heads/{layer}/{head}"),
        ("methods", f"{base}/methods"),
        ("table page", f"{base}/tables/examples?page=10&size=50"),
        ("sql page", f"{base}/sql?q={page_sql}&page=5&size=100"),
        ("features (PCA, 500 rows)", f"{base}/features?kind=attn_head&layer={layer}&n=500"),
    ]


def measure_api(host: str, name: str, rounds: int) -> dict[str, Any]:
    con = http.client.HTTPConnection(host, timeout=600)
    out: dict[str, Any] = {}
    listed = routes(con, name)
    for label, url in listed:
        status, _, cold = _get(con, url)
        warm = [_get(con, url)[2] for _ in range(rounds)]
        out[label] = {
            "status": status,
            "cold_ms": round(cold, 1),
            "median_ms": round(statistics.median(warm), 1),
        }
    con.close()
    return {"routes": out, "urls": dict(listed)}


def measure_page(host: str, name: str, url: str, rounds: int) -> dict[str, Any] | None:
    import shutil

    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if chromium is None:
        return None
    ex = url.split("/prompts/")[1].split("/")[0]
    query = url.split("?", 1)[1]
    page_url = f"http://{host}/s/{name}/prompt/{ex}?{query}"
    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        pg = browser.new_page()
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            pg.goto(page_url)
            pg.wait_for_selector("body[data-ready]", timeout=120_000)
            times.append(1000 * (time.perf_counter() - t0))
        browser.close()
    return {
        "url": page_url,
        "first_ms": round(times[0], 1),
        "median_ms": round(statistics.median(times[1:]), 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args(argv)
    server, host, names = start(a.stores)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "stores": {}}
    try:
        for path, name in zip(a.stores, names):
            from actstore.core.store import open_reader

            rows = open_reader(path).n_rows
            api = measure_api(host, name, a.rounds)
            page = measure_page(host, name, api["urls"]["contributions"], a.rounds)
            result["stores"][name] = {"path": path, "rows": rows, **api, "prompt_page": page}
            print(f"{name}: {rows} rows", file=sys.stderr)
    finally:
        server.should_exit = True
    emit(result, a.json_out)


if __name__ == "__main__":
    main()
