"""Explaining one stored probe prediction: re-train its episode and attribute it.

:func:`explain_example` finds the episode of a probe run in which an example is a query (the stored
episode lists make the re-training exact), trains that episode's probe again and returns the
prediction's HeadScore per unit and TokenScore per source token, with the per-layer identity
``sum_h HeadScore = sum_j TokenScore + centering`` (:meth:`Explanation.layer_table`).  The formulas
are :mod:`actstore.query.analyses.attribution`; the training is :mod:`actstore.query.analyses.probe`.  This module imports both and
neither imports it back.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.query.analyses import probe
from actstore.query.analyses.attribution import (
    DEFAULT_CONTRAST,
    TOKEN_KINDS,
    TokenGeometry,
    check_contrast,
    contrast_coefficients,
    run_row,
    token_scores,
    unit_scores,
)
from actstore.query.analyses.probe import ProbeConfig, select_or_all, torch_threads
from actstore.query.analyses.probe_features import FeatureMatrix, load_features
from actstore.query.analyses.relspec import Selected, gather_standardized
from actstore.query.select.selection import Selection


@dataclass(frozen=True)
class Explanation:
    """HeadScore and TokenScore of one query prediction, re-derived from its episode."""

    run_id: str
    seed: int
    episode: int
    example_id: int
    relation_id: str
    predicted: str
    probability: float
    layers: tuple[int, ...]
    unit_layer: np.ndarray  # [U]
    unit_head: np.ndarray  # [U]
    head_scores: np.ndarray  # [U]
    token_scores: np.ndarray  # [L', n_src]
    centering: np.ndarray  # [L']
    tokens: list[str]
    contrast: str = DEFAULT_CONTRAST  # the reading of dW used
    kind: str = ""  # the run's feature kind
    heads: tuple[int, ...] = ()  # the heads the features hold (all heads for ``attn``)
    #: u = dW / sd scattered into raw feature space ([F]: [L', H', d_model] for the per-head kinds,
    #: [L', d_model] for ``attn``), zero off the selected features: the probe direction that a raw
    #: feature vector x is read along (dW . x' = u . x - u . mu).
    direction: np.ndarray | None = None

    def layer_table(self) -> list[dict[str, float | int]]:
        """Per layer: the head-score sum, the token-score sum, the centering term and the residual
        head_score_sum - (token_score_sum + centering)."""
        rows: list[dict[str, float | int]] = []
        for i, layer in enumerate(self.layers):
            hs = float(self.head_scores[self.unit_layer == layer].sum())
            ts = float(self.token_scores[i].sum())
            c = float(self.centering[i])
            rows.append(
                {
                    "layer": int(layer),
                    "head_score_sum": hs,
                    "token_score_sum": ts,
                    "centering": c,
                    "residual": hs - ts - c,
                }
            )
        return rows


def explain_example(
    store: StoreReader,
    run_id: str,
    example_id: int,
    *,
    seed: int | None = None,
    episode: int | None = None,
    contrast: str | None = None,
    select: Callable[[list[int]], Selection] | None = None,
    config: ProbeConfig | None = None,
    episodes: MutableMapping[tuple[str, int, int], TrainedEpisode] | None = None,
    stored: bool = True,
) -> Explanation:
    """Re-train the episode of run ``run_id`` in which ``example_id`` is a query (the first one,
    or the given seed/episode; the stored episode lists make this exact) and attribute its
    prediction.  ``contrast``: the reading of dW (default: the run's own).  ``select``: makes the
    Selection of given example ids (default :meth:`Selection.from_ids`; a caller holding the store's
    rows already cuts them in memory).  ``config``: the run's settings, when the caller has read them
    (default: from its ``probe_runs`` row).  ``episodes``: trained episodes kept by the caller, by
    (run_id, seed, episode): an episode found there is not trained again (its other queries are then
    explained from it), one trained here is put there.  ``stored``: when the run stored its episodes'
    probes (the ``probe_weights`` table, ``ProbeConfig.store_weights``), read the episode's probe from
    there instead of training it (then only the query's own row of features is loaded); False always
    trains it again."""
    cfg = config or ProbeConfig.from_json(str(run_row(store, run_id)["config"]))
    if contrast is not None:
        cfg = replace(cfg, contrast=check_contrast(contrast))
    with torch_threads(cfg.threads):
        pick = select or partial(Selection.from_ids, store)
        return _explain(store, run_id, cfg, example_id, seed, episode, pick, episodes, stored)


@dataclass(frozen=True)
class TrainedEpisode:
    """One probe episode trained again: what explaining any of its queries needs."""

    row: dict[str, Any]  # seed, episode, relations, support_ids, query_ids
    layers: tuple[int, ...]
    unit_layer: np.ndarray  # [U]
    unit_head: np.ndarray  # [U]
    unit_size: int
    n_features: int
    geo: TokenGeometry
    sel: Any  # the support's feature selection (index, valid, mean, std)
    xq: torch.Tensor | None  # [1, Q, Fm] the queries' standardized selected features (None: read per query)
    W: torch.Tensor  # [1, Fm, C]
    b: torch.Tensor  # [1, C]


def _episode_row(
    store: StoreReader, run_id: str, example_id: int, seed: int | None, episode: int | None
) -> dict[str, Any]:
    eps = store.sql(
        "SELECT seed, episode, relations, support_ids, query_ids FROM probe_episodes "
        "WHERE run_id = $run AND list_contains(query_ids, $ex) "
        "AND ($seed IS NULL OR seed = $seed) AND ($episode IS NULL OR episode = $episode) "
        "ORDER BY seed, episode LIMIT 1",
        {
            "run": run_id,
            "ex": int(example_id),
            "seed": None if seed is None else int(seed),
            "episode": None if episode is None else int(episode),
        },
    ).to_pylist()
    if not eps:
        raise QueryError(
            f"example {example_id} is not a query of any episode of run {run_id}"
            + ("" if seed is None and episode is None else " with that seed/episode")
        )
    return dict(eps[0])


def _features(store: StoreReader, cfg: ProbeConfig, rows: Selection) -> FeatureMatrix:
    """The run's features of ``rows``, loaded as the run loaded them."""
    return load_features(
        store,
        cfg.kind,
        rows=rows,
        layers=cfg.layers,
        heads=cfg.heads,
        groups=cfg.groups,
        dtype=cfg.feature_dtype,
    )


def stored_weights(store: StoreReader, run_id: str, seed: int, episode: int) -> dict[str, np.ndarray] | None:
    """The probe that run ``run_id`` trained on episode (``seed``, ``episode``), from its ``probe_weights``
    row: features [Fm] (int64), mean, std [Fm], weight [Fm, C], bias [C] (float32); None when the run
    stored none (a run made with ``store_weights`` off, or before the table existed).  The table has one
    episode per Parquet row group, so this decodes that episode's lists only."""
    if not store.table_files().get("probe_weights"):
        return None
    t = store.sql(
        "SELECT n_way, features, mean, std, weight, bias FROM probe_weights "
        "WHERE run_id = ? AND seed = ? AND episode = ? LIMIT 1",
        [run_id, int(seed), int(episode)],
    )
    if t.num_rows == 0:
        return None

    def flat(name: str) -> np.ndarray:
        return np.asarray(pc.list_flatten(t.column(name)).to_numpy(zero_copy_only=False))

    c = int(t.column("n_way")[0].as_py())
    return {
        "features": flat("features").astype(np.int64),
        "mean": flat("mean").astype(np.float32),
        "std": flat("std").astype(np.float32),
        "weight": flat("weight").astype(np.float32).reshape(-1, c),
        "bias": flat("bias").astype(np.float32),
    }


def _stored_episode(
    store: StoreReader, cfg: ProbeConfig, e: dict[str, Any], w: dict[str, np.ndarray], fm: FeatureMatrix
) -> TrainedEpisode:
    """The episode's stored probe as a :class:`TrainedEpisode` (its queries' features read per query);
    ``fm``: any rows' features of the run (for the layers and units)."""
    index = torch.from_numpy(w["features"])[None]
    sel = Selected(
        index,
        torch.ones(index.shape, dtype=torch.bool),
        torch.from_numpy(w["mean"])[None],
        torch.from_numpy(w["std"])[None],
    )
    geo = TokenGeometry.of(store, cfg.kind, fm.layers, fm.heads)
    layer, head = fm.unit_labels()
    W, b = torch.from_numpy(w["weight"])[None], torch.from_numpy(w["bias"])[None]
    return TrainedEpisode(e, fm.layers, layer, head, fm.unit_size, fm.n_features, geo, sel, None, W, b)


def _train_episode(
    store: StoreReader, cfg: ProbeConfig, e: dict[str, Any], select: Callable[[list[int]], Selection]
) -> TrainedEpisode:
    n, sup_ids, q_ids = len(e["relations"]), list(e["support_ids"]), list(e["query_ids"])
    k = len(sup_ids) // n
    fm = _features(store, cfg, select(sup_ids + q_ids))
    pos = {int(x): i for i, x in enumerate(fm.example_ids.tolist())}
    sup = torch.tensor([[pos[x] for x in sup_ids]])
    qry = torch.tensor([[pos[x] for x in q_ids]])
    geo = TokenGeometry.of(store, cfg.kind, fm.layers, fm.heads)
    sel = select_or_all(fm.data[sup].to(torch.float32), n, k, cfg)
    xs = gather_standardized(fm.data, sup, sel)
    xq = gather_standardized(fm.data, qry, sel)
    # through the module, so that the trainer is the one run_probe calls (tests spy on it there)
    W, b = probe.train_batched(xs, torch.arange(n).repeat_interleave(k), n, epochs=cfg.epochs, lr=cfg.lr)
    layer, head = fm.unit_labels()
    return TrainedEpisode(e, fm.layers, layer, head, fm.unit_size, fm.n_features, geo, sel, xq, W, b)


def _explain(
    store: StoreReader,
    run_id: str,
    cfg: ProbeConfig,
    example_id: int,
    seed: int | None,
    episode: int | None,
    select: Callable[[list[int]], Selection],
    episodes: MutableMapping[tuple[str, int, int], TrainedEpisode] | None,
    stored: bool = True,
) -> Explanation:
    if cfg.kind not in TOKEN_KINDS:
        raise QueryError(
            f"TokenScore needs per-source attention features ({', '.join(TOKEN_KINDS)}); "
            f"run {run_id} probed {cfg.kind!r}"
        )
    key = (run_id, -1 if seed is None else int(seed), -1 if episode is None else int(episode))
    t = None if episodes is None else episodes.get(key)
    fq: FeatureMatrix | None = None  # the query's own features, once loaded
    if t is None or int(example_id) not in t.row["query_ids"]:
        e = _episode_row(store, run_id, example_id, seed, episode)
        key = (run_id, int(e["seed"]), int(e["episode"]))
        t = None if episodes is None else episodes.get(key)
        if t is None:
            w = stored_weights(store, run_id, key[1], key[2]) if stored else None
            if w is None:
                t = _train_episode(store, cfg, e, select)
            else:
                fq = _features(store, cfg, select([int(example_id)]))
                t = _stored_episode(store, cfg, e, w, fq)
            if episodes is not None:
                episodes[key] = t
    e, W, b, sel, geo = t.row, t.W, t.b, t.sel, t.geo
    n, q_ids = len(e["relations"]), list(e["query_ids"])
    q = len(q_ids) // n
    qi = q_ids.index(int(example_id))
    if t.xq is not None:
        x = t.xq[0, qi]
    else:  # a stored probe: this query's row of features, standardised with the episode's support
        fq = fq if fq is not None else _features(store, cfg, select([int(example_id)]))
        x = gather_standardized(fq.data, torch.zeros((1, 1), dtype=torch.long), sel)[0, 0]
    probs = torch.softmax(x @ W[0] + b[0], -1)
    pred = probs.argmax()
    dW = W[0] @ contrast_coefficients(probs, pred, cfg.contrast)  # [Fm]
    U, usize = len(t.unit_layer), t.unit_size
    units = torch.where(sel.valid[0], sel.index[0] // usize, torch.full_like(sel.index[0], U))
    hs = unit_scores((dW * x)[None, None], units[None], U)[0, 0]
    u_sel = dW / sel.std[0]
    cent = unit_scores((u_sel * (geo.offset[sel.index[0]] - sel.mean[0]))[None, None], units[None], U)[0, 0]
    u = torch.zeros(t.n_features).scatter_add_(0, sel.index[0], u_sel)
    ts = token_scores(store, geo, [int(example_id)], geo.project(u[None]), select=select)[0]
    toks = store.sql("SELECT token FROM tokens WHERE example_id = ? ORDER BY position", [int(example_id)])
    return Explanation(
        run_id,
        int(e["seed"]),
        int(e["episode"]),
        int(example_id),
        e["relations"][qi // q],
        e["relations"][int(pred)],
        float(probs[pred]),
        t.layers,
        t.unit_layer,
        t.unit_head,
        hs.numpy(),
        ts,
        cent.reshape(len(t.layers), -1).sum(1).numpy(),
        toks.column("token").to_pylist()[: ts.shape[1]],
        cfg.contrast,
        cfg.kind,
        geo.heads,
        u.numpy(),
    )
