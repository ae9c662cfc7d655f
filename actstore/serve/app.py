"""The explorer's ASGI app (Starlette): the JSON API under ``/api/`` and the pages that use it.

Read-only: every route reads the store through :class:`actstore.core.store.StoreReader` and the
SQL sandbox, nothing writes.  Every parameter is validated (:mod:`actstore.serve.common`); a bad one
is a 4xx with one line (``{"error": ...}`` under ``/api/``, plain text for pages), never a traceback.
The routes are listed in :data:`API_ROUTES` and documented in docs/explorer.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from actstore.core._version import __version__
from actstore.core.errors import ActstoreError, NotFoundError, QueryError
from actstore.serve import console, corpus, corpus_api, pages, prompt, search, views
from actstore.serve.catalog import Catalog, Served
from actstore.serve.common import (
    example_id,
    example_ids,
    int_param,
    layer_head,
    relation_id,
    relations_index,
    run_param,
    signature,
    store_chunks,
    store_rows,
    table_name,
)

log = logging.getLogger("actstore.serve")
STATIC = Path(__file__).resolve().parent / "static"
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
}


def _one_line(text: object, limit: int = 500) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _error(request: Request, status: int, message: str) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse(
            {"error": _one_line(message), "status": status}, status_code=status, headers=SECURITY_HEADERS
        )
    if "text/html" in request.headers.get("accept", ""):  # a browser: one line and a way back
        return Response(
            pages.error_page(status, _one_line(message)),
            status_code=status,
            media_type="text/html; charset=utf-8",
            headers=SECURITY_HEADERS,
        )
    return PlainTextResponse(_one_line(message) + "\n", status_code=status, headers=SECURITY_HEADERS)


def _status(e: BaseException) -> int:
    if isinstance(e, NotFoundError):
        return 404
    if isinstance(e, QueryError | ValueError | KeyError):
        return 400
    return 500


async def _on_actstore_error(request: Request, exc: Exception) -> Response:
    status = _status(exc)
    if status == 500:
        log.warning("serve: %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return _error(request, status, str(exc) if status < 500 else f"{type(exc).__name__}: {exc}")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(request, exc.status_code, str(exc.detail))


async def _on_any_error(request: Request, exc: Exception) -> Response:
    log.warning(
        "serve: %s %s: internal error %s: %s", request.method, request.url.path, type(exc).__name__, exc
    )
    return _error(request, 500, f"internal error: {type(exc).__name__}")


# ----------------------------------------------------------------------------------- helpers
def _served(request: Request) -> Served:
    catalog: Catalog = request.app.state.catalog
    return catalog.get(str(request.path_params.get("store", "")))


def _q(request: Request, name: str) -> str | None:
    v = request.query_params.get(name)
    if v is not None and len(v) > 25_000:
        raise QueryError(f"parameter {name} is too long")
    return v


def _page(request: Request, default_size: int = 50) -> tuple[int, int]:
    return (
        int_param(_q(request, "page"), "page", low=0, high=10**7, default=0),
        int_param(_q(request, "size"), "size", low=1, high=500, default=default_size),
    )


def _json(data: Any) -> Response:
    return JSONResponse(data, headers={**SECURITY_HEADERS, "Cache-Control": "no-store"})


def api(fn: Callable[[Request, Served], Any]) -> Callable[[Request], Response]:
    """A sync endpoint (Starlette runs it in a worker thread) on one store; requests run in parallel."""

    def endpoint(request: Request) -> Response:
        out = fn(request, _served(request))
        return out if isinstance(out, Response) else _json(out)

    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint


# ----------------------------------------------------------------------------------- API routes
def api_stores(request: Request) -> Response:
    """The served stores: name, model, rows."""
    catalog: Catalog = request.app.state.catalog
    return _json(
        [
            {
                "name": s.name,
                "url": s.store.url,
                "model": s.store.manifest.model.get("name"),
                "rows": s.store.n_rows,
            }
            for s in catalog
        ]
    )


@api
def api_summary(request: Request, s: Served) -> Any:
    """Model, geometry, rows per relation, runs, tables and sizes."""
    return s.cached(("summary", signature(s.store)), lambda: views.store_summary(s.store))


@api
def api_relation(request: Request, s: Served) -> Any:
    """Probe accuracy and F1 with intervals per run, confusions, predictors."""
    rel = relation_id(s.store, str(request.path_params["relation"]))
    run = run_param(_q(request, "run"))
    key = ("relation", rel, run, signature(s.store))
    return s.cached(key, lambda: views.relation_view(s.store, rel, run))


@api
def api_prompts(request: Request, s: Served) -> Any:
    """Prompts, paged, searchable by text (``q``, from example id ``after``), of a relation or of all."""
    rel_text = _q(request, "relation")
    rel = relation_id(s.store, rel_text) if rel_text else None
    page, size = _page(request)
    at = _q(request, "after")
    after = int_param(at, "after", low=-(2**63), high=2**63 - 1) if at else None
    return search.prompts_page(s.store, rel, _q(request, "q"), page, size, after)


@api
def api_headscores(request: Request, s: Served) -> Any:
    """The stored mean HeadScore grid (layer x head) of a run, for a relation or all."""
    rel_text = _q(request, "relation")
    rel = relation_id(s.store, rel_text) if rel_text else None
    run = run_param(_q(request, "run"))
    key = ("headscores", rel, run, signature(s.store, "head_scores", "probe_runs", "runs"))
    return s.cached(key, lambda: views.headscore_grid(s.store, rel, run))


@api
def api_prompt(request: Request, s: Served) -> Any:
    """One prompt: tokens, stored TokenScores and predictions, tracing and patching."""
    ex = int_param(str(request.path_params["example_id"]), "example_id", low=-(2**63), high=2**63 - 1)
    return s.cached(("prompt", ex, signature(s.store)), lambda: prompt.prompt_view(s.store, ex))


@api
def api_contributions(request: Request, s: Served) -> Any:
    """Per-source-token contributions of one head along the probe direction, with attention."""
    ex = example_id(s.store, str(request.path_params["example_id"]))
    lt, ht = _q(request, "layer"), _q(request, "head")
    layer, head = (None, None)
    if lt or ht:
        layer, head = layer_head(s.store, lt, ht)
    return prompt.contributions(s, ex, run_param(_q(request, "run")), layer, head)


@api
def api_head(request: Request, s: Served) -> Any:
    """One head: MAPS scores, salient tokens, HeadScore per relation, top prompts, mean norm per relation."""
    layer, head = layer_head(s.store, str(request.path_params["layer"]), str(request.path_params["head"]))
    key = ("head", layer, head, signature(s.store))
    return s.cached(key, lambda: views.head_view(s.store, layer, head))


@api
def api_methods(request: Request, s: Served) -> Any:
    """Method agreement with intervals and one page of per-fact key layers."""
    page, size = _page(request)
    run = run_param(_q(request, "run"))
    key = ("methods", run, page, size, signature(s.store, "method_agreement", "method_readings", "runs"))
    return s.cached(key, lambda: views.methods_view(s.store, run, page, size))


@api
def api_table(request: Request, s: Served) -> Any:
    """One page of a table."""
    page, size = _page(request)
    return views.table_preview(s.store, table_name(s.store, str(request.path_params["table"])), page, size)


@api
def api_sql(request: Request, s: Served) -> Any:
    """One page of a read-only SELECT (``q``), or all of it as ``format=csv|parquet``."""
    query = _q(request, "q") or ""
    fmt = _q(request, "format") or "json"
    limits: console.ConsoleLimits = request.app.state.limits
    if fmt == "json":
        page, size = _page(request, 100)
        return console.run_page(s.store, query, page, size, limits, s.cached)
    body, media = console.run_download(s.store, query, fmt, limits)
    name = "result.csv" if fmt == "csv" else "result.parquet"
    return Response(
        body,
        media_type=media,
        headers={**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="{name}"'},
    )


@api
def api_features(request: Request, s: Served) -> Any:
    """PCA (2-D) of a kind at a layer for a sample of rows, with each point's relation and prompt."""
    kind = _q(request, "kind") or "attn_head"
    g = s.store.geometry
    layer = int_param(_q(request, "layer"), "layer", low=0, high=g.n_layers, default=g.n_layers - 1)
    ht = _q(request, "head")
    head = int_param(ht, "head", low=0, high=g.n_heads - 1) if ht else None
    rels_text = _q(request, "relations")
    rels = [relation_id(s.store, r.strip()) for r in rels_text.split(",") if r.strip()] if rels_text else None
    n = int_param(_q(request, "n"), "n", low=3, high=5000, default=500)
    seed = int_param(_q(request, "seed"), "seed", low=0, high=2**31, default=0)
    key = ("features", kind, layer, head, tuple(rels or ()), n, seed)
    return s.cached(key, lambda: console.features_projection(s.store, kind, layer, head, rels, n, seed))


