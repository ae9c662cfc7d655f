"""Feature kinds computed from the stored factors.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from actstore.core.errors import InvalidQuerySetting, InvalidSetting, QueryError
from actstore.query.select.corpus_sources import contributions, corpus_sources, source_factors
from actstore.query.select.weights import pick, weights

if TYPE_CHECKING:
    from actstore.core.store import StoreReader

KINDS = ("z", "attn_head", "attn", "attn_head_token", "attn_entity", "attn_prob", "mlp", "mlp_group", "resid")
SOURCE_KINDS = ("attn_head_token", "attn_prob")  # kinds with a (zero-padded) source axis
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
    def parse(
        cls,
        store: StoreReader,
        kind: str,
        layers: Sequence[int] | None,
        heads: Sequence[int] | None,
        groups: int | None = None,
    ) -> FeatureSpec:
        g = store.geometry
        if kind not in KINDS:
            raise InvalidQuerySetting("kind", f"unknown feature kind {kind!r} (one of {', '.join(KINDS)})")
        n_layer_slots = g.n_layers + 1 if kind == "resid" else g.n_layers
        ls = tuple(range(n_layer_slots)) if layers is None else tuple(int(x) for x in layers)
        bad = [x for x in ls if not 0 <= x < n_layer_slots]
        if not ls:
            raise InvalidQuerySetting("layers", f"no layers given (valid 0..{n_layer_slots - 1} for {kind})")
        if bad:
            raise InvalidQuerySetting(
                "layers", f"layer {bad[0]} out of range for {kind}: valid 0..{n_layer_slots - 1}"
            )
        check_corpus_kind(store, kind, ls)
        if heads is not None:
            if kind not in HEAD_KINDS:
                raise InvalidSetting("heads", f"does not apply to feature kind {kind!r}")
            n_h = (groups or g.n_heads) if kind == "mlp_group" else g.n_heads
            hs = tuple(int(x) for x in heads)
            badh = [x for x in hs if not 0 <= x < n_h]
            if badh or not hs:
                raise QueryError(f"head {badh[0] if badh else '(none)'} out of range: valid 0..{n_h - 1}")
            heads = hs
        if kind == "mlp_group":
            G = groups or g.n_heads
            if not 1 <= G <= g.d_mlp:
                raise InvalidSetting("groups", f"must be between 1 and d_mlp={g.d_mlp}, not {G}")
        return cls(kind, ls, None if heads is None else tuple(heads), groups)


# The stored array each kind is computed from in a corpus store (``--positions all``); the kinds
# that need the per-source factors (attention rows, values) are target-mode only.
CORPUS_ARRAY = {"z": "z", "attn_head": "z", "attn": "z", "mlp": "mlp", "mlp_group": "mlp", "resid": "resid"}


def check_corpus_kind(store: StoreReader, kind: str, layers: Sequence[int]) -> None:
    """In a corpus store, refuse (one line) a kind or layer its ingest did not keep: what was not kept
    is stored as zero chunks, which must never be read as activations."""
    ingest = store.manifest.ingest
    if ingest.get("positions") != "all":
        return
    kept = ingest.get("kept") or {}
    array = CORPUS_ARRAY.get(kind)
    if kind in SOURCE_KINDS and ingest.get("sources"):  # --sources K: top-K sources at the z layers
        array = "z"
    if kind == "attn_entity":  # a corpus marks no subject span: the caller names the source rows
        raise QueryError(
            "attn_entity sums over a prompt's subject tokens, which a corpus store does not mark; "
            "on a store ingested with --sources K, source_sum(store, rows, sources) sums the kept "
            "sources' contributions over the rows you name (actstore.query.select.corpus_sources)"
        )
    if array is None:
        raise QueryError(
            f"{kind} needs the per-source factors, which this corpus store (--positions all) does not keep; "
            "ingest it with --sources K (or all) for them"
        )
    have = kept.get(array) or []
    missing = [x for x in layers if x not in have]
    if missing:
        what = "residual index" if array == "resid" else "layer"
        raise QueryError(
            f"{kind}: {what} {missing[0]} was not kept by this corpus store's ingest (kept "
            f"{array}: {', '.join(map(str, have)) or 'none'}; --kinds and --layers choose what is kept)"
        )


def group_bounds(d_mlp: int, groups: int) -> list[int]:
    """Boundaries of ``groups`` contiguous neuron blocks whose sizes differ by at most one.

    Our definition: block g holds neurons [bounds[g], bounds[g+1]); when
    ``d_mlp`` divides evenly these are equal blocks, otherwise the first ``d_mlp % groups``
    blocks hold one neuron more (SmolLM2: 1536 neurons in 9 groups of 171 or 170).
    """
    base, extra = divmod(d_mlp, groups)
    bounds = [0]
    for g in range(groups):
        bounds.append(bounds[-1] + base + (1 if g < extra else 0))
    return bounds


def row_shape(store: StoreReader, spec: FeatureSpec, n_sources: int = 0) -> tuple[int, ...]:
    """The shape of one row of ``spec``'s features (``n_sources``: the source axis of the source kinds)."""
    g = store.geometry
    n_l = len(spec.layers)
    n_h = len(spec.heads) if spec.heads is not None else g.n_heads
    kind = spec.kind
    if kind == "z":
        return (n_l, n_h, g.d_head)
    if kind in ("attn_head", "attn_entity"):
        return (n_l, n_h, g.d_model)
    if kind in ("attn", "mlp", "resid"):
        return (n_l, g.d_model)
    if kind == "mlp_group":
        n_g = len(spec.heads) if spec.heads is not None else (spec.groups or g.n_heads)
        return (n_l, n_g, g.d_model)
    if kind == "attn_prob":
        return (n_l, n_h, n_sources)
    return (n_l, n_h, n_sources, g.d_model)  # attn_head_token


