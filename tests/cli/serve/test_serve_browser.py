"""``actstore serve`` in a real browser: uvicorn on 127.0.0.1 (a free port) and Playwright driving
Debian's Chromium (``/usr/bin/chromium``, installed by ``.ci/run``; Playwright's own browsers are
never downloaded).  The walk: store page -> a relation -> the hottest head of its HeadScore heatmap
-> the head view -> a prompt, whose per-token values must equal ``Selection.features(
"attn_head_token")`` projected on the probe direction (computed here with numpy, the direction read
through the API) -> the SQL console -> the hostile prompt, shown as text.  Each view's screenshot goes
to docs/explorer/ (referenced from docs/explorer.md), so the pictures there are of the code as tested.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import REPO, missing, require_chromium
from serve_fixture import HOSTILE_TEXT, build_serve_store, tree_hash

import actstore

SHOTS = REPO / "docs" / "explorer"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    pytest.importorskip("starlette")
    import uvicorn

    from actstore.serve.app import create_app
    from actstore.serve.catalog import Catalog

    path = build_serve_store(tmp_path_factory.mktemp("serve-browser"))
    before = tree_hash(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(
            create_app(Catalog.open([str(path)])), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield path, f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert tree_hash(path) == before, "the explorer wrote to the store"


@pytest.fixture(scope="module")
def page(server: tuple[Path, str]) -> Iterator[Any]:
    chromium = require_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright", "pip install -e '.[dev]'")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        pg.errors = []  # type: ignore[attr-defined]
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))  # type: ignore[attr-defined]
        pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)  # type: ignore[attr-defined]
        yield pg
        browser.close()


def ready(pg: Any) -> None:
    pg.wait_for_selector("body[data-ready]", timeout=30_000)
    assert pg.get_attribute("body", "data-ready") == "1", pg.inner_text("#content")[:500]


def shot(pg: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_walk_from_store_to_relation_head_and_prompt(server: tuple[Path, str], page: Any) -> None:
    path, base = server
    pg = page
    pg.goto(base + "/")
    ready(pg)
    assert pg.url == base + "/s/store"
    assert pg.locator("#relations a").count() == 3
    shot(pg, "store")
    # a relation
    pg.locator("#relations a", has_text="P2").click()
    ready(pg)
    assert pg.url.endswith("/s/store/relation/P2")
    assert pg.locator("#probes tbody tr").count() == 1 and pg.locator("#prompt-table tbody tr").count() == 6
    pg.wait_for_selector("#headscore td")
    shot(pg, "relation")
    # the text search of its prompts: the one containing "bari" (any case), then back to all of them
    pg.fill("#prompt-search", "BARI")
    pg.click("form.search button")
    pg.wait_for_function("() => document.querySelector('#prompt-count').textContent.includes('contain')")
    assert pg.inner_text("#prompt-count") == '1 prompts contain "BARI"'
    assert pg.locator("#prompt-table tbody tr").count() == 1 and "Bari" in pg.inner_text("#prompt-table")
    pg.fill("#prompt-search", "")
    pg.click("form.search button")
    pg.wait_for_function("() => document.querySelector('#prompt-count').textContent === '6 prompts'")
    # the hottest head of its heatmap
    cells = pg.eval_on_selector_all(
        "#headscore td",
        "els => els.map(e => [+e.dataset.layer, +e.dataset.head, e.dataset.value === '' ? null : +e.dataset.value])",
    )
    layer, head, _ = max((c for c in cells if c[2] is not None), key=lambda c: c[2])
    stored = (
        actstore.open(path)
        .sql("SELECT layer, head FROM head_scores WHERE relation_id = 'P2' ORDER BY score DESC LIMIT 1")
        .to_pylist()[0]
    )
    assert (layer, head) == (stored["layer"], stored["head"])
    pg.locator(f'#headscore td[data-layer="{layer}"][data-head="{head}"]').click()
    ready(pg)
    assert f"/s/store/head/{layer}/{head}" in pg.url
    assert pg.inner_text("#heading") == f"Head {layer}.{head}"
    shot(pg, "head")
    # a prompt: the first of the relation among the head's top prompts
    link = pg.locator("#top-prompts tbody tr", has_text="P2").first.locator("a")
    ex = int(link.inner_text())
    link.click()
    ready(pg)
    pg.wait_for_selector("#contrib-table")
    assert f"/s/store/prompt/{ex}" in pg.url and f"layer={layer}" in pg.url and f"head={head}" in pg.url
    shown = pg.eval_on_selector_all(
        "#contrib-table span[data-value]", "els => els.map(e => +e.dataset.value)"
    )
    # the same values, independently: the stored factors' per-token contributions on the probe direction
    with urllib.request.urlopen(
        f"{base}/api/s/store/prompts/{ex}/contributions?layer={layer}&head={head}"
    ) as r:
        api = json.loads(r.read())
    assert api["mode"] == "probe"
    x = (
        actstore.open(path)
        .select("example_id = ?", params=[ex])
        .features("attn_head_token", layers=[layer], heads=[head])
    )
    want = x[0, 0, 0, : api["n_src"]].astype(np.float64) @ np.asarray(api["direction"], dtype=np.float64)
    assert len(shown) == api["n_src"] == pg.locator("#contrib-tokens .tok").count()
    np.testing.assert_allclose(shown, want, rtol=1e-4, atol=1e-6)
    shot(pg, "prompt")
    # every coloured token keeps its text readable: WCAG contrast >= 4.5 against the page's white
    styles = pg.eval_on_selector_all(
        "#attention-tokens .tok, #contrib-tokens .tok",
        "els => els.map(e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).color])",
    )
    assert styles and all(_contrast(bg, fg) >= 4.5 for bg, fg in styles), styles
    # another head from the prompt's own HeadScore grid: the values follow
    other = 1 - layer
    pg.locator(f'#prompt-headscore td[data-layer="{other}"][data-head="0"]').click()
    pg.wait_for_function(f"() => location.search.includes('layer={other}')")
    pg.wait_for_selector("#contrib-table")
    assert "Head " + f"{other}.0" in pg.inner_text("#contrib-caption")
    assert not pg.errors, pg.errors  # type: ignore[attr-defined]


def test_views_heatmap_methods_features_table(server: tuple[Path, str], page: Any) -> None:
    path, base = server
    pg = page
    for url, name, sel in (
        ("/s/store/heads", "headscore", "#headscore td.hottest"),
        ("/s/store/methods", "methods", "#agreement tbody tr"),
        ("/s/store/features?kind=attn_head&layer=1&n=18", "features", "svg.scatter circle"),
        ("/s/store/table/probe_runs", "table", "#table-rows tbody tr"),
    ):
        pg.goto(base + url)
        ready(pg)
        assert pg.locator(sel).count() >= 1, url
        shot(pg, name)
    # a table row is one line: the probe run's long config cut with an ellipsis, whole in its title and text
    pg.goto(base + "/s/store/table/probe_runs")
    ready(pg)
    config = str(actstore.open(path).sql("SELECT config FROM probe_runs").column(0)[0].as_py())
    assert len(config) > 200
    cells = pg.eval_on_selector_all(
        "#table-rows tbody td.long",
        "els => els.map(e => [e.title, e.textContent, e.scrollWidth > e.clientWidth])",
    )
    assert [config, config, True] in cells, cells
    heights = pg.eval_on_selector_all(
        "#table-rows tr", "els => els.map(e => e.getBoundingClientRect().height)"
    )
    assert len(heights) == 2 and max(heights) < 2 * min(heights) + 4, heights  # the row as tall as the header
    pg.goto(base + "/s/store/features?kind=attn_head&layer=1&n=18")
    ready(pg)
    assert pg.locator("svg.scatter circle").count() == 18
    assert HOSTILE_TEXT in pg.eval_on_selector_all(
        "svg.scatter title", "els => els.map(e => e.textContent).join('|')"
    )
    assert not pg.errors, pg.errors  # type: ignore[attr-defined]


def test_sql_console(server: tuple[Path, str], page: Any) -> None:
    _, base = server
    pg = page
    pg.goto(base + "/s/store/sql")
    ready(pg)
    pg.fill("#sql-input", "SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY 1")
    pg.click("#sql-run")
    pg.wait_for_selector("#sql-table")
    rows = pg.eval_on_selector_all(
        "#sql-table tbody tr", "els => els.map(e => [...e.cells].map(c => c.textContent))"
    )
    assert rows == [["P1", "6"], ["P2", "6"], ["P3", "6"]]
    assert "q=SELECT" in pg.url  # the statement is in the URL: the view can be shared
    assert pg.get_attribute("#dl-csv", "href").startswith("/api/s/store/sql?format=csv&q=")
    shot(pg, "sql")
    pg.fill("#sql-input", "DROP TABLE examples")
    pg.click("#sql-run")
    pg.wait_for_selector("#sql-result .error")
    assert "read-only" in pg.inner_text("#sql-result .error")


def test_a_hostile_prompt_is_shown_as_text(server: tuple[Path, str], page: Any) -> None:
    _, base = server
    pg = page
    pg.goto(base + "/s/store/prompt/0")
    ready(pg)
    pg.wait_for_selector("#contrib-table")
    assert pg.title() == "Prompt 0 · actstore explorer"  # the prompt's script did not run
    assert pg.inner_text("#prompt-text") == HOSTILE_TEXT
    assert HOSTILE_TEXT in pg.inner_text("#prompt-tokens").replace("<s>", "")
    assert pg.eval_on_selector_all("script", "els => els.length") == 1
    pg.goto(base + "/s/store/relation/P1")
    ready(pg)
    assert pg.locator("#prompt-table td", has_text=HOSTILE_TEXT).count() == 1
    assert pg.title() == "Relation P1 · actstore explorer"


def _contrast(background: str, text: str) -> float:
    """WCAG contrast ratio of CSS colour ``text`` on ``background`` (an rgba() over white)."""

    def rgba(css: str) -> tuple[float, ...]:
        v = [float(x) for x in re.findall(r"[\d.]+", css)]
        return tuple(v + [1.0] * (4 - len(v)))

    def luminance(rgb: tuple[float, ...]) -> float:
        lin = [c / 255 / 12.92 if c / 255 <= 0.04045 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    r, g, b, a = rgba(background)
    over_white = tuple(a * c + (1 - a) * 255 for c in (r, g, b))
    hi, lo = sorted((luminance(over_white), luminance(rgba(text)[:3])), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_report_links_to_the_running_explorer(server: tuple[Path, str], tmp_path: Path) -> None:
    """``actstore report --explorer URL`` links to the explorer's views of the store it serves, and each
    link answers; an address where no explorer serves it gives a report without them."""
    from click.testing import CliRunner

    from actstore.cli import main

    path, base = server
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["report", str(path), "--out", str(out), "--quiet", "--explorer", base])
    assert r.exit_code == 0, r.output
    hrefs = re.findall(r'<a href="(http[^"]+)"', out.read_text())
    want = [f"{base}/s/store{p}" for p in ("", "/heads", "/methods", "/sql", "/features")]
    assert hrefs == want + [f"{base}/s/store/relation/{rel}" for rel in ("P1", "P2", "P3")]
    for href in hrefs:
        with urllib.request.urlopen(href) as page:
            assert page.status == 200
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = CliRunner().invoke(main, ["report", str(path), "--out", str(out), "--explorer", closed])
    assert r.exit_code == 0 and f"no explorer at {closed}" in r.output
    assert closed not in out.read_text() and 'id="section-explorer"' not in out.read_text()


@pytest.fixture(scope="module")
def corpus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A corpus store (tests/serve_fixture.py: build_corpus_serve_store) served with its probe.npy."""
    pytest.importorskip("starlette")
    import uvicorn
    from serve_fixture import build_corpus_serve_store

    from actstore.serve.app import create_app
    from actstore.serve.catalog import Catalog
    from actstore.serve.corpus import load_direction_files

    path = build_corpus_serve_store(tmp_path_factory.mktemp("serve-corpus-browser"))
    before = tree_hash(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a .npy of directions, and a token's unembedding through the final norm given as a dfa spec
    dirs = load_direction_files([str(path.parent / "probe.npy"), "tok7=token:7"], actstore.open(path))
    app = create_app(Catalog.open([str(path)]), directions=dirs)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield path, f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert tree_hash(path) == before, "the explorer wrote to the store"


def _links_resolve(pg: Any, base: str) -> int:
    """Every link of the page answers 200 (fetched without a browser); returns how many were checked."""
    hrefs = set(pg.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))"))
    for href in hrefs:
        url = href if href.startswith("http") else base + href
        with urllib.request.urlopen(url) as r:
            assert r.status == 200, href
    return len(hrefs)


