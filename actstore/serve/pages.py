"""The explorer's pages: a server-rendered shell per view (names from the store escaped with
:func:`html.escape`), filled by ``static/app.js`` from the JSON API (which writes store strings with
``textContent`` only).  Each page's state is in its path and query string, so a URL can be shared."""

from __future__ import annotations

from html import escape
from typing import Any

from actstore.serve.catalog import Served
from actstore.serve.common import sql

TITLES = {
    "store": "Store",
    "relation": "Relation",
    "heads": "HeadScore heatmap",
    "prompt": "Prompt",
    "head": "Head",
    "methods": "Method comparison",
    "sql": "SQL console",
    "features": "Features",
    "table": "Table",
    "unit": "Unit",
    "document": "Document",
}


def _attrs(data: dict[str, str]) -> str:
    return " ".join(f'data-{escape(k.replace("_", "-"))}="{escape(str(v))}"' for k, v in data.items())


def _shell(title: str, body: str, store: str | None, stores: list[str]) -> str:
    nav = ""
    if store is not None:
        s = escape(store)
        links = [
            (f"/s/{s}", "Store"),
            (f"/s/{s}/heads", "HeadScores"),
            (f"/s/{s}/methods", "Methods"),
            (f"/s/{s}/features", "Features"),
            (f"/s/{s}/sql", "SQL"),
        ]
        nav = " ".join(f'<a href="{h}">{t}</a>' for h, t in links)
        if len(stores) > 1:
            nav = '<a href="/">All stores</a> ' + nav
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="stylesheet" href="/static/style.css"></head>\n<body>'
        f'<header><span class="brand">actstore explorer</span>{f" · <b>{escape(store)}</b>" if store else ""}'
        f"<nav>{nav}</nav></header>\n{body}\n"
        '<script src="/static/app.js"></script></body></html>\n'
    )


def render(served: Served, view: str, params: dict[str, Any], stores: list[str]) -> str:
    """The page of ``view`` (its parameters already validated by the app)."""
    data = {"view": view, "store": served.name, **{k: str(v) for k, v in params.items() if k != "store"}}
    if served.store.manifest.ingest.get("positions") == "all":
        data["corpus"] = "1"  # a corpus store: the store page is the corpus home
    heading = f"{TITLES[view]}"
    sub = ""
    if view == "relation":
        rows = sql(
            served.store,
            "SELECT any_value(relation_name) AS n FROM examples WHERE relation_id = ?",
            [params["relation"]],
        )
        name = rows[0]["n"] if rows else None
        heading = f"Relation {params['relation']}"
        sub = f'<p class="sub" id="relation-name">{escape(str(name or ""))}</p>'
    elif view == "prompt":
        rows = sql(
            served.store, "SELECT text FROM examples WHERE example_id = ?", [int(params["example_id"])]
        )
        heading = f"Prompt {params['example_id']}"
        sub = f'<p class="sub" id="prompt-text">{escape(str(rows[0]["text"] if rows else ""))}</p>'
    elif view == "head":
        heading = f"Head {params['layer']}.{params['head']}"
    elif view == "table":
        heading = f"Table {params['table']}"
    elif view == "unit":
        what = {"mlp": "MLP neuron", "head": "Head", "direction": "Direction"}[str(params["kind"])]
        heading = f"{what} {params['layer']}.{params['index']}"
    elif view == "document":
        heading = f"Document {params['document']}"
    elif view == "store":
        heading = f"Store {served.name}"
    body = (
        f'<main id="view" {_attrs(data)}><h1 id="heading">{escape(heading)}</h1>{sub}'
        '<div id="content"><p class="loading">loading…</p></div></main>'
    )
    return _shell(f"{heading} · actstore explorer", body, served.name, stores)


def error_page(status: int, message: str) -> str:
    """A browser's error page: the one line, and a way back (the home page)."""
    body = (
        f'<main id="view" data-view="error"><h1>{status}</h1><p class="error" id="error-line">{escape(message)}</p>'
        '<p><a id="home" href="/">back to the explorer\'s home</a></p></main>'
    )
    return _shell(f"{status} · actstore explorer", body, None, [])


def index(served: list[Served]) -> str:
    items = "".join(
        f'<li><a href="/s/{escape(s.name)}">{escape(s.name)}</a> — {escape(str(s.store.manifest.model.get("name")))}, '
        f"{s.store.n_rows} rows</li>"
        for s in served
    )
    return _shell(
        "actstore explorer",
        f'<main id="view" data-view="index"><h1>Stores</h1><ul>{items}</ul></main>',
        None,
        [],
    )
