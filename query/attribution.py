"""HeadScore and TokenScore for probe predictions (SPEC section 5, seed 000).

For a prediction c_hat with softmax pi over the episode's classes, the contrast direction is one of
two readings of the seed (``contrast``, recorded with every run):

    renormalised (default, ours):  dW = W[:, c_hat] - sum_{c != c_hat} pi'_c W[:, c],   pi' = pi renormalised over c != c_hat
    seed (the formula as written): dW = W[:, c_hat] - sum_{c != c_hat} pi_c  W[:, c]

They differ by the factor 1 - pi_c_hat on the competitor term: the seed's reading weighs the competitors
less the more confident the prediction (dW -> W[:, c_hat] as pi_c_hat -> 1, so a confident prediction's
HeadScore includes what raises every class's logit alike); ours keeps "the predicted class minus the
expected competitor" at every confidence.  With x' the probe's (standardised) input features,

    HeadScore_{l,h} = sum_{m in unit (l,h)} dW_m x'_m

where a *unit* is a head for per-head kinds (``attn_head``, ``attn_entity``, ``z``), a neuron
group for ``mlp_group`` (reported as ``head``) and a whole layer (``head = -1``) for ``attn``,
``mlp`` and ``resid``.  The head scores of a prediction sum to dW . x'.

TokenScore (kinds ``attn_head``, ``attn_entity``, ``attn``): standardisation makes
x'_m = (x_m - mu_m) / sd_m, so with u = dW / sd (the direction in raw feature space)

    dW . x' = sum_m u_m x_m - sum_m u_m mu_m.

Since x = sum_j Delta_att,h(t, j) (+ b_O for ``attn``), per layer l

    TokenScore_l(j) = sum_h A_h(t,j) * V_kv(h)(j) . p_{l,h},    p_{l,h} = W_O,h u_{l,h}   (d_head numbers)
    centering_l     = sum_{m in l} u_m (b_m - mu_m)              (b = b_O for ``attn``, else 0)
    sum_j TokenScore_l(j) + centering_l = sum_h HeadScore_{l,h}

exactly up to float rounding when the store holds float32 factors (with float16 storage the
stored z and the sum of the stored A V differ by storage rounding; that residual is reported).
Only the projected directions p ([L, H, d_head]) and the stored A, V are used: no per-token
d_model vector is ever materialised.  For ``attn_entity`` only the subject's tokens score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from actstore.errors import QueryError
from actstore.store import Store

if TYPE_CHECKING:
    from query.probe import ProbeConfig

TOKEN_KINDS = ("attn_head", "attn_entity", "attn")
CONTRASTS = ("renormalised", "seed")
DEFAULT_CONTRAST = "renormalised"


def check_contrast(reading: str) -> str:
    if reading not in CONTRASTS:
        raise QueryError(f"contrast must be one of {', '.join(CONTRASTS)}, not {reading!r}")
    return reading


def contrast_coefficients(probs: torch.Tensor, pred: torch.Tensor, reading: str = DEFAULT_CONTRAST) -> torch.Tensor:
    """Per prediction ([..., C]), dW = W @ coef: ``onehot(c_hat) - pi'`` (``"renormalised"``, pi' the
    softmax renormalised over the competitors) or ``onehot(c_hat) - pi * (1 - onehot)`` (``"seed"``,
    the full softmax as the seed writes it)."""
    check_contrast(reading)
    onehot = torch.nn.functional.one_hot(pred, probs.shape[-1]).to(probs.dtype)
    comp = probs * (1 - onehot)
    if reading == "seed":
        return onehot - comp
    denom = comp.sum(-1, keepdim=True)
    comp = torch.where(denom > 0, comp / denom.clamp_min(1e-30), torch.zeros_like(comp))
    return onehot - comp


def unit_scores(contrib: torch.Tensor, units: torch.Tensor, n_units: int) -> torch.Tensor:
    """Sum ``contrib`` [B, Q, Fm] into units: ``units`` [B, Fm] holds each selected feature's unit
    (``n_units`` for padding, dropped).  Returns [B, Q, n_units]."""
    B, Q, _ = contrib.shape
    out = torch.zeros((B, Q, n_units + 1), dtype=contrib.dtype)
    out.scatter_add_(2, units[:, None, :].expand_as(contrib), contrib)
    return out[..., :n_units]


@dataclass(frozen=True)
class TokenGeometry:
    """What TokenScore needs to know about a probe's feature kind (W_O loaded once)."""

    kind: str
    layers: tuple[int, ...]
    heads: tuple[int, ...]  # heads whose contributions the features hold (all heads for ``attn``)
    W_O: torch.Tensor  # [L', H', d_head, d_model]
    offset: torch.Tensor  # [F] constant part of each raw feature (b_O for ``attn``, else 0)

    @classmethod
    def of(cls, store: Store, kind: str, layers: Sequence[int], heads: Sequence[int] | None) -> TokenGeometry:
        if kind not in TOKEN_KINDS:
            raise QueryError(f"TokenScore needs per-source attention features ({', '.join(TOKEN_KINDS)}), "
                             f"not {kind!r}")
        hs = tuple(range(store.geometry.n_heads)) if heads is None or kind == "attn" else tuple(heads)
        ls = list(layers)
        WO = torch.from_numpy(store.weight("W_O"))[ls][:, list(hs)].contiguous()
        if kind == "attn":
            offset = torch.from_numpy(store.weight("b_O")[ls].reshape(-1))
        else:
            offset = torch.zeros(len(ls) * len(hs) * store.geometry.d_model)
        return cls(kind, tuple(ls), hs, WO, offset)

    def project(self, u: torch.Tensor) -> torch.Tensor:
        """Raw-space directions ``u`` [n, F] -> p [n, L', H', d_head] (p_{l,h} = W_O,h u_{l,h})."""
        n, d = u.shape[0], self.W_O.shape[-1]
        if self.kind == "attn":
            return torch.einsum("nld,lhkd->nlhk", u.view(n, len(self.layers), d), self.W_O)
        return torch.einsum("nlhd,lhkd->nlhk", u.view(n, len(self.layers), len(self.heads), d), self.W_O)


