"""Episodic relation probes over the store, many episodes trained as one tensor problem.

    fm = load_features(store, "attn_head", rows=Selection.from_sql(store, "split = 'val'"))
    out = run_probe(store, ProbeConfig(kind="attn_head", n_way=5, k_shot=5), features=fm)
    out.accuracy, out.ci95
    record_probe(store, out)   # actstore.jobs.probe: probe_runs, probe_episodes, probe_predictions, ...

The features of every selected row are computed once from the store's factors (streamed in
batches of rows) and kept as one ``[N, F]`` matrix (float32, or float16 to halve memory).
Episodes are then processed in chunks of B (sized to ``memory_mb``): RelSpec picks each
episode's features on its support set (:mod:`actstore.query.analyses.relspec`), only those entries are
gathered, and multinomial logistic probes (weights ``[b, C, Fm]``, zero-initialised,
cross-entropy, Adam, full-batch, ``epochs`` steps) are trained jointly, ``train_batch``
episodes per tensor problem: the loss is the sum over episodes of each episode's mean
cross-entropy, so every episode gets exactly its own gradient, and padded features stay at
weight 0 (their gradient is 0).  On a CPU, 1-2 episodes per problem is fastest (the inputs
stay in cache over the epochs; measured 0.14-0.17 CPU s per 5-way episode with 15k features
against 0.23-0.28 for 8-16); on an accelerator a large ``train_batch`` would be the choice.
Selection, gathering and attribution are batched over the whole chunk.  The trainers are in
:mod:`actstore.query.analyses.probe_training` (imported here): :func:`train_batched`, and :func:`train_reference`, the plain
one-episode trainer (``nn.Linear`` + ``torch.optim.Adam``) the tests compare against.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actstore.core.progress import progress_bar
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.query.analyses.attribution import (
    TOKEN_KINDS,
    TokenGeometry,
    contrast_coefficients,
    token_scores,
    unit_scores,
)
from actstore.query.analyses.episodes import EpisodeSet, sample_seeds
from actstore.query.analyses.probe_config import ProbeConfig
from actstore.query.analyses.probe_features import FeatureMatrix, load_features
from actstore.query.analyses.probe_training import train_batched, train_reference
from actstore.query.analyses.relspec import Selected, gather_standardized, select_features
from actstore.query.analyses.stats import mean_interval
from actstore.query.select.selection import Selection


# ----------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class EpisodeWeights:
    """One episode's trained probe, as the run trained it: the selected features (indices into the
    run's feature vector, ascending), their support mean and std, the weights [Fm, C] and bias [C].
    A query x is predicted as ``softmax(((x[features] - mean) / std) @ weight + bias)``."""

    features: np.ndarray  # [Fm] int32
    mean: np.ndarray  # [Fm] float32
    std: np.ndarray  # [Fm] float32
    weight: np.ndarray  # [Fm, C] float32
    bias: np.ndarray  # [C] float32


@dataclass
class ProbeOutput:
    run_id: str
    config: ProbeConfig
    episodes: EpisodeSet
    example_ids: np.ndarray  # [N] of the feature matrix (positions index into it)
    labels: list[str]
    relation_names: dict[str, str]
    unit_layer: np.ndarray
    unit_head: np.ndarray
    episode_accuracy: np.ndarray  # [E]
    n_selected: np.ndarray  # [E]
    pred: np.ndarray  # [E, Q] class index in the episode
    prob: np.ndarray  # [E, Q] softmax probability of the prediction
    head_total: np.ndarray  # [E, Q] sum of the prediction's head scores (= dW . x')
    hs_sum: np.ndarray  # [R, U] head scores summed over predictions, per gold relation
    hs_abs: np.ndarray  # [R, U] sum of |head score|
    hs_n: np.ndarray  # [R]
    hsp_sum: np.ndarray | None = None  # [R, U] the same per *predicted* relation (no labels needed)
    hsp_abs: np.ndarray | None = None  # [R, U] sum of |head score| per predicted relation
    hsp_n: np.ndarray | None = None  # [R] predictions of each relation
    token_rows: list[dict[str, Any]] = field(default_factory=list)
    #: per episode (when ``config.store_weights``): its trained probe (:class:`EpisodeWeights`)
    weights: list[EpisodeWeights] = field(default_factory=list)
    seconds: float = 0.0
    started: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return float(self.episode_accuracy.mean())

    @property
    def ci95(self) -> tuple[float, float]:
        """Normal 95% interval of the mean episode accuracy (:func:`actstore.query.analyses.stats.mean_interval`)."""
        return mean_interval(self.episode_accuracy)

    def summary(self) -> dict[str, Any]:
        c = self.config
        lo, hi = self.ci95
        return {
            "run_id": self.run_id,
            "kind": c.kind,
            "n_way": c.n_way,
            "k_shot": c.k_shot,
            "queries": c.queries,
            "episodes": len(self.episodes),
            "seeds": list(c.seeds),
            "relspec": c.relspec,
            "contrast": c.contrast,
            "accuracy": round(self.accuracy, 6),
            "ci95": [round(lo, 6), round(hi, 6)],
            "rows": int(self.example_ids.size),
            "relations": len(self.episodes.relations),
            "mean_selected_features": float(self.n_selected.mean()),
            "seconds": round(self.seconds, 2),
            "timings": {k: round(v, 2) for k, v in self.timings.items()},
        }


def _chunk_size(n_way: int, k_shot: int, queries: int, n_features: int, top_k: int, memory_mb: int) -> int:
    """Episodes per chunk so that selection ([B, S, F] support rows plus [B, n, F] statistics)
    and the gathered, standardised [B, S + Q, Fm] inputs stay within ``memory_mb``."""
    S, Q = n_way * k_shot, n_way * queries
    fm = n_way * min(top_k, n_features)
    per_episode = 4 * n_features * (S + 4 * n_way) + 4 * fm * (2 * S + Q + 5 * n_way)
    return int(max(1, min(64, memory_mb * 2**20 // per_episode)))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Temporarily use ``n`` torch CPU threads (0: unchanged).  The probe's many small ops run
    much faster on one thread than on several when the cores are shared with other work."""
    old = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_probe(
    store: StoreReader,
    cfg: ProbeConfig,
    *,
    features: FeatureMatrix | None = None,
    episodes: EpisodeSet | None = None,
    progress: bool = False,
    run_id: str | None = None,
) -> ProbeOutput:
    """Sample episodes, select features, train and evaluate the probes, attribute predictions."""
    with torch_threads(cfg.threads):
        return _run_probe(store, cfg, features, episodes, progress, run_id)


