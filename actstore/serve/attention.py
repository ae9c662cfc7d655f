"""A head's attention pattern over a document of a corpus store ingested with ``--sources K``
(CircuitsVis-like: a query x key grid and the text coloured by the weights from one token).

What is shown is what the store keeps: for each token ``t`` of the document and the chosen
(layer, head), the ``K`` largest attention probabilities ``A_h(t, j)`` over the window's kept
positions, with their sources ``j`` (actstore.query.select.corpus_sources).  The kept mass
``sum_j A_h(t, j)`` is shown per token: ``1 - mass`` is on sources that are not kept (beyond the
top ``K``, or special tokens such as BOS that the corpus ingest does not keep).  Only the ``attn``
entries of the document's rows are read (``2K`` numbers a row and layer); no model is loaded."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.query.select.corpus_sources import corpus_sources, read_rows, require_sources
from actstore.serve.common import document_positions, jsonable

#: Tokens of a document whose pattern is shown at once (from ``start``; the grid is n x n).
PATTERN_TOKENS = 256


def attention_info(store: StoreReader) -> dict[str, Any]:
    """What a document view can ask for: the layers with sources and K, or why there is no pattern."""
    K = corpus_sources(store)
    layers = list((store.manifest.ingest.get("kept") or {}).get("z") or []) if K else []
    if K and layers:
        return {"sources": K, "layers": layers, "heads": store.geometry.n_heads, "note": None}
    return {
        "sources": 0,
        "layers": [],
        "heads": store.geometry.n_heads,
        "note": "this corpus store keeps no attention weights: ingest it with --positions all --sources K "
        "(or --sources all) for a head's attention pattern",
    }


def attention_pattern(store: StoreReader, doc: int, layer: int, head: int, start: int = 0) -> dict[str, Any]:
    """Head ``(layer, head)``'s kept attention over :data:`PATTERN_TOKENS` tokens of document ``doc``
    from its ``start``-th: per token its kept sources (indices among the tokens shown, weights) and its
    kept mass (sources before ``start`` count in the mass but are not drawn)."""
    g = store.geometry
    if not 0 <= layer < g.n_layers:
        raise QueryError(f"layer {layer} is out of range (0..{g.n_layers - 1})")
    if not 0 <= head < g.n_heads:
        raise QueryError(f"head {head} is out of range (0..{g.n_heads - 1})")
    K = require_sources(store, [layer])
    pos, more = document_positions(store, doc, "row, window_index, token", PATTERN_TOKENS, start)
    rows = np.array([int(p["row"]) for p in pos], dtype=np.int64)
    a = read_rows(store, "attn", rows, [layer], per=2 * K)[:, :, 0, head]  # [n, 2K]
    weight, offset = a[:, :K], a[:, K:].astype(np.int64)
    index = {int(r): i for i, r in enumerate(rows)}
    sources: list[list[list[float]]] = []
    for i, r in enumerate(rows):
        got = []
        for w, o in zip(weight[i].tolist(), offset[i].tolist(), strict=True):
            j = index.get(int(r) - int(o))
            if w > 0 and j is not None:
                got.append([j, float(w)])
        sources.append(sorted(got))
    mass = weight.sum(1)
    return jsonable(
        {
            "document": doc,
            "start": start,
            "page_tokens": PATTERN_TOKENS,
            "layer": layer,
            "head": head,
            "sources_kept": K,
            "tokens": [p["token"] for p in pos],
            "rows": rows.tolist(),
            "windows": [p["window_index"] for p in pos],
            "sources": sources,
            "mass": mass.astype(float).tolist(),
            "max_weight": float(weight.max()) if weight.size else 0.0,
            "more": more,
            "kept": f"the top {K} attention weights of each token over its window's kept positions "
            "(special tokens such as BOS are not kept); 1 - kept mass is on sources not kept",
        }
    )
