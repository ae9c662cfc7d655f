"""Fused capture: one forward pass records everything the store needs, for target rows only.

The attention function registered with transformers' ``AttentionInterface`` receives the
rotary-embedded q, k, v of every layer.  It returns SDPA's output unchanged (so the model
computes exactly what it would without us) and, for the target positions only, records

    z_h(t)    = sum_j A_h(t,j) V_kv(h)(j)     (the kernel's own output at t)     [nT, H, d_head]
    A_h(t,j)  for the sources j = 0..t of each target                           [N_src, H]
    V(j)      for every stored token of each example                            [N_tok, H_kv, d_head]

A pre-hook on the MLP down projection records its input a(t) [nT, d_mlp]; hooks on the
decoder layers record the residual stream [nT, L+1, d_model].  Everything is gathered on the
device into one buffer per array, cast to the storage dtype, and copied to host once per batch.

Corpus mode with sources (``--sources K``) needs every query row's probabilities at the source
layers; there the kernel is an eager attention instead of SDPA (``softmax(q k^T) V`` from the very
probabilities whose top K it records, as transformers' eager attention computes it), so the
attention is computed once, not twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from actstore.core.manifest import Geometry
from actstore.ingest.capture.architectures import Architecture

CAPTURE_ATTENTION = "actstore_capture"
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BatchIndex:
    """Device index tensors for one padded batch (all positions are padded coordinates)."""

    target_b: torch.Tensor  # [nT]   batch row of each target
    target_pos: torch.Tensor  # [nT] position of each target
    src_t: torch.Tensor  # [N_src] which target each source belongs to
    src_pos: torch.Tensor  # [N_src] padded position of each source token
    tok_b: torch.Tensor  # [N_tok] batch row of each stored token
    tok_pos: torch.Tensor  # [N_tok] padded position of each stored token
    # Corpus mode with sources (``--sources K``): every target keeps its top ``sources`` source
    # positions per (layer, head) among those ``src_rank >= 0`` marks (the kept positions, numbered
    # 0.. within each window), at the layers ``source_layers``; ``attn`` is then [nT * 2K, L, H]:
    # per target, K weights then K row offsets (its row minus the source's), see _attend_with_sources.
    # Targets are then in batch-row order (``target_b`` non-decreasing), and windows right-padded.
    sources: int = 0
    src_rank: torch.Tensor | None = None  # [B, T] int64, -1 where a position is not a source
    source_layers: tuple[int, ...] = ()


class _Capture:
    """Per-batch state the attention function and hooks write into."""

    def __init__(self, index: BatchIndex, g: Geometry, dtype: torch.dtype, device: torch.device) -> None:
        nT, nS, nK = index.target_b.numel(), index.src_t.numel(), index.tok_b.numel()
        L, H = g.n_layers, g.n_heads
        self.index = index
        self.z = torch.empty((nT, L, H, g.d_head), dtype=dtype, device=device)
        if index.sources:
            nS = 2 * index.sources * nT
        self.attn = torch.zeros((nS, L, H), dtype=dtype, device=device)
        self.v = (torch.zeros if index.sources else torch.empty)(
            (nK, L, g.n_kv_heads, g.d_head), dtype=dtype, device=device
        )
        self.mlp = torch.empty((nT, L, g.d_mlp), dtype=dtype, device=device)
        self.resid = torch.empty((nT, L + 1, g.d_model), dtype=dtype, device=device)
        self.final: torch.Tensor | None = None  # [nT, d_model] last layer output, model dtype


def rows_at(x: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``x[b, p]`` for ``x`` [B, T, ...]: one ``index_select`` of the flattened rows where the first two
    axes merge without a copy (on the CPU about 5x faster than the advanced index), else the index."""
    if x.dim() >= 2 and x.stride(0) == x.stride(1) * x.shape[1]:
        return x.flatten(0, 1).index_select(0, b * x.shape[1] + p)
    return x[b, p]