# ----------------------------------------------------------------------------------- corpus routes
api_corpus = api(corpus_api.api_corpus)
api_tokens = api(corpus_api.api_tokens)
api_unit = api(corpus_api.api_unit)
api_document = api(corpus_api.api_document)
api_attention = api(corpus_api.api_attention)


#: (path, endpoint) of every API route; docs/explorer.md lists them, the tests call each.
API_ROUTES: list[tuple[str, Callable[[Request], Response]]] = [
    ("/api/stores", api_stores),
    ("/api/s/{store}/summary", api_summary),
    ("/api/s/{store}/relations/{relation}", api_relation),
    ("/api/s/{store}/prompts", api_prompts),
    ("/api/s/{store}/headscores", api_headscores),
    ("/api/s/{store}/prompts/{example_id}", api_prompt),
    ("/api/s/{store}/prompts/{example_id}/contributions", api_contributions),
    ("/api/s/{store}/heads/{layer}/{head}", api_head),
    ("/api/s/{store}/methods", api_methods),
    ("/api/s/{store}/tables/{table}", api_table),
    ("/api/s/{store}/sql", api_sql),
    ("/api/s/{store}/features", api_features),
    ("/api/s/{store}/corpus", api_corpus),
    ("/api/s/{store}/tokens", api_tokens),
    ("/api/s/{store}/units/{kind}/{layer}/{index}", api_unit),
    ("/api/s/{store}/documents/{document}", api_document),
    ("/api/s/{store}/documents/{document}/attention", api_attention),
]

