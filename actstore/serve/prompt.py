"""The prompt view: a prompt's tokens, its stored TokenScores and predictions, and for a chosen head
the exact per-source-token contributions ``Delta_att,h(t, j) = A_h(t,j) V_kv(h)(j) W_O,h`` read
along the probe direction of the prompt's prediction in a probe run, with the attention pattern.

The probe direction is the one :func:`actstore.query.analyses.explain.explain_example` re-derives from the
stored episode (the probe's weights are not stored; its episode lists make the re-training exact):
``u = dW / sd`` in raw feature space, so that ``u_{l,h} . Delta_att,h(t, j)`` is source token j's
share of head (l, h)'s term ``u_{l,h} . attn_head_{l,h}`` of the prediction's logit contrast (the
HeadScore is that term minus the centering ``u . mu``).  The values are computed from the stored A
and V with ``p = W_O,h u_{l,h}`` (no d_model vector per token is materialised); the tests check
them against ``Selection.features("attn_head_token")`` projected on ``u``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actstore.core.errors import NotFoundError, QueryError
from actstore.core.store import StoreReader
from actstore.query.analyses.attribution import TOKEN_KINDS, TokenGeometry
from actstore.query.analyses.explain import explain_example
from actstore.query.analyses.probe_config import ProbeConfig
from actstore.serve.catalog import Served
from actstore.serve.common import cached_rows, columns, grid, has_table, jsonable, kept, rows_selection, sql


def token_texts(store: StoreReader, ex: int, text: str) -> list[dict[str, Any]]:
    """The prompt's tokens: position, token string, and the text it covers (by its character span; a
    token that covers no text, a special token, as its token string)."""
    rows = sql(
        store,
        "SELECT position, token, char_start, char_end FROM tokens WHERE example_id = ? ORDER BY position",
        [ex],
    )
    out = []
    for r in rows:
        cs, ce = r["char_start"], r["char_end"]
        if cs is not None and ce is not None and 0 <= cs < ce <= len(text):
            shown = text[cs:ce]
        else:
            shown = str(r.get("token") or "").replace("Ġ", " ").replace("▁", " ")
        out.append({"position": r["position"], "token": r.get("token"), "text": shown})
    return out


def episodes_index(store: StoreReader) -> dict[int, list[tuple[str, int, int]]]:
    """example_id -> the (run_id, seed, episode) of every stored probe episode it is a query of, read
    once and kept while the ``probe_episodes`` files stay the same (the prompt views look it up per
    request without a statement)."""
    rows = cached_rows(
        store,
        "probe_episodes",
        "SELECT run_id, seed, episode, query_ids FROM probe_episodes ORDER BY run_id, seed, episode",
    )

    def build() -> dict[int, list[tuple[str, int, int]]]:
        got: dict[int, list[tuple[str, int, int]]] = {}
        for r in rows:
            for x in r["query_ids"] or ():
                got.setdefault(int(x), []).append((str(r["run_id"]), int(r["seed"]), int(r["episode"])))
        return got

    return kept(store, "episodes_index", ("probe_episodes",), build)  # type: ignore[no-any-return]


def query_runs(store: StoreReader, ex: int) -> list[dict[str, Any]]:
    """The probe runs of a per-source kind in which the prompt is a query (newest first)."""
    if not (has_table(store, "probe_episodes") and has_table(store, "probe_runs")):
        return []
    runs = {
        str(r["run_id"]): r
        for r in cached_rows(store, "probe_runs", "SELECT run_id, kind, started FROM probe_runs")
    }
    mine = {run for run, _, _ in episodes_index(store).get(ex, ())}
    out = [
        {"run_id": run, "kind": runs[run]["kind"], "started": runs[run]["started"]}
        for run in mine
        if run in runs and runs[run]["kind"] in TOKEN_KINDS
    ]
    out.sort(key=lambda r: r["run_id"], reverse=True)
    out.sort(key=lambda r: (r["started"] is None, -(r["started"] or 0)))
    return out


def prompt_view(store: StoreReader, ex: int) -> dict[str, Any]:
    """Everything stored about one prompt (no probe is re-trained here; see :func:`contributions`)."""
    g = store.geometry
    ecols = [
        c
        for c in (
            "example_id",
            "relation_id",
            "relation_name",
            "text",
            "subject",
            "object",
            "subject_start",
            "subject_end",
            "n_tokens",
            "source",
        )
        if c in columns(store, "examples")
    ]
    found = sql(store, f"SELECT {', '.join(ecols)} FROM examples WHERE example_id = ?", [ex])
    if not found:
        raise NotFoundError(f"example {ex} is not in the store")
    example = found[0]
    target = sql(store, "SELECT * FROM targets WHERE example_id = ? LIMIT 1", [ex])
    out: dict[str, Any] = {
        "example": example,
        "target": target[0] if target else None,
        "tokens": token_texts(store, ex, str(example.get("text") or "")),
        "layers": g.n_layers,
        "heads": g.n_heads,
        "runs": query_runs(store, ex),
    }
    if has_table(store, "token_scores"):
        tcols = [
            c
            for c in (
                "run_id",
                "seed",
                "episode",
                "relation_id",
                "predicted",
                "scores",
                "centering",
                "head_score_total",
            )
            if c in columns(store, "token_scores")
        ]
        out["token_scores"] = sql(
            store, f"SELECT {', '.join(tcols)} FROM token_scores WHERE example_id = ? LIMIT 20", [ex]
        )
    if has_table(store, "probe_predictions"):
        out["predictions"] = sql(
            store,
            "SELECT run_id, count(*) AS n, avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) AS accuracy, "
            "mode(predicted) AS most_predicted, avg(prob) AS mean_prob FROM probe_predictions WHERE example_id = ? GROUP BY 1 ORDER BY 1",
            [ex],
        )
    out["tracing"] = _tracing(store, ex)
    out["patching"] = _patching(store, ex)
    return jsonable(out)


def _tracing(store: StoreReader, ex: int) -> list[dict[str, Any]]:
    """Per component, the restored probability (position x layer) of the fact's newest tracing run."""
    cols = set(columns(store, "trace_effects"))  # none when the table is absent
    if not {"component", "layer", "position"} <= cols:
        return []
    value = "prob" if "prob" in cols else "indirect_effect"
    rows = sql(
        store,
        f"SELECT run_id, component, layer, position, {value} AS v FROM trace_effects WHERE example_id = ? ORDER BY run_id DESC",
        [ex],
    )
    if not rows:
        return []
    run = rows[0]["run_id"]
    rows = [r for r in rows if r["run_id"] == run]
    n_pos = max(int(r["position"]) for r in rows) + 1
    n_layer = max(int(r["layer"]) for r in rows) + 1
    return [
        {
            "run_id": run,
            "component": c,
            "value": value,
            "grid": grid([r for r in rows if r["component"] == c], "v", n_pos, n_layer, "position", "layer"),
        }
        for c in sorted({str(r["component"]) for r in rows})
    ]


