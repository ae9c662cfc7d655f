"""Feature kinds computed from the stored factors (SPEC sections 1 and 4).

For n selected target rows (float32 accumulation throughout):

    z               [n, L, H, d_head]        stored
    attn_head       [n, L, H, d_model]       Delta_att,h(t) = z_h(t) W_O,h
    attn            [n, L, d_model]          sum_h Delta_att,h(t) + b_O  (the attention block output)
    attn_head_token [n, L, H, S, d_model]    Delta_att,h(t,j) = A_h(t,j) V_kv(h)(j) W_O,h, zero-padded to S sources
    attn_entity     [n, L, H, d_model]       sum over the subject's source tokens j of Delta_att,h(t,j)
    attn_prob       [n, L, H, S]             A_h(t,j), zero-padded
    mlp             [n, L, d_model]          a(t) W_down + b_down
    mlp_group       [n, L, G, d_model]       Delta_MLP,g(t) = a[block g](t) W_down[block g]  (G contiguous blocks,
                                             G = heads by default; sizes differ by at most one)
    resid           [n, L+1, d_model]        index 0 = embeddings, l+1 = after layer l (before any final norm)

``layers`` keeps only those layers (for ``resid``: those residual indices); ``heads`` keeps
only those heads (for ``mlp_group``: those groups).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from actstore.errors import QueryError

if TYPE_CHECKING:
    from actstore.store import Store

KINDS = ("z", "attn_head", "attn", "attn_head_token", "attn_entity", "attn_prob", "mlp", "mlp_group", "resid")
HEAD_KINDS = ("z", "attn_head", "attn_head_token", "attn_entity", "attn_prob", "mlp_group")


@dataclass(frozen=True)
class RowBlock:
    """Target rows of one segment, in store order, with what ragged reads need."""

    segment: int
    seg_rows: np.ndarray  # [n] rows within the segment
    src_start: np.ndarray  # [n] offset of source 0 in the segment's flat axis
    n_src: np.ndarray  # [n]
    subject_start: np.ndarray  # [n] token positions, -1 when absent
    subject_end: np.ndarray


@dataclass(frozen=True)
class FeatureSpec:
    kind: str
    layers: tuple[int, ...]
    heads: tuple[int, ...] | None
    groups: int | None = None

    @classmethod
    def parse(cls, store: Store, kind: str, layers: Sequence[int] | None, heads: Sequence[int] | None,
              groups: int | None = None) -> FeatureSpec:
        g = store.geometry
        if kind not in KINDS:
            raise QueryError(f"unknown feature kind {kind!r} (one of {', '.join(KINDS)})")
        n_layer_slots = g.n_layers + 1 if kind == "resid" else g.n_layers
        ls = tuple(range(n_layer_slots)) if layers is None else tuple(int(x) for x in layers)
        bad = [x for x in ls if not 0 <= x < n_layer_slots]
        if bad or not ls:
            raise QueryError(f"layer {bad[0] if bad else '(none)'} out of range for {kind}: valid 0..{n_layer_slots - 1}")
        if heads is not None:
            if kind not in HEAD_KINDS:
                raise QueryError(f"--heads does not apply to feature kind {kind!r}")
            n_h = (groups or g.n_heads) if kind == "mlp_group" else g.n_heads
            hs = tuple(int(x) for x in heads)
            badh = [x for x in hs if not 0 <= x < n_h]
            if badh or not hs:
                raise QueryError(f"head {badh[0] if badh else '(none)'} out of range: valid 0..{n_h - 1}")
            heads = hs
        if kind == "mlp_group":
            G = groups or g.n_heads
            if not 1 <= G <= g.d_mlp:
                raise QueryError(f"--groups must be between 1 and d_mlp={g.d_mlp}, not {G}")
        return cls(kind, ls, None if heads is None else tuple(heads), groups)


def group_bounds(d_mlp: int, groups: int) -> list[int]:
    """Boundaries of ``groups`` contiguous neuron blocks whose sizes differ by at most one.

    Our definition (SPEC section 1): block g holds neurons [bounds[g], bounds[g+1]); when
    ``d_mlp`` divides evenly these are equal blocks, otherwise the first ``d_mlp % groups``
    blocks hold one neuron more (SmolLM2: 1536 neurons in 9 groups of 171 or 170).
    """
    base, extra = divmod(d_mlp, groups)
    bounds = [0]
    for g in range(groups):
        bounds.append(bounds[-1] + base + (1 if g < extra else 0))
    return bounds


class WeightCache:
    """Weights as float32 torch tensors, loaded once per store (weights never change once written)."""

    def __init__(self, store: Store) -> None:
        self._store = weakref.ref(store)  # the cache must not keep its store alive (see _CACHES)
        self._w: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._w:
            store = self._store()
            if store is None:
                raise QueryError("the store of this weight cache was closed")
            self._w[name] = torch.from_numpy(store.weight(name))
        return self._w[name]


_CACHES: weakref.WeakKeyDictionary[Store, WeightCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def weights(store: Store) -> WeightCache:
    """The weight cache of ``store``, made on first use and dropped with the store."""
    with _CACHES_LOCK:
        cache = _CACHES.get(store)
        if cache is None:
            cache = _CACHES[store] = WeightCache(store)
        return cache


def _pick(x: Any, idx: list[int], dim: int) -> Any:
    """``x`` restricted to positions ``idx`` along ``dim`` (numpy or torch).

    A contiguous ascending ``idx`` (all layers, a layer range) is a slice, i.e. a view; fancy
    indexing would copy, e.g. all of ``W_down`` (106 MB for SmolLM2) for every row block.
    """
    pre = (slice(None),) * dim
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return x[(*pre, slice(idx[0], idx[0] + len(idx)))]
    return x[(*pre, idx)]


def compute_block(store: Store, spec: FeatureSpec, block: RowBlock) -> np.ndarray:
    """Features of one segment's rows."""
    g = store.geometry
    W = weights(store)
    L = list(spec.layers)
    Hs = list(spec.heads) if spec.heads is not None else list(range(g.n_heads))
    seg, rows = block.segment, block.seg_rows
    kind = spec.kind
    if kind == "resid":
        return _pick(store.read_segment_rows(seg, "resid", rows), L, 1)
    if kind in ("mlp", "mlp_group"):
        a = torch.from_numpy(_pick(store.read_segment_rows(seg, "mlp", rows), L, 1))  # [n, l, d_mlp]
        Wd = _pick(W["W_down"], L, 0)  # [l, d_mlp, d]
        if kind == "mlp":
            return (torch.einsum("nlf,lfd->nld", a, Wd) + _pick(W["b_down"], L, 0)).numpy()
        G = spec.groups or g.n_heads
        keep = list(spec.heads) if spec.heads is not None else list(range(G))
        bounds = group_bounds(g.d_mlp, G)
        out = torch.empty((a.shape[0], len(L), len(keep), g.d_model))
        for i, grp in enumerate(keep):
            lo, hi = bounds[grp], bounds[grp + 1]
            out[:, :, i] = torch.einsum("nlf,lfd->nld", a[:, :, lo:hi], Wd[:, lo:hi])
        return out.numpy()
    if kind in ("z", "attn_head", "attn"):
        z = torch.from_numpy(_pick(store.read_segment_rows(seg, "z", rows), L, 1))  # [n, l, H, dh]
        if kind == "z":
            return _pick(z, Hs, 2).numpy()
        WO = _pick(W["W_O"], L, 0)  # [l, H, dh, d]
        if kind == "attn":
            zf = z.reshape(z.shape[0], len(L), -1)
            return (torch.einsum("nlk,lkd->nld", zf, WO.reshape(len(L), -1, g.d_model)) + _pick(W["b_O"], L, 0)).numpy()
        return torch.einsum("nlhk,lhkd->nlhd", _pick(z, Hs, 2), _pick(WO, Hs, 1)).numpy()
    # Kinds that need the per-source factors A and V.
    if kind == "attn_entity":
        has = block.subject_start >= 0
        starts = block.src_start + np.where(has, block.subject_start, 0)
        lengths = np.where(has, block.subject_end - block.subject_start, 0)
    else:
        starts, lengths = block.src_start, block.n_src
    A = torch.from_numpy(_pick(_pick(store.read_segment_ranges(seg, "attn", starts, lengths), L, 1), Hs, 2))  # [N, l, h]
    kv = torch.tensor([h // g.kv_group for h in Hs])
    V = torch.from_numpy(_pick(store.read_segment_ranges(seg, "v", starts, lengths), L, 1))[:, :, kv]  # [N, l, h, dh]
    n = len(rows)
    owner = torch.repeat_interleave(torch.arange(n), torch.as_tensor(lengths, dtype=torch.long))
    if kind == "attn_entity":
        ze = torch.zeros((n, len(L), len(Hs), g.d_head))
        ze.index_add_(0, owner, A[..., None] * V)  # z restricted to the subject's sources
        return torch.einsum("nlhk,lhkd->nlhd", ze, _pick(_pick(W["W_O"], L, 0), Hs, 1)).numpy()
    S = int(lengths.max()) if n else 0
    local = torch.arange(A.shape[0]) - torch.repeat_interleave(
        torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)[:-1]]) if n else np.zeros(0), dtype=torch.long),
        torch.as_tensor(lengths, dtype=torch.long),
    )
    if kind == "attn_prob":
        out = torch.zeros((n, len(L), len(Hs), S))
        out[owner, :, :, local] = A
        return out.numpy()
    contrib = torch.einsum("slhk,lhkd->slhd", A[..., None] * V, _pick(_pick(W["W_O"], L, 0), Hs, 1))  # [N, l, h, d]
    out = torch.zeros((n, len(L), len(Hs), S, g.d_model))
    out[owner, :, :, local] = contrib
    return out.numpy()