def compute_block(
    store: StoreReader,
    spec: FeatureSpec,
    block: RowBlock,
    out: np.ndarray | None = None,
    zeroed: bool = False,
) -> np.ndarray:
    """Features of one segment's rows: [n, *row_shape] float32, C-contiguous.

    ``out``: where to write them (a C-contiguous float32 array of that shape, e.g. rows of a
    preallocated matrix); the matmuls write their results there directly (one ``bmm``/``baddbmm`` over
    the layers (and heads), per group for ``mlp_group``, per row for ``attn_head_token``, with the
    destination as a strided view: no copy of the result).
    For ``attn_head_token``/``attn_prob`` its source axis may be longer than this block's longest
    row (the tail is zero-filled, unless ``zeroed`` says ``out`` is all zeros already: a fresh
    ``np.zeros`` matrix, whose untouched pages the OS hands out zeroed, costs no writes there).
    Returns ``out`` (or a new array)."""
    g = store.geometry
    W = weights(store)
    L = list(spec.layers)
    Hs = list(spec.heads) if spec.heads is not None else list(range(g.n_heads))
    seg, rows = block.segment, block.seg_rows
    kind = spec.kind
    n = len(rows)
    K = corpus_sources(store) if kind in SOURCE_KINDS else 0
    if kind in ("attn_head_token", "attn_prob"):
        S = K or (int(block.n_src.max()) if n else 0)
        S = out.shape[3] if out is not None else S
        shape = (n, *row_shape(store, spec, S))
    else:
        shape = (n, *row_shape(store, spec))
    if out is None:
        zeroed = kind in SOURCE_KINDS  # their padding stays untouched
        out = (np.zeros if zeroed else np.empty)(shape, dtype=np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise QueryError(
            f"compute_block: out is {out.dtype} {out.shape}, expected C-contiguous float32 {shape}"
        )
    if n == 0:
        return out
    dst = torch.from_numpy(out)
    if kind == "resid":
        store.read_segment_rows(seg, "resid", rows, L, out=out.reshape(n, len(L), -1))
        return out
    if kind in ("mlp", "mlp_group"):
        a = torch.from_numpy(store.read_segment_rows(seg, "mlp", rows, L))  # [n, l, d_mlp]
        Wd = W.layers("W_down", L)  # [l, d_mlp, d]
        if kind == "mlp":
            # One baddbmm over the layers, written through out's [l, n, d] view.
            torch.baddbmm(W.layers("b_down", L)[:, None], a.transpose(0, 1), Wd, out=dst.transpose(0, 1))
            return out
        G = spec.groups or g.n_heads
        keep = list(spec.heads) if spec.heads is not None else list(range(G))
        bounds = group_bounds(g.d_mlp, G)
        for j, grp in enumerate(keep):  # one bmm over the layers per group
            lo, hi = bounds[grp], bounds[grp + 1]
            torch.bmm(a[:, :, lo:hi].transpose(0, 1), Wd[:, lo:hi], out=dst[:, :, j].transpose(0, 1))
        return out
    if kind in ("z", "attn_head", "attn"):
        z = torch.from_numpy(store.read_segment_rows(seg, "z", rows, L))  # [n, l, H, dh]
        if kind == "z":
            dst.copy_(pick(z, Hs, 2))
            return out
        WO = W.layers("W_O", L)  # [l, H, dh, d]
        if kind == "attn":
            zf = z.reshape(n, len(L), -1)
            WOf = WO.reshape(len(L), -1, g.d_model)
            torch.baddbmm(W.layers("b_O", L)[:, None], zf.transpose(0, 1), WOf, out=dst.transpose(0, 1))
            return out
        _heads_matmul(pick(z, Hs, 2), pick(WO, Hs, 1), dst)
        return out
    if K:  # a corpus store with sources: its top-K sources, zero-padded (corpus_sources.py)
        f = source_factors(store, store.manifest.segment_size * seg + rows, L, Hs)
        Sx = out.shape[3]
        if kind == "attn_prob":
            out[:, :, :, :K] = f.weight
        else:
            out[:, :, :, :K] = contributions(store, f)[0]
        if not zeroed:
            out[:, :, :, K:] = 0
        return out
    # Kinds that need the per-source factors A and V.
    if kind == "attn_entity":
        has = block.subject_start >= 0
        starts = block.src_start + np.where(has, block.subject_start, 0)
        lengths = np.where(has, block.subject_end - block.subject_start, 0)
    else:
        starts, lengths = block.src_start, block.n_src
    A = torch.from_numpy(pick(store.read_segment_ranges(seg, "attn", starts, lengths, L), Hs, 2))  # [N, l, h]
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # row r's sources: first[r] ..
    if kind == "attn_prob":
        for r in range(n):
            k = int(lengths[r])
            dst[r, :, :, :k] = A[first[r] : first[r] + k].permute(1, 2, 0)
            if not zeroed:
                dst[r, :, :, k:] = 0
        return out
    V = torch.from_numpy(store.read_segment_ranges(seg, "v", starts, lengths, L))  # [N, l, Hkv, dh]
    AV = _weighted_values(A, V, Hs, g.kv_group)  # [N, l, h, dh]
    WOs = pick(W.layers("W_O", L), Hs, 1)  # [l, h, dh, d]
    if kind == "attn_entity":
        owner = torch.repeat_interleave(torch.arange(n), torch.as_tensor(lengths, dtype=torch.long))
        ze = torch.zeros((n, len(L), len(Hs), g.d_head))
        ze.index_add_(0, owner, AV)  # z restricted to the subject's sources
        _heads_matmul(ze, WOs, dst)
        return out
    # attn_head_token: per row, one bmm over (layer, head) of its sources, written into its slot.
    # The slot's [lh, k, d] view is strided (the source axis holds Sx >= k): torch's bmm writes it
    # directly but then does not parallelise over the batch, so with more than one thread the product
    # goes through a contiguous scratch and one copy (2 threads: 6.5 vs 8.7-16 ms per 23-source row;
    # 1 thread: direct, 10-11 vs 11-13 ms; benchmarks/README.md).
    lh = len(L) * len(Hs)
    Wf = WOs.reshape(lh, g.d_head, g.d_model)
    Sx = out.shape[3]
    scratch = (
        torch.empty((lh * int(lengths.max()) * g.d_model,)) if torch.get_num_threads() > 1 and n else None
    )
    for r in range(n):
        k = int(lengths[r])
        x = AV[first[r] : first[r] + k].permute(1, 2, 0, 3).reshape(lh, k, g.d_head)
        slot = dst[r].view(lh, Sx, g.d_model)
        if scratch is None:
            torch.bmm(x, Wf, out=slot[:, :k])
        else:
            tmp = scratch[: lh * k * g.d_model].view(lh, k, g.d_model)
            torch.bmm(x, Wf, out=tmp)
            slot[:, :k].copy_(tmp)
        if not zeroed:
            slot[:, k:] = 0
    return out


def _heads_matmul(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor) -> None:
    """``out[n, l, h] = x[n, l, h] @ W[l, h]`` (x [n, l, h, k], W [l, h, k, d], out [n, l, h, d]
    contiguous): one bmm over all (layer, head) pairs, written through out's [l*h, n, d] strided view
    (BLAS takes its row stride as the leading dimension: no copy of the result)."""
    n, n_l, n_h, k = x.shape
    lh = n_l * n_h
    xs = x.reshape(n, lh, k) if x.is_contiguous() else x.contiguous().view(n, lh, k)
    Ws = W.reshape(lh, k, W.shape[-1])
    torch.bmm(xs.transpose(0, 1), Ws, out=out.view(n, lh, out.shape[-1]).transpose(0, 1))


def _weighted_values(A: torch.Tensor, V: torch.Tensor, heads: list[int], kv_group: int) -> torch.Tensor:
    """``A[s, l, h] * V[s, l, kv(h)]`` -> [N, l, h, dh]: with every head, by broadcasting over each kv
    head's group of query heads (V is not expanded to the query heads first)."""
    N, n_l, n_kv, dh = V.shape
    if heads == list(range(n_kv * kv_group)):
        return (A.reshape(N, n_l, n_kv, kv_group, 1) * V.reshape(N, n_l, n_kv, 1, dh)).reshape(N, n_l, -1, dh)
    kv = torch.tensor([h // kv_group for h in heads])
    return A[..., None] * V[:, :, kv]
