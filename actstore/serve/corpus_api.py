"""The explorer's corpus routes (:mod:`actstore.serve.corpus` computes their answers): the JSON
endpoints, which :mod:`actstore.serve.app` wraps with its ``api`` (one store, JSON, one-line errors),
and the checks and redirects of the corpus pages.  Read-only, like every route."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from actstore.core.errors import NotFoundError, QueryError
from actstore.serve import attention, corpus
from actstore.serve.catalog import Served
from actstore.serve.common import int_param, layer_head, signature, sql


def _q(request: Request, name: str) -> str | None:
    v = request.query_params.get(name)
    if v is not None and len(v) > 25_000:
        raise QueryError(f"parameter {name} is too long")
    return v


def _directions(request: Request) -> dict[str, Any]:
    return request.app.state.directions  # type: ignore[no-any-return]


def _corpus(s: Served) -> None:
    if not corpus.is_corpus(s.store):
        raise NotFoundError(f"store {s.name} is no corpus store (ingested with --positions target)")


def _unit(
    request: Request, s: Served, kind: str, lt: str | None, it: str | None
) -> tuple[str, int, int, str | None]:
    if kind not in corpus.UNIT_KINDS:
        raise NotFoundError(f"unit kind must be one of {', '.join(corpus.UNIT_KINDS)}, not {kind[:20]!r}")
    g = s.store.geometry
    high = g.n_layers if kind == "direction" else g.n_layers - 1
    layer = int_param(lt, "layer", low=0, high=high)
    index = int_param(it, "index", low=0, high=2**31)
    name = _q(request, "direction")
    return kind, layer, index, name


def api_corpus(request: Request, s: Served) -> Any:
    """A corpus store's home: documents, tokens, kinds and layers kept, precomputed top-k runs."""
    _corpus(s)
    return s.cached(("corpus", signature(s.store)), lambda: corpus.corpus_home(s.store, _directions(request)))


def api_tokens(request: Request, s: Served) -> Any:
    """Positions whose token text holds ``q`` (case-insensitive), with their contexts."""
    _corpus(s)
    q = _q(request, "q") or ""
    if len(q) > 200:
        raise QueryError("q is at most 200 characters")
    size = int_param(_q(request, "size"), "size", low=1, high=500, default=50)
    return corpus.token_search(s.store, q, size)


def api_unit(request: Request, s: Served) -> Any:
    """A unit (mlp neuron, head output norm, direction): top-k contexts, histogram, logit effects."""
    _corpus(s)
    kind, layer, index, name = _unit(
        request,
        s,
        str(request.path_params["kind"]),
        str(request.path_params["layer"]),
        str(request.path_params["index"]),
    )
    k = int_param(_q(request, "k"), "k", low=1, high=200, default=20)
    key = ("unit", kind, layer, index, name, k, signature(s.store))
    return s.cached(key, lambda: corpus.unit_view(s.store, kind, layer, index, _directions(request), name, k))


def api_document(request: Request, s: Served) -> Any:
    """A document's tokens, with a unit's value on each (``kind``, ``layer``, ``index``, ``direction``)."""
    _corpus(s)
    doc = int_param(str(request.path_params["document"]), "document", low=0, high=2**62)
    kt = _q(request, "kind")
    unit = _unit(request, s, kt, _q(request, "layer"), _q(request, "index")) if kt else None
    key = ("document", doc, unit, signature(s.store))
    return s.cached(key, lambda: corpus.document_view(s.store, doc, unit, _directions(request)))


def api_attention(request: Request, s: Served) -> Any:
    """A head's kept attention over a document (``layer``, ``head``): per token its kept sources and mass."""
    _corpus(s)
    doc = int_param(str(request.path_params["document"]), "document", low=0, high=2**62)
    g = s.store.geometry
    layer = int_param(_q(request, "layer"), "layer", low=0, high=g.n_layers - 1)
    head = int_param(_q(request, "head"), "head", low=0, high=g.n_heads - 1)
    start = int_param(_q(request, "start") or "0", "start", low=0, high=2**62)
    key = ("attention", doc, layer, head, start, signature(s.store))
    return s.cached(key, lambda: attention.attention_pattern(s.store, doc, layer, head, start))


def redirect(request: Request, served: Served, view: str, params: dict[str, Any]) -> Response:
    """On a corpus store (a row is one token): a head's page is its unit page, a prompt (a position)
    is its document, the relation views have no relations to show (the corpus home)."""
    root = f"/s/{served.name}"
    if view == "head":
        layer, head = layer_head(served.store, str(params["layer"]), str(params["head"]))
        return RedirectResponse(f"{root}/unit/head/{layer}/{head}", status_code=302)
    if view == "prompt":
        row = int_param(str(params["example_id"]), "example_id", low=0, high=2**62)
        got = sql(served.store, "SELECT document FROM positions WHERE example_id = ?", [row])
        if not got:
            raise NotFoundError(f"no position {row} in the store")
        return RedirectResponse(f"{root}/document/{got[0]['document']}?row={row}", status_code=302)
    return RedirectResponse(root, status_code=302)


def page_params(request: Request, served: Served, view: str, params: dict[str, Any]) -> None:
    """Check a unit or document page's path (a 4xx of one line) and write its values back."""
    _corpus(served)
    if view == "unit":
        kind, layer, index, name = _unit(
            request, served, str(params["kind"]), str(params["layer"]), str(params["index"])
        )
        corpus.check_unit(served.store, kind, layer, index, request.app.state.directions, name)
        params.update(layer=str(layer), index=str(index))
    else:
        doc = int_param(str(params["document"]), "document", low=0, high=2**62)
        corpus.check_document(served.store, doc)
        params["document"] = str(doc)
