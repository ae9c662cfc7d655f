"""The result tables of a probe run (probe_runs, probe_episodes, probe_predictions, relation_metrics,
head_scores, token_scores) built from its output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.query.analyses.probe import ProbeOutput


# ----------------------------------------------------------------------------------- tables
def probe_tables(out: ProbeOutput) -> dict[str, pa.Table]:
    """The run's result tables (all carry ``run_id``)."""
    ep, c, rid = out.episodes, out.config, out.run_id
    rel = np.asarray(ep.relations, dtype=object)
    E, Q = out.pred.shape
    gold_idx = ep.classes[:, ep.query_labels]  # [E, Q]
    pred_idx = np.take_along_axis(ep.classes, out.pred, 1)
    lo, hi = out.ci95
    runs = pa.table(
        {
            "run_id": [rid],
            "kind": [c.kind],
            "selection": [c.where],
            "layers": [_ints(c.layers)],
            "heads": [_ints(c.heads)],
            "groups": pa.array([c.groups], pa.int32()),
            "n_way": [c.n_way],
            "k_shot": [c.k_shot],
            "queries": [c.queries],
            "episodes": [len(ep)],
            "seeds": [_ints(c.seeds)],
            "top_k": [c.top_k],
            "relspec": [c.relspec],
            "contrast": [c.contrast],
            "epochs": [c.epochs],
            "lr": [c.lr],
            "rows": [int(out.example_ids.size)],
            "relations": [len(ep.relations)],
            "mean_selected_features": [float(out.n_selected.mean())],
            "accuracy": [out.accuracy],
            "ci95_low": [lo],
            "ci95_high": [hi],
            "seconds": [out.seconds],
            "started": [out.started],
            "config": [c.to_json()],
        }
    )
    qids = out.example_ids[ep.query]
    episodes = pa.table(
        {
            "run_id": [rid] * E,
            "seed": ep.seed,
            "episode": ep.index,
            "relations": [list(rel[x]) for x in ep.classes],
            "support_ids": [list(x) for x in out.example_ids[ep.support]],
            "query_ids": [list(x) for x in qids],
            "n_selected": out.n_selected,
            "accuracy": out.episode_accuracy,
        }
    )
    predictions = pa.table(
        {
            "run_id": [rid] * (E * Q),
            "seed": np.repeat(ep.seed, Q),
            "episode": np.repeat(ep.index, Q),
            "example_id": qids.reshape(-1),
            "relation_id": rel[gold_idx].reshape(-1),
            "predicted": rel[pred_idx].reshape(-1),
            "correct": (gold_idx == pred_idx).reshape(-1),
            "prob": out.prob.reshape(-1),
            "head_score_total": out.head_total.reshape(-1),
        }
    )
    metrics = relation_metrics(rel[gold_idx].reshape(-1), rel[pred_idx].reshape(-1), list(ep.relations))
    metrics = metrics.add_column(0, "run_id", pa.array([rid] * metrics.num_rows))
    metrics = metrics.append_column(
        "relation_name",
        pa.array([out.relation_names.get(r) for r in metrics.column("relation_id").to_pylist()]),
    )
    seen = np.flatnonzero(
        out.hs_n > 0
    )  # relations with at least one query (every predicted one is among them)
    R, U = seen.size, out.hs_sum.shape[1]
    n = out.hs_n[seen][:, None]
    cols: dict[str, Any] = {
        "run_id": [rid] * (R * U),
        "relation_id": np.repeat(rel[seen], U),
        "layer": np.tile(out.unit_layer, R),
        "head": np.tile(out.unit_head, R),
        "score": (out.hs_sum[seen] / n).reshape(-1),
        "abs_score": (out.hs_abs[seen] / n).reshape(-1),
        "n": np.repeat(out.hs_n[seen].astype(np.int64), U),
    }
    if out.hsp_sum is not None and out.hsp_abs is not None and out.hsp_n is not None:
        # per *predicted* relation (0 where the relation was never predicted; pred_n says so)
        pn = out.hsp_n[seen][:, None]
        safe = np.where(pn > 0, pn, 1.0)
        cols.update(
            pred_score=(out.hsp_sum[seen] / safe).reshape(-1),
            pred_abs_score=(out.hsp_abs[seen] / safe).reshape(-1),
            pred_n=np.repeat(out.hsp_n[seen].astype(np.int64), U),
        )
    heads = pa.table(cols)
    tables = {
        "probe_runs": runs,
        "probe_episodes": episodes,
        "probe_predictions": predictions,
        "relation_metrics": metrics,
        "head_scores": heads,
    }
    if out.weights:
        tables["probe_weights"] = weights_table(out)
    if out.token_rows:
        t = pa.Table.from_pylist(out.token_rows)
        tables["token_scores"] = t.add_column(0, "run_id", pa.array([rid] * t.num_rows))
    return tables


#: Episodes per row group of ``probe_weights``: a reader of one episode decodes only its own group.
WEIGHTS_GROUP_ROWS = 1


def weights_table(out: ProbeOutput) -> pa.Table:
    """One row per episode: its trained probe (:class:`actstore.query.analyses.probe.EpisodeWeights`), the
    weights flattened row-major from [n_features, n_way] (``n_way`` columns per selected feature)."""
    ep, w = out.episodes, out.weights
    f32 = pa.list_(pa.float32())
    return pa.table(
        {
            "run_id": pa.array([out.run_id] * len(w), pa.string()),
            "seed": pa.array(ep.seed, pa.int64()),
            "episode": pa.array(ep.index, pa.int64()),
            "n_way": pa.array([x.weight.shape[1] for x in w], pa.int32()),
            "features": pa.array([x.features for x in w], pa.list_(pa.int32())),
            "mean": pa.array([x.mean for x in w], f32),
            "std": pa.array([x.std for x in w], f32),
            "weight": pa.array([x.weight.reshape(-1) for x in w], f32),
            "bias": pa.array([x.bias for x in w], f32),
        }
    )


def relation_metrics(gold: np.ndarray, pred: np.ndarray, relations: Sequence[str]) -> pa.Table:
    """Per-relation precision, recall and F1 over pooled query predictions."""
    rows = []
    for r in relations:
        tp = int(np.sum((gold == r) & (pred == r)))
        n_gold, n_pred = int(np.sum(gold == r)), int(np.sum(pred == r))
        p = tp / n_pred if n_pred else 0.0
        rc = tp / n_gold if n_gold else 0.0
        rows.append(
            {
                "relation_id": r,
                "n_queries": n_gold,
                "n_predicted": n_pred,
                "tp": tp,
                "precision": p,
                "recall": rc,
                "f1": 2 * p * rc / (p + rc) if p + rc else 0.0,
            }
        )
    return pa.Table.from_pylist(rows)


def _ints(x: Sequence[int] | None) -> str | None:
    return None if x is None else ",".join(str(int(v)) for v in x)