def heads_at(x: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``x[b, :, p]`` for ``x`` [B, H, T, ...]: [m, H, ...], by :func:`rows_at` on the [B, T, H, ...]
    view where that is the tensor's layout (a projection's heads), else one ``index_select`` of its
    (b, h, p) rows where it is contiguous, else the advanced index."""
    xt = x.transpose(1, 2)
    if xt.stride(0) == xt.stride(1) * xt.shape[1]:
        return rows_at(xt, b, p)
    if x.is_contiguous():
        B, H, T = x.shape[:3]
        at = ((b * H)[:, None] + torch.arange(H, device=x.device)) * T + p[:, None]
        return (
            x.reshape(B * H * T, *x.shape[3:]).index_select(0, at.flatten()).view(b.numel(), H, *x.shape[3:])
        )
    return x[b, :, p]


_ACTIVE: dict[int, tuple[FusedCapture, int]] = {}  # id(attention module) -> (capture, layer)


def target_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    index: BatchIndex,
    *,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention probabilities of the target rows only, in float32: [nT, H, T_kv].

    Recomputes softmax(q k^T * scaling + mask) for nT query rows instead of T, so its cost
    is a small fraction of the attention itself.
    """
    tb, tp = index.target_b, index.target_pos
    q = query[tb, :, tp, :].float()  # [nT, H, d]
    k = key[tb].float()  # [nT, H_kv, T, d]
    group = q.shape[1] // k.shape[1]
    q = q.view(q.shape[0], k.shape[1], group, q.shape[-1])  # [nT, H_kv, G, d]
    scores = torch.einsum("nkgd,nktd->nkgt", q, k).reshape(q.shape[0], -1, k.shape[2]) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    T = k.shape[2]
    if attention_mask is None:
        cols = torch.arange(T, device=scores.device)
        keep = cols[None, :] <= tp[:, None]
        if sliding_window is not None:
            keep &= cols[None, :] > tp[:, None] - sliding_window
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    else:
        m = attention_mask[tb, :, tp, :T]  # [nT, 1 or H, T]
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    return torch.softmax(scores, dim=-1)


def _capture_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    entry = _ACTIVE.get(id(module))
    state, layer = (entry[0].state, entry[1]) if entry is not None else (None, -1)
    if state is not None and state.index.sources and layer in state.index.source_layers:
        # corpus mode with sources: the attention from the probabilities whose top K it records
        out = _attend_with_sources(state, layer, query, key, value, attention_mask, kwargs)
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    if state is None:
        return out, None
    ix = state.index
    dt = state.z.dtype
    state.z[:, layer] = rows_at(out, ix.target_b, ix.target_pos).to(dt)  # out: [B, T, H, d]
    if (
        not ix.sources and ix.src_t.numel()
    ):  # (corpus mode without --sources: its targets' rows are never computed)
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        probs = target_probabilities(
            query,
            key,
            attention_mask,
            float(scaling),
            ix,
            softcap=kwargs.get("softcap"),
            sliding_window=kwargs.get("sliding_window"),
        )
        state.attn[:, layer] = probs[ix.src_t, :, ix.src_pos].to(dt)
    if not ix.sources or layer in ix.source_layers:
        state.v[:, layer] = heads_at(value, ix.tok_b, ix.tok_pos).to(dt)
    return out, None


SOURCE_CHUNK_BYTES = 1 << 27  # float32 probabilities computed at once by _attend_with_sources
SELECT_BLOCK = 32  # fewest query rows scored together (a window of T rows goes in about 8 blocks)