def _patching(store: StoreReader, ex: int) -> list[dict[str, Any]]:
    """Per component, the recovery per layer (and per head for ``head``) of the newest patching run."""
    cols = set(columns(store, "patch_effects"))
    if not {"component", "layer", "recovery"} <= cols:
        return []
    hcol = "head" if "head" in cols else "-1 AS head"
    rows = sql(
        store,
        f"SELECT run_id, component, layer, {hcol}, avg(recovery) AS v FROM patch_effects WHERE example_id = ? "
        "GROUP BY 1, 2, 3, 4 ORDER BY 1 DESC",
        [ex],
    )
    if not rows:
        return []
    run = rows[0]["run_id"]
    g = store.geometry
    out = []
    for c in sorted({str(r["component"]) for r in rows if r["run_id"] == run}):
        part = [r for r in rows if r["run_id"] == run and r["component"] == c]
        if any(int(r["head"]) >= 0 for r in part):
            out.append({"run_id": run, "component": c, "grid": grid(part, "v", g.n_layers, g.n_heads)})
        else:
            out.append(
                {
                    "run_id": run,
                    "component": c,
                    "grid": [[r["v"]] for r in sorted(part, key=lambda r: r["layer"])],
                }
            )
    return out


# ----------------------------------------------------------------------------------- contributions
def _explanation(served: Served, run: str, ex: int) -> Any:

    store = served.store
    configs = cached_rows(store, "probe_runs", "SELECT run_id, config FROM probe_runs")
    text = next((r["config"] for r in configs if r["run_id"] == run), None)
    seed, episode = next(((s, e) for r, s, e in episodes_index(store).get(ex, ()) if r == run), (None, None))
    return served.cached(
        ("explain", run, ex),
        lambda: explain_example(
            store,
            run,
            ex,
            seed=seed,
            episode=episode,
            select=lambda ids: rows_selection(store, ids),
            config=None if text is None else ProbeConfig.from_json(str(text)),
            episodes=served.episodes,
        ),
    )


