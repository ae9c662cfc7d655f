"""The explorer's corpus views (a store ingested with ``--positions all``: one row per token of a
document): the corpus home, a search over token text, unit pages (an MLP neuron, a head's output
norm, a residual direction) and the document view.  Read-only, like every view; no model is loaded.

A unit page's top-k contexts are read from a precomputed ``topk_contexts`` table (``actstore topk``)
where one covers the unit (a few row groups, flat in the store's size), else computed on demand in
one streaming pass over the store (blocks of rows; memory holds ``k`` values and one block).  Its
histogram is over a block sample of at most :data:`HIST_SAMPLE` positions (the same sample for every
unit, kept), so it too is flat in the store's size."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from actstore.core.errors import NotFoundError, QueryError
from actstore.core.store import StoreReader
from actstore.query.analyses.topk import position_contexts
from actstore.query.select.features import FeatureSpec, check_corpus_kind, compute_block
from actstore.serve.attention import attention_info
from actstore.serve.catalog import Kept
from actstore.serve.common import (
    block_sample,
    document_positions,
    has_table,
    jsonable,
    kept,
    runs_of,
    signature,
    sql,
)
from actstore.serve.logit_effects import logit_effects, write_vector

#: The unit kinds of a unit page: an MLP neuron, a head (its output norm, or its output read along a
#: direction: ``?direction=NAME`` its first row, ``?direction=NAME[ROW]`` another), a direction's row at a
#: residual index.
UNIT_KINDS = ("mlp", "head", "direction")
#: Positions the histogram of a unit is made of (a block sample, the same for every unit).
HIST_SAMPLE = 4_000
HIST_BINS = 40
#: Tokens a document view shows at most (the document's first tokens).
DOC_TOKENS = 2000


def is_corpus(store: StoreReader) -> bool:
    return store.manifest.ingest.get("positions") == "all"


def load_direction_files(paths: list[str], store: StoreReader | None = None) -> dict[str, np.ndarray]:
    """name -> an [m, d] float32 array, for each ``--direction`` of serve: a ``FILE.npy`` (named by its
    stem), or ``[NAME=]SPEC``, a direction spec of ``actstore dfa`` (``probe:``, ``neuron:``, ``token:``,
    ``sae:``; :func:`actstore.query.analyses.dfa.load_direction`) resolved on ``store`` (the first
    store served), named NAME or the spec itself."""
    out: dict[str, np.ndarray] = {}
    for p in paths:
        name, _, spec = p.partition("=") if "=" in p.split(":")[0] else ("", "", p)
        if spec.split(":")[0] in ("probe", "neuron", "token", "sae"):
            if store is None:
                raise QueryError(f"serve: direction {spec} needs a store to be resolved on")
            from actstore.query.analyses.dfa import load_direction

            out[name or spec] = load_direction(store, spec)[None]
            continue
        try:
            a = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise QueryError(f"serve: cannot read {p} as a .npy array ({e})") from None
        a = np.asarray(a, dtype=np.float32)
        a = a[None] if a.ndim == 1 else a
        if a.ndim != 2 or not np.isfinite(a).all():
            raise QueryError(f"serve: {p} must be a finite [d] or [m, d] array (got shape {list(a.shape)})")
        name, n = Path(p).stem, 2
        while name in out:
            name, n = f"{Path(p).stem}-{n}", n + 1
        out[name] = a
    return out


# ----------------------------------------------------------------------------------- home
def corpus_home(store: StoreReader, directions: dict[str, np.ndarray]) -> dict[str, Any]:
    """Documents, tokens, the kinds and layers kept, the precomputed top-k runs, the directions served."""
    ing = store.manifest.ingest
    docs = sql(store, "SELECT count(DISTINCT document) AS d, count(*) AS n FROM positions")[0]
    topk: list[dict[str, Any]] = []
    if has_table(store, "topk_contexts"):
        topk = sql(
            store,
            "SELECT run_id, kind, layer, count(DISTINCT unit) AS units, max(rank) + 1 AS k "
            "FROM topk_contexts GROUP BY 1, 2, 3 ORDER BY 2, 3, 1",
        )
    first = sql(
        store,
        "SELECT document, count(*) AS tokens FROM positions GROUP BY 1 ORDER BY 1 LIMIT 50",
    )
    return jsonable(
        {
            "documents": docs["d"],
            "tokens": docs["n"],
            "dataset": ing.get("dataset"),
            "context_length": ing.get("context_length"),
            "kept": ing.get("kept") or {},
            "sources": attention_info(store)["sources"],
            "geometry": store.geometry.to_dict(),
            "topk": topk,
            "directions": {
                k: {"units": int(v.shape[0]), "d": int(v.shape[1])} for k, v in directions.items()
            },
            "first_documents": first,
        }
    )


def token_search(store: StoreReader, q: str, limit: int = 50) -> dict[str, Any]:
    """Positions whose token holds ``q`` (case-insensitive), first ``limit``, with their contexts."""
    if not q:
        return {"q": q, "hits": []}
    rows = sql(
        store,
        "SELECT row, document, position, token FROM positions WHERE contains(lower(token), lower(?)) "
        "ORDER BY row LIMIT ?",
        [q, limit],
    )
    ctx = position_contexts(store, [r["row"] for r in rows], before=8, after=4)
    for r in rows:
        c = ctx.get(int(r["row"]))
        r.update(before=c.before if c else "", after=c.after if c else "")
    return jsonable({"q": q, "hits": rows})


# ----------------------------------------------------------------------------------- units
def check_unit(
    store: StoreReader, kind: str, layer: int, index: int, directions: dict[str, np.ndarray], name: str | None
) -> np.ndarray | None:
    """Validate a unit (one-line 400/404); the direction vector for ``direction``."""
    g = store.geometry
    if kind not in UNIT_KINDS:
        raise NotFoundError(f"unit kind must be one of {', '.join(UNIT_KINDS)}, not {kind[:20]!r}")
    if kind == "mlp":
        check_corpus_kind(store, "mlp", [layer])
        if not 0 <= index < g.d_mlp:
            raise NotFoundError(f"neuron {index} is not in 0..{g.d_mlp - 1}")
        return None
    if kind == "head":
        check_corpus_kind(store, "attn_head", [layer])
        if not 0 <= index < g.n_heads:
            raise NotFoundError(f"head {index} is not in 0..{g.n_heads - 1}")
        if not name:
            return None
        base, row = _row_of(name)
        return _direction_row(store, directions, base, row)
    if name and _row_of(name)[0] != name:
        raise NotFoundError(
            f"a direction unit's row is its index (/unit/direction/LAYER/ROW), not {name[:40]!r}"
        )
    vec = _direction_row(store, directions, name, index)
    check_corpus_kind(store, "resid", [layer])
    return vec


def _row_of(name: str) -> tuple[str, int]:
    """``NAME[ROW]`` -> (NAME, ROW): a head read along row ROW of a served direction (row 0 without it)."""
    m = re.fullmatch(r"(.+)\[(\d{1,9})\]", name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _direction_row(
    store: StoreReader, directions: dict[str, np.ndarray], name: str | None, index: int
) -> np.ndarray:
    """Row ``index`` of the served direction ``name`` (or of ``neuron:L:I`` / ``token:ID`` computed from
    the store's weights); a one-line 404/400 otherwise."""
    g = store.geometry
    if name and name not in directions and name.split(":")[0] in ("neuron", "token"):
        from actstore.query.analyses.dfa import load_direction  # read from the store's weights only

        directions = {name: load_direction(store, name)[None]}  # a direction on demand (no file read)
    if not name or name not in directions:
        known = ", ".join(directions) or "none: give serve --direction FILE.npy"
        raise NotFoundError(
            f"no direction {str(name)[:40]!r} is served (known: {known}; or neuron:L:I, token:ID)"
        )
    d = directions[name]
    if not 0 <= index < d.shape[0]:
        raise NotFoundError(f"direction {name} has rows 0..{d.shape[0] - 1}, not {index}")
    if d.shape[1] != g.d_model:
        raise QueryError(f"direction {name} has {d.shape[1]} numbers, the residual stream {g.d_model}")
    return np.asarray(d[index], dtype=np.float32)


def unit_values(
    store: StoreReader, sel: Any, kind: str, layer: int, index: int, vec: np.ndarray | None
) -> Any:
    """(store rows, values) of the unit per block of ``sel``, in selection order (a generator)."""
    row_col = sel.rows.column("row").to_numpy()
    at = 0
    spec = None
    fold = None
    if kind == "head" and vec is not None:  # u . (z_h W_O,h) = z_h . (W_O,h u): one dot a row
        fold = store.weight("W_O", layer)[index] @ np.asarray(vec, np.float32)  # [d_head]
    elif kind == "head":
        spec = FeatureSpec.parse(store, "attn_head", [layer], [index])
    elif kind == "direction":
        spec = FeatureSpec.parse(store, "resid", [layer], None)
    for _ids, block in sel.blocks(1024):
        if kind == "mlp":
            v = store.read_segment_rows(block.segment, "mlp", block.seg_rows, [layer])[:, 0, index]
        elif fold is not None:
            z = store.read_segment_rows(block.segment, "z", block.seg_rows, [layer])[:, 0, index]
            v = z.astype(np.float32) @ fold
        elif kind == "head":
            assert spec is not None
            out = compute_block(store, spec, block)[:, 0, 0]  # [b, d_model]
            v = out @ vec if vec is not None else np.linalg.norm(out, axis=-1)
        else:
            assert vec is not None and spec is not None
            v = compute_block(store, spec, block).reshape(len(block.seg_rows), -1) @ vec
        v = np.asarray(v, dtype=np.float32)
        yield row_col[at : at + v.shape[0]], v
        at += v.shape[0]


def _stream_topk(
    store: StoreReader, kind: str, layer: int, index: int, vec: np.ndarray | None, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` (values, rows) of the unit over every row, in one streaming pass."""
    from actstore.query.select.selection import Selection

    best_v = np.empty(0, np.float32)
    best_r = np.empty(0, np.int64)
    for rows, v in unit_values(store, Selection.from_sql(store), kind, layer, index, vec):
        best_v = np.concatenate([best_v, v])
        best_r = np.concatenate([best_r, rows.astype(np.int64)])
        if best_v.size > k:
            keep = np.lexsort((best_r, -best_v))[:k]
            best_v, best_r = best_v[keep], best_r[keep]
    order = np.lexsort((best_r, -best_v))
    return best_v[order], best_r[order]


def _precomputed(
    store: StoreReader, kind: str, layer: int, index: int, name: str | None
) -> tuple[str, list[dict[str, Any]]] | None:
    if not has_table(store, "topk_contexts") or kind == "head" and name:
        return None  # (a head along a direction is never precomputed)
    tk = {"mlp": "mlp", "head": "attn_head", "direction": "direction"}[kind]
    for run in runs_of(store, "topk_contexts"):
        if kind == "direction":  # a direction run counts only when its file is the one served
            cfg = (
                sql(store, "SELECT config FROM runs WHERE run_id = ?", [run])
                if has_table(store, "runs")
                else []
            )
            if (
                not cfg
                or name is None
                or f'"{name}.npy"' not in str(cfg[0].get("config"))
                and f"/{name}.npy" not in str(cfg[0].get("config"))
            ):
                continue
        rows = sql(
            store,
            "SELECT rank, row, example_id, position, value FROM topk_contexts "
            "WHERE run_id = ? AND kind = ? AND layer = ? AND unit = ? ORDER BY rank",
            [run, tk, layer, index],
        )
        if rows:
            return run, rows
    return None


def hist_sample(store: StoreReader) -> Any:
    """The positions every unit's histogram is made of (a block sample, kept with the tables)."""
    return kept(
        store,
        f"hist_sample:{HIST_SAMPLE}",
        ("examples", "targets"),
        # clusters of at most 32 positions, as before corpus stores had longer chunks (a 2,048-row
        # chunk of tiny-llama would make the sample two runs of neighbouring positions)
        lambda: block_sample(
            store, HIST_SAMPLE, seed=0, chunk_rows=None if store.manifest.chunk_rows <= 32 else 32
        ),
    )


_SAMPLES: Kept = Kept(4)  # the sample's values of the last few (store, kind, layer): [n, units]


def _sample_values(
    store: StoreReader, kind: str, layer: int, index: int, vec: np.ndarray | None
) -> np.ndarray:
    """The unit's values on the histogram's sample: the sample's whole layer (every neuron, every
    head's norm, the residual) is read once and kept (the 4 most recent layers), so that another unit
    of the layer reads nothing."""
    sel = hist_sample(store)
    if len(sel) == 0:
        return np.empty(0, np.float32)
    along = kind == "head" and vec is not None  # a head read along a direction: every head's projection kept
    what = ("head along", hashlib.sha1(np.asarray(vec, np.float32).tobytes()).hexdigest()) if along else kind
    key = (id(store), store.url, signature(store, "examples", "targets"), what, layer)
    got = _SAMPLES.get(key)
    if got is None:
        spec = (
            None
            if kind == "mlp"
            else FeatureSpec.parse(store, "attn_head" if kind == "head" else "resid", [layer], None)
        )
        parts = []
        for _ids, block in sel.blocks(1024):
            if kind == "mlp":
                x = store.read_segment_rows(block.segment, "mlp", block.seg_rows, [layer])[:, 0]
            elif kind == "head":
                assert spec is not None
                x = compute_block(store, spec, block)[:, 0]  # [b, H, d_model]
                x = x @ vec if along else np.linalg.norm(x, axis=-1)  # [b, H]
            else:
                assert spec is not None
                x = compute_block(store, spec, block).reshape(len(block.seg_rows), -1)
            parts.append(np.asarray(x, dtype=np.float32))
        got = np.concatenate(parts)
        _SAMPLES[key] = got
    if kind == "direction":
        assert vec is not None
        return got @ vec  # type: ignore[no-any-return]
    return got[:, index]  # type: ignore[no-any-return]


def unit_view(
    store: StoreReader,
    kind: str,
    layer: int,
    index: int,
    directions: dict[str, np.ndarray],
    name: str | None = None,
    k: int = 20,
) -> dict[str, Any]:
    """A unit's page: top-k contexts (precomputed or streamed), histogram, logit effects."""
    vec = check_unit(store, kind, layer, index, directions, name)
    pre = _precomputed(store, kind, layer, index, name)
    if pre is not None:
        source = f"precomputed: topk run {pre[0]}"
        top: list[dict[str, Any]] = [{"row": int(r["row"]), "value": float(r["value"])} for r in pre[1][:k]]
    else:
        source = (
            "computed on demand (one streaming pass over every position; run actstore topk to precompute)"
        )
        v, r = _stream_topk(store, kind, layer, index, vec, k)
        top = [{"row": int(rr), "value": float(vv)} for vv, rr in zip(v.tolist(), r.tolist(), strict=True)]
    rows = [t["row"] for t in top]
    around = _context_values(store, kind, layer, index, vec, rows)
    for t in top:
        toks = around.get(t["row"], [])
        at = next((i for i, x in enumerate(toks) if x["at"]), None)
        me = toks[at] if at is not None else {}
        t["document"], t["position"] = me.get("document"), me.get("position")
        t["token"] = me.get("token", "")
        t["before"] = "".join(str(x["token"]) for x in toks[:at]) if at is not None else ""
        t["after"] = "".join(str(x["token"]) for x in toks[at + 1 :]) if at is not None else ""
        t["tokens"] = [{k: x[k] for k in ("row", "token", "value", "at")} for x in toks]
    vals = _sample_values(store, kind, layer, index, vec)
    counts, edges = np.histogram(vals, bins=HIST_BINS) if vals.size else (np.zeros(0), np.zeros(0))
    active = float((vals > 0).mean()) if vals.size else None
    along, along_row = _row_of(name or "")
    label = {
        "mlp": f"MLP neuron {layer}.{index}",
        "head": f"head {layer}.{index} output norm"
        if vec is None
        else f"head {layer}.{index} along {along}[{along_row}]",
        "direction": f"direction {name}[{index}] at residual {layer}",
    }[kind]
    return jsonable(
        {
            "kind": kind,
            "layer": layer,
            "index": index,
            "direction": name,
            "label": label,
            "source": source,
            "top": top,
            "histogram": {
                "counts": counts.tolist(),
                "edges": edges.tolist(),
                "n": int(vals.size),
                "of": store.n_rows,
                "active": active,
                "active_rule": "norm > 0" if kind == "head" and vec is None else "value > 0",
            },
            "logits": logit_effects(store, write_vector(store, kind, layer, index, vec)),
            "logits_note": None
            if kind != "head" or vec is not None
            else "a head writes no single direction (its output depends on its values): no logit effects here",
        }
    )


def _context_values(
    store: StoreReader, kind: str, layer: int, index: int, vec: np.ndarray | None, rows: list[int]
) -> dict[int, list[dict[str, Any]]]:
    """Per top row: the tokens of its window around it (12 before, 4 after) with the unit's value."""
    want = sorted({x for r in rows for x in range(max(0, r - 12), r + 5)})
    pos = sql(
        store,
        "SELECT row, document, window_index, position, token FROM positions "
        "WHERE row IN (SELECT unnest(?::BIGINT[])) ORDER BY row",
        [want],
    )
    values = _values_of_rows(store, kind, layer, index, vec, [int(p["row"]) for p in pos])
    by_row = {int(p["row"]): p for p in pos}
    out: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        me = by_row.get(r)
        if me is None:
            continue
        key = (me["document"], me["window_index"])
        toks = []
        for x in range(max(0, r - 12), r + 5):
            p = by_row.get(x)
            if p is not None and (p["document"], p["window_index"]) == key:
                toks.append(
                    {
                        "row": x,
                        "token": p["token"],
                        "value": values.get(x),
                        "at": x == r,
                        "document": p["document"],
                        "position": p["position"],
                    }
                )
        out[r] = toks
    return out


def _values_of_rows(
    store: StoreReader, kind: str, layer: int, index: int, vec: np.ndarray | None, rows: list[int]
) -> dict[int, float]:
    import pyarrow as pa
    import pyarrow.compute as pc

    from actstore.query.select.selection import Selection
    from actstore.serve.common import store_rows

    if not rows:
        return {}
    all_rows = store_rows(store)
    keep = pc.is_in(all_rows.column("row"), value_set=pa.array(np.asarray(rows, dtype=np.int64)))
    sel = Selection(store, all_rows.filter(keep))
    out: dict[int, float] = {}
    for r, v in unit_values(store, sel, kind, layer, index, vec):
        out.update(zip(r.tolist(), v.tolist(), strict=True))
    return out


# ----------------------------------------------------------------------------------- documents
def check_document(store: StoreReader, doc: int) -> None:
    if not sql(store, "SELECT 1 FROM positions WHERE document = ? LIMIT 1", [doc]):
        raise NotFoundError(f"no document {doc} in the store")


def document_view(
    store: StoreReader,
    doc: int,
    unit: tuple[str, int, int, str | None] | None,
    directions: dict[str, np.ndarray],
) -> dict[str, Any]:
    """Every token of document ``doc`` (its first :data:`DOC_TOKENS`), with a unit's value on each."""
    pos, more = document_positions(
        store, doc, "row, window_index, position, token, char_start, char_end", DOC_TOKENS
    )
    values = None
    label = None
    if unit is not None:
        kind, layer, index, name = unit
        vec = check_unit(store, kind, layer, index, directions, name)
        got = _values_of_rows(store, kind, layer, index, vec, [int(p["row"]) for p in pos])
        values = [got.get(int(p["row"])) for p in pos]
        label = f"{kind} {layer}.{index}" + (f" ({name})" if name else "")
    tokens = []
    for i, p in enumerate(pos):
        gap = i > 0 and p["char_start"] > pos[i - 1]["char_end"] >= 0
        tokens.append(
            {"row": p["row"], "token": p["token"], "space_before": bool(gap), "window": p["window_index"]}
        )
    return jsonable(
        {
            "document": doc,
            "tokens": tokens,
            "more": more,
            "values": values,
            "unit": label,
            "attention": attention_info(store),
        }
    )