def test_corpus_home_units_and_documents(corpus_server: tuple[Path, str], page: Any) -> None:
    _, base = corpus_server
    pg = page
    pg.errors.clear()  # type: ignore[attr-defined]  (the page is shared: the SQL test's refusal is a 400)
    pg.goto(base + "/")
    ready(pg)
    assert pg.url == base + "/s/corpus"
    assert pg.locator("#relations").count() == 0  # no empty relation table
    assert pg.locator("#topk-runs tbody tr").count() == 1 and pg.locator("#documents tbody tr").count() == 12
    pg.fill("#token-search input", "ow")
    pg.click("#token-search button")
    pg.wait_for_selector("#token-hits tbody tr")
    shot(pg, "corpus-home")
    assert _links_resolve(pg, base) > 20
    # a neuron with a precomputed top-k: contexts coloured, a histogram, logit effects
    # (its time, 300 ms at most, is measured by benchmarks/bench_serve.py --corpus-tokens, never asserted here)
    pg.goto(base + "/s/corpus/unit/mlp/1/7")
    ready(pg)
    assert "precomputed" in pg.inner_text("#unit-label")
    assert pg.locator("#top-contexts tbody tr").count() == 20
    assert pg.locator("#top-contexts .tok.at").count() == 20 and pg.locator("#histogram rect").count() >= 1
    assert pg.locator("#promoted tbody tr").count() == 12 and pg.locator(".colourbar").count() >= 1
    shot(pg, "unit-mlp")
    _links_resolve(pg, base)
    # its first context's document, coloured by the neuron, the top token outlined
    pg.locator("#top-contexts tbody tr a").first.click()
    ready(pg)
    assert "/document/" in pg.url and pg.locator("#doc-tokens .tok.at").count() == 1
    values = pg.eval_on_selector_all("#doc-tokens .tok", "els => els.map(e => e.dataset.value)")
    assert values and all(v != "" for v in values)
    # the head's attention pattern (the stored top-4 sources): a grid cell per kept source, a mass bar
    # per token, a legend; the text coloured by the weights from the outlined token
    n_tok = pg.locator("#att-tokens .tok").count()
    assert (
        n_tok == pg.locator("#doc-tokens .tok").count() and pg.locator("#att-grid rect.mass").count() == n_tok
    )
    cells = pg.eval_on_selector_all("#att-grid rect.att", "els => els.map(e => [+e.dataset.t, +e.dataset.j])")
    assert len(cells) >= n_tok and all(j <= t for t, j in cells)
    assert pg.locator("#att-legend .colourbar").count() == 2 and "kept mass" in pg.inner_text("#att-kept")
    assert pg.locator("#att-tokens .tok.at").count() == 1
    _links_resolve(pg, base)
    # whitespace tokens are visible: document 1 holds a tab and a double space
    pg.goto(base + "/s/corpus/document/1?kind=head&layer=0&index=1")
    ready(pg)
    text = pg.inner_text("#doc-tokens")
    assert "⇥" in text or "␣" in text
    shot(pg, "document")
    # another head, chosen with the form; a click on a token shows the weights from it
    pg.select_option("#att-form select[name=att_layer]", "1")
    pg.select_option("#att-form select[name=att_head]", "2")
    pg.click("#att-form button")
    ready(pg)
    assert "att_layer=1" in pg.url and "head 1.2" in pg.inner_text("#content")
    n_att = pg.locator("#att-grid rect.mass").count()
    pg.locator("#att-tokens .tok").nth(6).click()
    assert "from token 6" in pg.inner_text("#att-from")
    weights = pg.eval_on_selector_all("#att-tokens .tok", "els => els.map(e => e.dataset.weight)")
    assert any(w not in ("", None) for w in weights[:7]) and all(w in ("", None) for w in weights[7:])
    shot(pg, "attention-pattern")
    _links_resolve(pg, base)
    # from a later token (att_start): fewer rows, "tokens 3.." said, a pager back to the first tokens
    pg.goto(pg.url + "&att_start=3")
    ready(pg)
    assert pg.locator("#att-grid rect.mass").count() == n_att - 3 and "tokens 3.." in pg.inner_text(
        "#att-pages"
    )
    shot(pg, "attention-pattern-later")
    pg.locator("#att-pages button").first.click()
    ready(pg)
    assert "att_start=0" in pg.url and pg.locator("#att-grid rect.mass").count() == n_att
    # a head (streamed top-k, no logit effects) and a direction of the served file
    pg.goto(base + "/s/corpus/head/1/2")  # the head page of a corpus store is its unit page
    ready(pg)
    assert pg.url.endswith("/s/corpus/unit/head/1/2") and "computed on demand" in pg.inner_text("#unit-label")
    shot(pg, "unit-head")
    _links_resolve(pg, base)
    pg.goto(base + "/s/corpus/unit/direction/2/0?direction=probe")
    ready(pg)
    assert (
        pg.locator("#top-contexts tbody tr").count() == 20 and pg.locator("#promoted tbody tr").count() == 12
    )
    shot(pg, "unit-direction")
    _links_resolve(pg, base)
    pg.goto(base + "/s/corpus/unit/head/1/2?direction=probe")  # the head read along a direction
    ready(pg)
    assert "head 1.2 along probe" in pg.inner_text("#unit-label")
    assert (
        pg.locator("#top-contexts tbody tr").count() == 20 and pg.locator("#promoted tbody tr").count() == 12
    )
    shot(pg, "unit-head-direction")
    _links_resolve(pg, base)
    pg.goto(base + "/s/corpus/unit/direction/2/0?direction=tok7")  # a spec served as a direction
    ready(pg)
    assert "tok7" in pg.inner_text("#unit-label") and pg.locator("#top-contexts tbody tr").count() == 20
    _links_resolve(pg, base)
    assert not pg.errors, pg.errors  # type: ignore[attr-defined]
    # a bad unit, layer or direction: a 4xx page of one line with a way home
    for url in (
        "/s/corpus/unit/mlp/1/999",
        "/s/corpus/unit/mlp/7/0",
        "/s/corpus/unit/direction/2/0?direction=x",
    ):
        r = pg.goto(base + url)
        assert r is not None and 400 <= r.status < 500, url
        assert pg.locator("#error-line").count() == 1 and "\n" not in pg.inner_text("#error-line")
    shot(pg, "not-found")
    # the features palette: 20 colours, then marker shapes; 16 relations (or up to 80) never share one
    distinct = pg.evaluate(
        "n => new Set(Array.from({length: n}, (_, i) => { const m = marker(i, 0, 0, 4); "
        "return m.tagName + m.getAttribute('fill') + (m.getAttribute('points') || '').split(' ').length; })).size",
        80,
    )
    assert distinct == 80
    pg.click("#home")
    ready(pg)
    assert pg.url == base + "/s/corpus"
    r = pg.goto(base + "/api/s/corpus/documents/1/attention?layer=1&head=9")  # a bad head: one line
    assert r is not None and r.status == 400 and "head 9" in pg.inner_text("body")
