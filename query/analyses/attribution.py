"""HeadScore and TokenScore for probe predictions ("Tracing Relational Knowledge Recall", ACL 2026 Findings).

For a prediction c_hat with softmax pi over the episode's classes, the contrast direction is one of
two readings of Tracing Relational Knowledge Recall in Large Language Models, arXiv 2604.19934 (``contrast``, recorded with every run):

    renormalised (default, ours):  dW = W[:, c_hat] - sum_{c != c_hat} pi'_c W[:, c],   pi' = pi renormalised over c != c_hat
    seed (the formula as written): dW = W[:, c_hat] - sum_{c != c_hat} pi_c  W[:, c]

They differ by the factor 1 - pi_c_hat on the competitor term: the paper's reading weighs the competitors
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

This module is the math (and the lookup of a stored probe run); re-deriving one stored prediction,
which re-trains its episode's probe, is :mod:`actstore.query.analyses.explain`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.query.analyses.probe_config import CONTRASTS, DEFAULT_CONTRAST
from actstore.query.select.selection import Selection
from actstore.query.select.weights import weights

TOKEN_KINDS = ("attn_head", "attn_entity", "attn")


def check_contrast(reading: str) -> str:
    if reading not in CONTRASTS:
        raise QueryError(f"contrast must be one of {', '.join(CONTRASTS)}, not {reading!r}")
    return reading


def contrast_coefficients(
    probs: torch.Tensor, pred: torch.Tensor, reading: str = DEFAULT_CONTRAST
) -> torch.Tensor:
    """Per prediction ([..., C]), dW = W @ coef: ``onehot(c_hat) - pi'`` (``"renormalised"``, pi' the
    softmax renormalised over the competitors) or ``onehot(c_hat) - pi * (1 - onehot)`` (``"seed"``,
    the full softmax as arXiv 2604.19934 writes it)."""
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
    def of(
        cls, store: StoreReader, kind: str, layers: Sequence[int], heads: Sequence[int] | None
    ) -> TokenGeometry:
        if kind not in TOKEN_KINDS:
            raise QueryError(
                f"TokenScore needs per-source attention features ({', '.join(TOKEN_KINDS)}), not {kind!r}"
            )

        hs = tuple(range(store.geometry.n_heads)) if heads is None or kind == "attn" else tuple(heads)
        ls = list(layers)
        WO = weights(store).layers("W_O", ls)
        if hs != tuple(range(store.geometry.n_heads)):
            WO = WO[:, list(hs)].contiguous()
        if kind == "attn":
            offset = weights(store).layers("b_O", ls).reshape(-1)
        else:
            offset = torch.zeros(len(ls) * len(hs) * store.geometry.d_model)
        return cls(kind, tuple(ls), hs, WO, offset)

    def project(self, u: torch.Tensor) -> torch.Tensor:
        """Raw-space directions ``u`` [n, F] -> p [n, L', H', d_head] (p_{l,h} = W_O,h u_{l,h})."""
        n, d = u.shape[0], self.W_O.shape[-1]
        if self.kind == "attn":
            return torch.einsum("nld,lhkd->nlhk", u.view(n, len(self.layers), d), self.W_O)
        return torch.einsum("nlhd,lhkd->nlhk", u.view(n, len(self.layers), len(self.heads), d), self.W_O)


def token_scores(
    store: StoreReader,
    geo: TokenGeometry,
    example_ids: Sequence[int],
    p: torch.Tensor,
    *,
    group: int = 128,
    select: Callable[[list[int]], Any] | None = None,
) -> list[np.ndarray]:
    """TokenScore [L', n_src] for each (example, projected direction) pair, from stored A and V.

    ``example_ids`` may repeat (one entry per prediction); factors are read once per group of
    distinct examples, segment by segment.  ``select``: makes the Selection of given ids (default
    :meth:`Selection.from_ids`)."""
    if select is None:
        select = functools.partial(Selection.from_ids, store)

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
        sel = select(uniq[i : i + group].tolist())
        found = set(sel.example_ids.tolist())
        missing = sorted(set(uniq[i : i + group].tolist()) - found)
        if missing:
            raise QueryError(f"example {missing[0]} is not in the store")
        for block_ids, block in sel.blocks():
            A = torch.from_numpy(
                store.read_segment_ranges(block.segment, "attn", block.src_start, block.n_src)[:, L][
                    :, :, list(geo.heads)
                ]
            )  # [N, l, h]
            V = torch.from_numpy(
                store.read_segment_ranges(block.segment, "v", block.src_start, block.n_src)[:, L]
            )[:, :, kv]  # [N, l, h, dh]
            offs = np.concatenate([[0], np.cumsum(block.n_src)])
            for r, ex in enumerate(block_ids.tolist()):
                a, v = A[offs[r] : offs[r + 1]], V[offs[r] : offs[r + 1]]
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


def run_row(store: StoreReader, run_id: str) -> dict[str, object]:
    """The ``probe_runs`` row of ``run_id``; one clear error when there is none."""
    if "probe_runs" not in store.table_files():
        raise QueryError(f"{store.url} holds no probe runs (run `actstore probe` first)")
    rows = store.sql("SELECT * FROM probe_runs WHERE run_id = ?", [run_id]).to_pylist()
    if not rows:
        known = [r["run_id"] for r in store.sql("SELECT run_id FROM probe_runs ORDER BY started").to_pylist()]
        raise QueryError(
            f"unknown probe run {run_id!r} in {store.url} (known: {', '.join(known[-5:]) or 'none'})"
        )
    return dict(rows[0])