#: The query parameters of each route (docs/explorer.md says what each means).
QUERY_PARAMETERS: dict[str, tuple[str, ...]] = {
    "/api/s/{store}/relations/{relation}": ("run",),
    "/api/s/{store}/prompts": ("relation", "q", "page", "size", "after"),
    "/api/s/{store}/headscores": ("relation", "run"),
    "/api/s/{store}/prompts/{example_id}/contributions": ("run", "layer", "head"),
    "/api/s/{store}/methods": ("run", "page", "size"),
    "/api/s/{store}/tables/{table}": ("page", "size"),
    "/api/s/{store}/sql": ("q", "page", "size", "format"),
    "/api/s/{store}/features": ("kind", "layer", "head", "relations", "n", "seed"),
    "/api/s/{store}/tokens": ("q", "size"),
    "/api/s/{store}/units/{kind}/{layer}/{index}": ("direction", "k"),
    "/api/s/{store}/documents/{document}": ("kind", "layer", "index", "direction"),
    "/api/s/{store}/documents/{document}/attention": ("layer", "head", "start"),
}


def api_openapi(request: Request) -> Response:
    """An OpenAPI 3 description of the routes (made from :data:`API_ROUTES`; the answers' fields are
    in docs/explorer.md)."""

    error = {"description": "one line: {error, status}"}
    paths: dict[str, Any] = {}
    for path, endpoint in API_ROUTES + [("/api/openapi.json", api_openapi)]:
        params = [
            {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
            for n in re.findall(r"{(\w+)}", path)
        ]
        params += [
            {"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
            for n in QUERY_PARAMETERS.get(path, ())
        ]
        paths[path] = {
            "get": {
                "summary": (endpoint.__doc__ or "").strip().split("\n")[0],
                "parameters": params,
                "responses": {
                    "200": {"description": "JSON (CSV or Parquet for sql?format=)"},
                    "400": error,
                    "404": error,
                },
            }
        }
    return _json(
        {"openapi": "3.0.3", "info": {"title": "actstore explorer", "version": __version__}, "paths": paths}
    )


# ----------------------------------------------------------------------------------- pages
def _page_route(view: str) -> Callable[[Request], Response]:
    def endpoint(request: Request) -> Response:
        served = _served(request)
        params = dict(request.path_params)
        if corpus.is_corpus(served.store) and view in ("head", "prompt", "heads", "relation"):
            return corpus_api.redirect(request, served, view, params)
        if view in ("unit", "document"):
            corpus_api.page_params(request, served, view, params)
        if view == "prompt":
            params["example_id"] = str(example_id(served.store, str(params["example_id"])))
        elif view == "relation":
            params["relation"] = relation_id(served.store, str(params["relation"]))
        elif view == "table":
            params["table"] = table_name(served.store, str(params["table"]))
        elif view == "head":
            layer, head = layer_head(served.store, str(params["layer"]), str(params["head"]))
            params.update(layer=str(layer), head=str(head))
        text = pages.render(served, view, params, request.app.state.catalog.names)
        return Response(text, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    endpoint.__name__ = f"page_{view}"
    return endpoint


def index(request: Request) -> Response:
    catalog: Catalog = request.app.state.catalog
    if len(catalog.names) == 1:
        return RedirectResponse(f"/s/{catalog.names[0]}", status_code=302)
    return Response(
        pages.index(list(catalog)), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS
    )


def _no_icon(request: Request) -> Response:
    return Response(status_code=204)


PAGE_ROUTES = [
    ("/s/{store}", "store"),
    ("/s/{store}/relation/{relation}", "relation"),
    ("/s/{store}/heads", "heads"),
    ("/s/{store}/prompt/{example_id}", "prompt"),
    ("/s/{store}/head/{layer}/{head}", "head"),
    ("/s/{store}/methods", "methods"),
    ("/s/{store}/sql", "sql"),
    ("/s/{store}/features", "features"),
    ("/s/{store}/table/{table}", "table"),
    ("/s/{store}/unit/{kind}/{layer}/{index}", "unit"),
    ("/s/{store}/document/{document}", "document"),
]


def warm(catalog: Catalog) -> None:
    """Read what every view needs first (the table files' hashes and footers, the relations, the
    example ids, the summary), store by store, so that the first request does not pay for it."""

    for s in catalog:
        try:
            # (requests that come meanwhile run beside it, and may read what it has not read yet)
            s.cached(("summary", signature(s.store)), functools.partial(views.store_summary, s.store))
            import actstore.query.analyses.explain  # noqa: F401  (torch, the probe)
            from actstore.query.analyses.stats import proportion_interval

            proportion_interval(1, 2)  # scipy.stats loads on first use: 0.6-4.6 s of a first relation view

            relations_index(s.store)
            example_ids(s.store)
            store_rows(s.store)  # every target row, which each sample and prompt is cut from
            store_chunks(s.store)  # the rows of each chunk, which samples draw whole chunks of
            search.relation_ids(s.store)  # each relation's example ids, which its pages are cut from
            views.head_sample(s.store)  # the rows head views rank, with their texts
            prompt.episodes_index(s.store)  # the probe episodes by query prompt
        except Exception as e:  # a damaged table: the views that read it will say so
            log.warning("serve: warming %s: %s: %s", s.name, type(e).__name__, e)


def create_app(
    catalog: Catalog,
    limits: console.ConsoleLimits | None = None,
    *,
    warm_up: bool = True,
    directions: dict[str, Any] | None = None,
) -> Starlette:
    """The explorer over ``catalog``'s stores (read-only).  ``warm_up``: read what the views need
    first in a background thread as the app starts (:func:`warm`)."""
    routes: list[Any] = [Route(p, e, methods=["GET"]) for p, e in API_ROUTES]
    routes.append(Route("/api/openapi.json", api_openapi, methods=["GET"]))
    routes += [Route(p, _page_route(v), methods=["GET"]) for p, v in PAGE_ROUTES]
    routes += [
        Route("/", index, methods=["GET"]),
        Route("/favicon.ico", _no_icon, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if warm_up:
            threading.Thread(target=warm, args=(catalog,), daemon=True, name="actstore-serve-warm").start()
        yield

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: _on_http_error,
            ActstoreError: _on_actstore_error,
            ValueError: _on_actstore_error,
            KeyError: _on_actstore_error,
            Exception: _on_any_error,
        },
    )
    app.state.catalog = catalog
    app.state.limits = limits or console.ConsoleLimits()
    app.state.directions = directions or {}  # name -> [m, d_model] (serve --direction FILE.npy)
    return app