def _attend_with_sources(
    state: _Capture,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Corpus mode with sources, one layer: the attention itself, from the probabilities it stores.

    As an eager attention: ``P = softmax(q k^T * scaling (+ softcap) + mask)`` in float32 (the
    scaling folded into ``q``: exact for a power of two, else to rounding), and the output ``P V``
    (``P`` in the model's dtype) in SDPA's layout [B, T, H, d_head] for the model to go on with, so
    that nothing is computed twice.  Query rows go in blocks, each scored against the keys up to
    its last row only (the later ones are masked anyway): about half the work of the full square.
    For every target row, per head, the ``K`` largest of ``P`` over the kept positions
    (``src_rank >= 0``), descending, and their row offsets (target's rank minus source's: the
    source's store row is the target's row minus it) go to ``state.attn`` viewed as
    [nT, 2, K, L, H] (0: weights, 1: offsets; a slot past the target's kept sources has weight 0
    and offset 0).  Targets are in batch-row order (corpus mode), so a chunk of windows' targets
    are one slice of them; a chunk holds at most ``SOURCE_CHUNK_BYTES`` of probabilities."""
    ix = state.index
    K = ix.sources
    assert ix.src_rank is not None
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    nT, H, Tq, T = ix.target_b.numel(), query.shape[1], query.shape[2], key.shape[2]
    B, Hkv, G, dv = query.shape[0], key.shape[1], query.shape[1] // key.shape[1], value.shape[-1]
    k_top = min(K, T)  # (a batch of windows shorter than K keeps what it has)
    square = Tq == T  # query row t is position t (no cache): its keys past t are masked
    block = max(SELECT_BLOCK, -(-Tq // 8)) if square else Tq
    step = max(1, SOURCE_CHUNK_BYTES // (4 * H * block * T))  # batch rows whose block scores fit
    dst = state.attn.view(nT, 2, K, *state.attn.shape[1:])
    dev = query.device
    softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
    out = torch.zeros((B, Tq, H, dv), dtype=value.dtype, device=value.device)
    edges = torch.arange(0, B + step, step, device=dev).clamp(max=B)
    bounds = torch.searchsorted(ix.target_b, edges).tolist()
    low = torch.finfo(torch.float32).min  # as eager attention: a masked score, never a NaN row
    for c, b0 in enumerate(range(0, B, step)):
        b1 = min(B, b0 + step)
        nb = b1 - b0
        qs = query[b0:b1].float() * float(scaling)
        keys, vals = key[b0:b1].float(), value[b0:b1]
        rank = ix.src_rank[b0:b1]  # [nb, T]
        t0, t1 = bounds[c], bounds[c + 1]
        # positions not kept (BOS, other special tokens) that some target of the window sees: never
        # sources (padding, after every target, weighs 0 for them anyway)
        last = torch.full((nb,), -1, dtype=torch.long, device=dev)
        last.scatter_reduce_(0, ix.target_b[t0:t1] - b0, ix.target_pos[t0:t1], "amax")
        special = (rank < 0) & (torch.arange(T, device=dev)[None, :] < last[:, None])
        special_cols = torch.nonzero(special.any(0)).flatten()
        tb, tp = ix.target_b[t0:t1] - b0, ix.target_pos[t0:t1]
        w_t = torch.full((t1 - t0, H, k_top), -1.0, device=dev)  # per target of the chunk: its top K
        j_t = torch.zeros((t1 - t0, H, k_top), dtype=torch.long, device=dev)
        for a in range(0, Tq, block):
            b = min(Tq, a + block)
            n, e = b - a, (b if square else T)  # rows, keys
            # the windows with a target at row a or later: the others' rows here (padding, or tokens
            # after their last target) reach no target, and their outputs stay 0
            live = torch.nonzero(last >= a).flatten()
            nl = live.numel()
            if not nl:
                continue
            if nl == nb:
                q_b, k_b, v_b, rows_of = qs[:, :, a:b], keys[:, :, :e], vals[:, :, :e], None
            else:
                q_b = qs[:, :, a:b].index_select(0, live)
                k_b, v_b = keys[:, :, :e].index_select(0, live), vals[:, :, :e].index_select(0, live)
                rows_of = torch.full((nb,), -1, dtype=torch.long, device=dev)
                rows_of[live] = torch.arange(nl, device=dev)
            scores = torch.matmul(q_b.reshape(nl, Hkv, G * n, -1), k_b.transpose(-1, -2))
            if softcap is not None:
                scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
            s5 = scores.view(nl, Hkv, G, n, e)
            if square and window is None and (attention_mask is None or attention_mask.dtype == torch.bool):
                # causal, windows right-padded: a target sees no padded key, so the mask is the
                # causal one, and only the keys a..b-1 are ever masked in these rows (padded rows
                # may then see padded keys: their outputs reach no target)
                s5[..., a:b].masked_fill_(_upper(n, dev), low)
            elif attention_mask is None:
                rows_at, cols = torch.arange(a, b, device=dev)[:, None], torch.arange(e, device=dev)[None, :]
                keep = cols <= rows_at
                if window is not None:
                    keep &= cols > rows_at - window
                s5.masked_fill_(~keep, low)
            else:
                m = attention_mask[b0:b1, :, a:b, :e]
                m = (m if rows_of is None else m[live])[:, :, None]  # [nl, 1, 1, n, e]
                if m.dtype == torch.bool:
                    s5.masked_fill_(~m, low)
                else:
                    s5.add_(m.float())
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs.to(v_b.dtype), v_b).view(nl, H, n, dv).transpose(1, 2)  # [nl, n, H, dv]
            if rows_of is None:
                out[b0:b1, a:b] = o
            else:
                out[b0:b1, a:b].index_copy_(0, live, o)
            # the block's target rows only (padded rows are never selected from)
            here = torch.nonzero((tp >= a) & (tp < b)).flatten()
            if not here.numel():
                continue
            hb = tb[here]
            part = heads_at(probs.view(nl, H, n, e), hb if rows_of is None else rows_of[hb], tp[here] - a)
            cols = special_cols[special_cols < e]
            if cols.numel():  # no source: a position not kept (weight 0: below every kept source of
                # positive weight, and a slot of weight 0 is no source; not negative: select_top's fast path)
                part[..., cols] = part[..., cols].masked_fill(special[hb][:, cols][:, None, :], 0.0)
            w, j = select_top(part, k_top)  # (fewer than K columns where the block has fewer keys)
            w_t[..., : w.shape[-1]].index_copy_(0, here, w)
            j_t[..., : w.shape[-1]].index_copy_(0, here, j)
        if t0 == t1:
            continue
        invalid = w_t <= 0  # (a source of weight 0, e.g. outside a sliding window, is no source)
        if not special_cols.numel():  # no position left out before a target: its rank is its position
            offset = (tp[:, None, None] - j_t).masked_fill_(invalid, 0)
        else:
            src = rank.reshape(-1)[(tb * T)[:, None, None] + j_t]  # [n, H, k] each source's rank
            offset = (rank[tb, tp][:, None, None] - src).masked_fill_(invalid, 0)
        dst[t0:t1, 0, :k_top, layer] = w_t.masked_fill_(invalid, 0.0).transpose(1, 2)  # [n, k, H]
        dst[t0:t1, 1, :k_top, layer] = offset.transpose(1, 2)
    return out


_UPPER: dict[tuple[int, str], torch.Tensor] = {}


def _upper(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] True above the diagonal (a key after the query row), cached."""
    key = (n, str(device))
    if key not in _UPPER:
        _UPPER[key] = torch.ones((n, n), dtype=torch.bool, device=device).triu(1)
    return _UPPER[key]


SORT_WHOLE = 256  # rows this short are sorted whole (numpy's vectorised sort beats partition + sort)


def select_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, n)`` largest entries of ``x`` [..., n] along the last axis, descending, and their
    indices: ``torch.topk``'s answer up to the order of equal values.  On the CPU in float32 each
    entry becomes one int64, the complement of its value's bits made monotone above its column's,
    so that an in-place ``partition`` finds the ``k`` largest in linear time and an in-place sort of
    those orders them, on plain integers, no index array carried along (ours; 1.8x faster than
    ``argpartition``, a gather and an ``argsort`` of the chosen; ``torch.topk`` is 2x slower still).
    Rows of at most ``SORT_WHOLE`` entries are sorted whole instead: numpy's vectorised sort of a short
    row costs about what the partition alone does (1.2-1.7x less than partition and sort at 32-256)."""
    n = x.shape[-1]
    k = min(k, n)
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.numel():
        return torch.topk(x, k, dim=-1)
    bits = x.contiguous().numpy().view(np.int32)
    key = np.empty(bits.shape, dtype=np.int64)
    negative = bool(bits.min() < 0)  # a negative value or -0.0: as int32 their order is reversed
    if negative:  # so theirs get the lower 31 bits flipped (monotone), then all 32 (the complement)
        np.bitwise_xor(bits, ~(bits >> 31) | np.int32(-(2**31)), out=key)
    else:
        np.invert(bits, out=key)
    key <<= 32
    key |= np.arange(0xFFFFFFFF, 0xFFFFFFFF - n, -1, dtype=np.int64)  # the column's complement
    if n > SORT_WHOLE:
        key.partition(k - 1, axis=-1)
        key = key[..., :k]
    key.sort(axis=-1)  # ascending keys: descending values
    key = key[..., :k]
    np.invert(key, out=key)
    value = (key >> 32).astype(np.int32)
    if negative:
        value ^= (value >> 31) & 0x7FFFFFFF
    return torch.from_numpy(value.view(np.float32)), torch.from_numpy(key & 0xFFFFFFFF)


def register_capture_attention() -> None:
    """Make ``actstore_capture`` a valid ``attn_implementation`` (idempotent)."""
    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_ATTENTION, sdpa_mask)


class FusedCapture:
    """Installs the capture attention and hooks on a model; :meth:`run` captures one batch."""

    def __init__(self, model: nn.Module, arch: Architecture, storage_dtype: str = "float32") -> None:
        self.model = model
        self.arch = arch
        self.geometry = arch.geometry(model)
        self.dtype = TORCH_DTYPE[storage_dtype]
        self.state: _Capture | None = None
        self._handles: list[Any] = []
        self._previous_impl: str | None = None

    def __enter__(self) -> FusedCapture:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def install(self) -> None:
        register_capture_attention()
        cfg = self.model.config
        self._previous_impl = getattr(cfg, "_attn_implementation", None)
        _set_attn_impl(self.model, CAPTURE_ATTENTION)
        blocks = self.arch.blocks(self.model)
        for layer, attn in enumerate(blocks.attention):
            _ACTIVE[id(attn)] = (self, layer)
        for layer, down in enumerate(blocks.down_proj):
            self._handles.append(down.register_forward_pre_hook(self._mlp_hook(layer)))
        self._handles.append(blocks.layers[0].register_forward_pre_hook(self._embed_hook, with_kwargs=True))
        for layer, block in enumerate(blocks.layers):
            self._handles.append(block.register_forward_hook(self._resid_hook(layer + 1)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for attn in self.arch.blocks(self.model).attention:
            _ACTIVE.pop(id(attn), None)
        if self._previous_impl is not None:
            _set_attn_impl(self.model, self._previous_impl)

    # --- hooks ----------------------------------------------------------------------------
    def _mlp_hook(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.state is not None:
                ix = self.state.index
                self.state.mlp[:, layer] = rows_at(args[0], ix.target_b, ix.target_pos).to(self.dtype)

        return hook

    def _embed_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.state is not None:
            h = args[0] if args else kwargs["hidden_states"]
            ix = self.state.index
            self.state.resid[:, 0] = rows_at(h, ix.target_b, ix.target_pos).to(self.dtype)

    def _resid_hook(self, slot: int) -> Callable[..., None]:
        last = slot == self.geometry.n_layers

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.state is not None:
                h = output[0] if isinstance(output, tuple) else output
                ix = self.state.index
                rows = rows_at(h, ix.target_b, ix.target_pos)
                self.state.resid[:, slot] = rows.to(self.dtype)
                if last:
                    self.state.final = rows

        return hook

    # --- one batch ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        index: BatchIndex,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward one padded batch through the backbone (no LM head over all positions).

        Returns device tensors ``z, attn, v, mlp, resid`` in the storage dtype and ``logits``
        [nT, V] (float32) at the target rows only.
        """
        device = input_ids.device
        self.state = _Capture(index, self.geometry, self.dtype, device)
        try:
            backbone = self.arch.backbone(self.model)
            backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
            state = self.state
            assert state.final is not None
            normed = self.arch.final_norm(self.model)(state.final)
            head = self.model.get_output_embeddings()  # type: ignore[operator]
            logits = head(normed).float()
            softcap = getattr(self.model.config, "final_logit_softcapping", None)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            return {
                "z": state.z,
                "attn": state.attn,
                "v": state.v,
                "mlp": state.mlp,
                "resid": state.resid,
                "logits": logits,
            }
        finally:
            self.state = None


def _set_attn_impl(model: nn.Module, impl: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(impl)
            return
        except (ValueError, TypeError, ImportError):
            pass
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = impl