def _run_probe(
    store: StoreReader,
    cfg: ProbeConfig,
    features: FeatureMatrix | None,
    episodes: EpisodeSet | None,
    progress: bool,
    run_id: str | None,
) -> ProbeOutput:
    started = time.time()
    clock = _Clock()
    fm = features or load_features(
        store,
        cfg.kind,
        rows=Selection.from_sql(store, cfg.where),
        layers=cfg.layers,
        heads=cfg.heads,
        groups=cfg.groups,
        dtype=cfg.feature_dtype,
        progress=progress,
    )
    ep = episodes or sample_seeds(
        fm.labels,
        n_way=cfg.n_way,
        k_shot=cfg.k_shot,
        queries=cfg.queries,
        episodes=cfg.episodes,
        seeds=cfg.seeds,
    )
    n, k, q = ep.n_way, ep.k_shot, ep.queries
    E, Q, R = len(ep), n * q, len(ep.relations)
    U, usize = fm.n_units, fm.unit_size
    unit_layer, unit_head = fm.unit_labels()
    want_tokens = cfg.token_scores != "none" and fm.kind in TOKEN_KINDS
    geo = TokenGeometry.of(store, fm.kind, fm.layers, fm.heads) if want_tokens else None
    ysup = torch.from_numpy(ep.support_labels)
    yq = torch.from_numpy(ep.query_labels)
    acc = np.zeros(E)
    n_sel = np.zeros(E, dtype=np.int64)
    pred_all = np.zeros((E, Q), dtype=np.int64)
    prob_all = np.zeros((E, Q), dtype=np.float32)
    total_all = np.zeros((E, Q), dtype=np.float32)
    hs_sum = torch.zeros((R, U), dtype=torch.float64)
    hs_abs = torch.zeros((R, U), dtype=torch.float64)
    hs_n = torch.zeros(R, dtype=torch.float64)
    hsp_sum, hsp_abs, hsp_n = torch.zeros_like(hs_sum), torch.zeros_like(hs_abs), torch.zeros_like(hs_n)
    pending: list[
        tuple[int, int, torch.Tensor, torch.Tensor]
    ] = []  # (episode, query, p, centering per layer)
    token_rows: list[dict[str, Any]] = []
    weights: list[EpisodeWeights] = []
    pending_limit = max(1, cfg.memory_mb * 2**20 // 2)
    B = _chunk_size(n, k, q, fm.n_features, cfg.top_k if cfg.relspec else fm.n_features, cfg.memory_mb)
    bar = progress_bar(total=E, desc=f"probe {fm.kind} {n}-way {k}-shot", unit="ep", enabled=progress)
    for lo in range(0, E, B):
        hi = min(E, lo + B)
        sup = torch.from_numpy(ep.support[lo:hi])
        qry = torch.from_numpy(ep.query[lo:hi])
        clock.lap("features")
        sel = select_or_all(fm.data[sup].to(torch.float32), n, k, cfg)
        clock.lap("select")
        xs = gather_standardized(fm.data, sup, sel)
        xq = gather_standardized(fm.data, qry, sel)
        clock.lap("gather")
        tb = max(1, cfg.train_batch)
        parts = [
            train_batched(xs[i : i + tb], ysup, n, epochs=cfg.epochs, lr=cfg.lr)
            for i in range(0, hi - lo, tb)
        ]
        W, b = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        del xs, parts
        if cfg.store_weights:
            weights += [_episode_weights(sel, W, b, j) for j in range(hi - lo)]
        clock.lap("train")
        logits = torch.baddbmm(b[:, None, :], xq, W)  # [B, Q, C]
        probs = torch.softmax(logits, -1)
        pred = probs.argmax(-1)
        acc[lo:hi] = (pred == yq).to(torch.float64).mean(1).numpy()
        n_sel[lo:hi] = sel.counts.numpy()
        pred_all[lo:hi] = pred.numpy()
        prob_all[lo:hi] = probs.gather(2, pred[..., None])[..., 0].numpy()
        dW = torch.einsum("bfc,bqc->bqf", W, contrast_coefficients(probs, pred, cfg.contrast))  # [B, Q, Fm]
        units = torch.where(sel.valid, sel.index // usize, torch.full_like(sel.index, U))
        hs = unit_scores(dW * xq, units, U)  # [B, Q, U]
        total_all[lo:hi] = hs.sum(-1).numpy()
        gold = torch.from_numpy(ep.classes[lo:hi][:, ep.query_labels]).reshape(
            -1
        )  # relation index per prediction
        predicted = torch.gather(torch.from_numpy(ep.classes[lo:hi]), 1, pred).reshape(-1)
        hs_flat = hs.reshape(-1, U).to(torch.float64)
        accumulate_head_scores(hs_flat, gold, hs_sum, hs_abs, hs_n)
        accumulate_head_scores(hs_flat, predicted, hsp_sum, hsp_abs, hsp_n)
        clock.lap("headscore")
        if geo is not None:
            pick = (
                (pred != yq[None])
                if cfg.token_scores == "errors"
                else torch.ones_like(pred, dtype=torch.bool)
            )
            where = pick.nonzero()
            for g0 in range(0, where.shape[0], 64):
                e_loc, qi = where[g0 : g0 + 64, 0], where[g0 : g0 + 64, 1]
                u_sel = dW[e_loc, qi] / sel.std[e_loc]  # [g, Fm], zero on padding (W is 0 there)
                cent = unit_scores(
                    (u_sel * (geo.offset[sel.index[e_loc]] - sel.mean[e_loc]))[:, None], units[e_loc], U
                )
                u = torch.zeros((e_loc.numel(), fm.n_features)).scatter_add_(1, sel.index[e_loc], u_sel)
                p = geo.project(u)
                for j in range(e_loc.numel()):
                    pending.append(
                        (lo + int(e_loc[j]), int(qi[j]), p[j], _per_layer(cent[j, 0], len(fm.layers)))
                    )
            if sum(x[2].numel() * 4 for x in pending) > pending_limit:
                token_rows += _flush_tokens(store, geo, pending, fm, ep, pred_all, total_all)
                pending = []
            clock.lap("tokenscore")
        bar.update(hi - lo)
    bar.close()
    if geo is not None and pending:
        token_rows += _flush_tokens(store, geo, pending, fm, ep, pred_all, total_all)
        clock.lap("tokenscore")
    names = {
        r["relation_id"]: r["relation_name"]
        for r in store.sql(
            "SELECT relation_id, any_value(relation_name) AS relation_name FROM examples GROUP BY 1"
        ).to_pylist()
    }
    return ProbeOutput(
        run_id=run_id or new_run_id("probe"),
        config=cfg,
        episodes=ep,
        example_ids=fm.example_ids,
        labels=fm.labels,
        relation_names=names,
        unit_layer=unit_layer,
        unit_head=unit_head,
        episode_accuracy=acc,
        n_selected=n_sel,
        pred=pred_all,
        prob=prob_all,
        head_total=total_all,
        hs_sum=hs_sum.numpy(),
        hs_abs=hs_abs.numpy(),
        hs_n=hs_n.numpy(),
        hsp_sum=hsp_sum.numpy(),
        hsp_abs=hsp_abs.numpy(),
        hsp_n=hsp_n.numpy(),
        token_rows=token_rows,
        weights=weights,
        seconds=time.time() - started,
        started=started,
        timings=clock.laps,
    )


def _episode_weights(sel: Selected, W: torch.Tensor, b: torch.Tensor, j: int) -> EpisodeWeights:
    """Episode ``j`` of a chunk: its selected features (padding dropped) and trained probe."""
    m = sel.valid[j]
    return EpisodeWeights(
        sel.index[j][m].to(torch.int32).numpy(),
        sel.mean[j][m].numpy(),
        sel.std[j][m].numpy(),
        W[j][m].numpy(),
        b[j].clone().numpy(),
    )


def accumulate_head_scores(
    hs: torch.Tensor, relation: torch.Tensor, sums: torch.Tensor, abs_sums: torch.Tensor, counts: torch.Tensor
) -> None:
    """Add each prediction's head scores ``hs`` [P, U] (and their magnitudes) to the row of its ``relation``
    [P] (an index into the run's relations: the gold one, or the predicted one)."""
    sums.index_add_(0, relation, hs)
    abs_sums.index_add_(0, relation, hs.abs())
    counts.index_add_(0, relation, torch.ones(relation.numel(), dtype=counts.dtype))


def all_features(xs: torch.Tensor) -> Selected:
    """The no-RelSpec baseline: every feature of support sets ``xs`` [B, S, F], with the support mean
    and population standard deviation (1 where constant) that RelSpec's standardisation uses."""
    B, _, F = xs.shape
    mean = xs.mean(1)
    std = (xs - mean[:, None]).square().mean(1).sqrt()
    std = torch.where(std > 0, std, torch.ones_like(std))
    index = torch.arange(F).expand(B, F).contiguous()
    return Selected(index, torch.ones((B, F), dtype=torch.bool), mean, std)


def select_or_all(xs: torch.Tensor, n_way: int, k_shot: int, cfg: ProbeConfig) -> Selected:
    """RelSpec's features for each support set, or every feature with ``relspec=False``."""
    return select_features(xs, n_way, k_shot, cfg.top_k) if cfg.relspec else all_features(xs)


class _Clock:
    """Wall seconds per phase (features, select, gather, train, headscore, tokenscore)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


def _per_layer(unit_values: torch.Tensor, n_layers: int) -> torch.Tensor:
    return unit_values.reshape(n_layers, -1).sum(1)


def _flush_tokens(
    store: StoreReader,
    geo: TokenGeometry,
    pending: list[tuple[int, int, torch.Tensor, torch.Tensor]],
    fm: FeatureMatrix,
    ep: EpisodeSet,
    pred: np.ndarray,
    total: np.ndarray,
) -> list[dict[str, Any]]:
    ids = [int(fm.example_ids[ep.query[e, qi]]) for e, qi, _, _ in pending]
    scores = token_scores(store, geo, ids, torch.stack([x[2] for x in pending]))
    rows = []
    for (e, qi, _, cent), ex, ts in zip(pending, ids, scores):
        rel = ep.relations
        rows.append(
            {
                "seed": int(ep.seed[e]),
                "episode": int(ep.index[e]),
                "example_id": ex,
                "relation_id": rel[ep.classes[e, ep.query_labels[qi]]],
                "predicted": rel[ep.classes[e, pred[e, qi]]],
                "scores": ts.sum(0).astype(np.float32).tolist(),
                "centering": float(cent.sum()),
                "head_score_total": float(total[e, qi]),
            }
        )
    return rows


# ----------------------------------------------------------------------------------- reference
def run_reference(
    fm: FeatureMatrix, ep: EpisodeSet, cfg: ProbeConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One episode at a time with :func:`train_reference`: (accuracy [E], predictions [E, Q],
    probabilities [E, Q, C])."""
    ysup = torch.from_numpy(ep.support_labels)
    yq = torch.from_numpy(ep.query_labels)
    accs, preds, probs = [], [], []
    for e in range(len(ep)):
        sup = torch.from_numpy(ep.support[e : e + 1])
        sel = select_or_all(fm.data[sup].to(torch.float32), ep.n_way, ep.k_shot, cfg)
        xs = gather_standardized(fm.data, sup, sel)[0]
        xq = gather_standardized(fm.data, torch.from_numpy(ep.query[e : e + 1]), sel)[0]
        W, b = train_reference(xs, ysup, ep.n_way, epochs=cfg.epochs, lr=cfg.lr)
        p = torch.softmax(xq @ W + b, -1)
        preds.append(p.argmax(-1).numpy())
        probs.append(p.numpy())
        accs.append(float((p.argmax(-1) == yq).to(torch.float64).mean()))
    return np.asarray(accs), np.stack(preds), np.stack(probs)