def _factors(store: StoreReader, ex: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """The prompt's stored attention row A [n_src, L, H], values V [n_src, L, H_kv, d_head] and subject span."""
    ((_, block),) = list(rows_selection(store, [ex]).blocks())
    A = store.read_segment_ranges(block.segment, "attn", block.src_start, block.n_src)
    V = store.read_segment_ranges(block.segment, "v", block.src_start, block.n_src)
    return A, V, (int(block.subject_start[0]), int(block.subject_end[0]))


def contributions(
    served: Served, ex: int, run: str | None, layer: int | None, head: int | None
) -> dict[str, Any]:
    """For head (``layer``, ``head``): each source token's contribution read along the probe direction
    of the prompt's prediction in ``run`` (default: the newest per-source probe run in which it is a
    query), the attention pattern, the per-layer TokenScore and the prompt's HeadScore grid.  Without
    such a run: the norm of each source token's contribution instead."""

    store, g = served.store, served.store.geometry
    runs = [r["run_id"] for r in served.cached(("query_runs", ex), lambda: query_runs(store, ex))]
    if run is not None and run not in runs:
        raise NotFoundError(
            f"prompt {ex} is not a query of a per-source probe run {run!r} (runs: {', '.join(runs) or 'none'})"
        )
    run = run or (runs[0] if runs else None)
    A, V, (s0, s1) = served.cached(("factors", ex), lambda: _factors(store, ex))
    n_src = A.shape[0]
    out: dict[str, Any] = {"example_id": ex, "run_id": run, "runs": runs, "n_src": n_src}
    if run is None:
        lay, hd = (g.n_layers - 1 if layer is None else layer), (0 if head is None else head)
        x = rows_selection(store, [ex]).features("attn_head_token", layers=[lay], heads=[hd])[0, 0, 0, :n_src]
        out.update(
            mode="norm",
            layer=lay,
            head=hd,
            values=np.linalg.norm(x.astype(np.float64), axis=1),
            attention=A[:, lay, hd],
            note="the prompt is not a query of any probe run over per-source features: norms |Delta_att,h(t, j)| shown",
        )
        return jsonable(out)
    e = _explanation(served, run, ex)
    layers, heads = list(e.layers), list(e.heads)
    per_layer = e.kind == "attn"
    hs = grid(
        [
            {"layer": int(a), "head": 0 if per_layer else int(b), "v": float(v)}
            for a, b, v in zip(e.unit_layer, e.unit_head, e.head_scores)
        ],
        "v",
        g.n_layers,
        1 if per_layer else g.n_heads,
    )
    if layer is None or head is None:
        unit = int(np.argmax(np.abs(e.head_scores)))
        layer = int(e.unit_layer[unit]) if layer is None else layer
        head = (0 if per_layer else int(e.unit_head[unit])) if head is None else head
    if layer not in layers:
        raise QueryError(f"run {run} probed layers {','.join(map(str, layers))}, not layer {layer}")
    if head not in heads:
        raise QueryError(f"run {run} probed heads {','.join(map(str, heads))}, not head {head}")
    geo = served.cached(
        ("geometry", run), lambda: TokenGeometry.of(store, e.kind, layers, None if per_layer else heads)
    )
    li, hi = layers.index(layer), heads.index(head)
    u = torch.from_numpy(np.asarray(e.direction, dtype=np.float32))[None]
    p = geo.project(u)[0].numpy()  # [L', H', d_head]
    kv = head // g.kv_group
    a = A[:, layer, head]
    values = a * (V[:, layer, kv] @ p[li, hi].astype(np.float32))
    if e.kind == "attn_entity":  # the feature sums the subject's sources only
        keep = np.zeros(n_src, dtype=values.dtype)
        if s0 >= 0:
            keep[s0:s1] = 1
        values = values * keep
    u_head = np.asarray(e.direction).reshape(len(layers), -1, g.d_model)[li, 0 if per_layer else hi]
    out.update(
        mode="probe",
        kind=e.kind,
        layer=layer,
        head=head,
        seed=e.seed,
        episode=e.episode,
        relation_id=e.relation_id,
        predicted=e.predicted,
        probability=e.probability,
        values=values,
        attention=a,
        direction=u_head,
        head_sum=float(values.sum()),
        headscore_grid=hs,
        per_layer=per_layer,
        token_scores={"layers": layers, "scores": e.token_scores},
        probed_layers=layers,
        probed_heads=heads,
    )
    return jsonable(out)