def token_scores(store: Store, geo: TokenGeometry, example_ids: Sequence[int], p: torch.Tensor,
                 *, group: int = 128) -> list[np.ndarray]:
    """TokenScore [L', n_src] for each (example, projected direction) pair, from stored A and V.

    ``example_ids`` may repeat (one entry per prediction); factors are read once per group of
    distinct examples, segment by segment."""
    from query.selection import Selection

    g = store.geometry
    ids = np.asarray(example_ids, dtype=np.int64)
    out: list[np.ndarray | None] = [None] * len(ids)
    uniq = np.unique(ids)
    where: dict[int, list[int]] = {}
    for j, ex in enumerate(ids.tolist()):
        where.setdefault(ex, []).append(j)
    L = list(geo.layers)
    kv = torch.tensor([h // g.kv_group for h in geo.heads])
    for i in range(0, uniq.size, group):
        sel = Selection.from_ids(store, uniq[i:i + group].tolist())
        found = set(sel.example_ids.tolist())
        missing = sorted(set(uniq[i:i + group].tolist()) - found)
        if missing:
            raise QueryError(f"example {missing[0]} is not in the store")
        for block_ids, block in sel.blocks():
            A = torch.from_numpy(store.read_segment_ranges(block.segment, "attn", block.src_start, block.n_src)
                                 [:, L][:, :, list(geo.heads)])  # [N, l, h]
            V = torch.from_numpy(store.read_segment_ranges(block.segment, "v", block.src_start, block.n_src)
                                 [:, L])[:, :, kv]  # [N, l, h, dh]
            offs = np.concatenate([[0], np.cumsum(block.n_src)])
            for r, ex in enumerate(block_ids.tolist()):
                a, v = A[offs[r]:offs[r + 1]], V[offs[r]:offs[r + 1]]
                if geo.kind == "attn_entity":
                    keep = torch.zeros(a.shape[0], dtype=a.dtype)
                    s0, s1 = int(block.subject_start[r]), int(block.subject_end[r])
                    if s0 >= 0:
                        keep[s0:s1] = 1
                    a = a * keep[:, None, None]
                for j in where[ex]:
                    ts = torch.einsum("slh,slhk,lhk->ls", a, v, p[j])
                    out[j] = ts.numpy()
    assert all(x is not None for x in out)
    return [x for x in out if x is not None]


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

    def layer_table(self) -> list[dict[str, float | int]]:
        """Per layer: the head-score sum, the token-score sum, the centering term and the residual
        head_score_sum - (token_score_sum + centering)."""
        rows: list[dict[str, float | int]] = []
        for i, layer in enumerate(self.layers):
            hs = float(self.head_scores[self.unit_layer == layer].sum())
            ts = float(self.token_scores[i].sum())
            c = float(self.centering[i])
            rows.append({"layer": int(layer), "head_score_sum": hs, "token_score_sum": ts, "centering": c,
                         "residual": hs - ts - c})
        return rows


def explain_example(store: Store, run_id: str, example_id: int, *, seed: int | None = None,
                    episode: int | None = None, contrast: str | None = None) -> Explanation:
    """Re-train the episode of run ``run_id`` in which ``example_id`` is a query (the first one,
    or the given seed/episode; the stored episode lists make this exact) and attribute its
    prediction.  ``contrast``: the reading of dW (default: the run's own)."""
    from dataclasses import replace

    from query.probe import ProbeConfig, torch_threads

    cfg = ProbeConfig.from_json(str(run_row(store, run_id)["config"]))
    if contrast is not None:
        cfg = replace(cfg, contrast=check_contrast(contrast))
    with torch_threads(cfg.threads):
        return _explain(store, run_id, cfg, example_id, seed, episode)


def _explain(store: Store, run_id: str, cfg: ProbeConfig, example_id: int, seed: int | None,
             episode: int | None) -> Explanation:
    from query.probe import load_features, select_or_all, train_batched
    from query.relspec import gather_standardized

    if cfg.kind not in TOKEN_KINDS:
        raise QueryError(f"TokenScore needs per-source attention features ({', '.join(TOKEN_KINDS)}); "
                         f"run {run_id} probed {cfg.kind!r}")
    cond = f"run_id = '{sql_quote(run_id)}' AND list_contains(query_ids, {int(example_id)})"
    if seed is not None:
        cond += f" AND seed = {int(seed)}"
    if episode is not None:
        cond += f" AND episode = {int(episode)}"
    eps = store.sql(f"SELECT seed, episode, relations, support_ids, query_ids FROM probe_episodes WHERE {cond} "
                    "ORDER BY seed, episode LIMIT 1").to_pylist()
    if not eps:
        raise QueryError(f"example {example_id} is not a query of any episode of run {run_id}"
                         + ("" if seed is None and episode is None else " with that seed/episode"))
    e = eps[0]
    n, sup_ids, q_ids = len(e["relations"]), list(e["support_ids"]), list(e["query_ids"])
    k, q = len(sup_ids) // n, len(q_ids) // n
    fm = load_features(store, cfg.kind, example_ids=sup_ids + q_ids, layers=cfg.layers, heads=cfg.heads,
                       groups=cfg.groups, dtype=cfg.feature_dtype)
    pos = {int(x): i for i, x in enumerate(fm.example_ids.tolist())}
    sup = torch.tensor([[pos[x] for x in sup_ids]])
    qry = torch.tensor([[pos[x] for x in q_ids]])
    geo = TokenGeometry.of(store, cfg.kind, fm.layers, fm.heads)
    sel = select_or_all(fm.data[sup].to(torch.float32), n, k, cfg)
    xs = gather_standardized(fm.data, sup, sel)
    xq = gather_standardized(fm.data, qry, sel)
    W, b = train_batched(xs, torch.arange(n).repeat_interleave(k), n, epochs=cfg.epochs, lr=cfg.lr)
    qi = q_ids.index(int(example_id))
    probs = torch.softmax(xq[0, qi] @ W[0] + b[0], -1)
    pred = probs.argmax()
    dW = W[0] @ contrast_coefficients(probs, pred, cfg.contrast)  # [Fm]
    U, usize = fm.n_units, fm.unit_size
    units = torch.where(sel.valid[0], sel.index[0] // usize, torch.full_like(sel.index[0], U))
    hs = unit_scores((dW * xq[0, qi])[None, None], units[None], U)[0, 0]
    u_sel = dW / sel.std[0]
    cent = unit_scores((u_sel * (geo.offset[sel.index[0]] - sel.mean[0]))[None, None], units[None], U)[0, 0]
    u = torch.zeros(fm.n_features).scatter_add_(0, sel.index[0], u_sel)
    ts = token_scores(store, geo, [int(example_id)], geo.project(u[None]))[0]
    toks = store.sql(f"SELECT token FROM tokens WHERE example_id = {int(example_id)} ORDER BY position")
    layer, head = fm.unit_labels()
    return Explanation(run_id, int(e["seed"]), int(e["episode"]), int(example_id), e["relations"][qi // q],
                       e["relations"][int(pred)], float(probs[pred]), fm.layers, layer, head, hs.numpy(), ts,
                       cent.reshape(len(fm.layers), -1).sum(1).numpy(),
                       toks.column("token").to_pylist()[:ts.shape[1]], cfg.contrast)


def sql_quote(text: str) -> str:
    """Quote for a SQL string literal."""
    return text.replace("'", "''")


def run_row(store: Store, run_id: str) -> dict[str, object]:
    """The ``probe_runs`` row of ``run_id``; one clear error when there is none."""
    if "probe_runs" not in store.table_files():
        raise QueryError(f"{store.url} holds no probe runs (run `actstore probe` first)")
    rows = store.sql(f"SELECT * FROM probe_runs WHERE run_id = '{sql_quote(run_id)}'").to_pylist()
    if not rows:
        known = [r["run_id"] for r in store.sql("SELECT run_id FROM probe_runs ORDER BY started").to_pylist()]
        raise QueryError(f"unknown probe run {run_id!r} in {store.url} (known: {', '.join(known[-5:]) or 'none'})")
    return dict(rows[0])
