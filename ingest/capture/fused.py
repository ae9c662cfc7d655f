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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    # per target, K weights then K row offsets (its row minus the source's), see _top_sources.
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
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    entry = _ACTIVE.get(id(module))
    if entry is None or entry[0].state is None:
        return out, None
    cap, layer = entry
    state = cap.state
    assert state is not None
    ix = state.index
    dt = state.z.dtype
    state.z[:, layer] = out[ix.target_b, ix.target_pos].to(dt)  # out: [B, T, H, d]
    if ix.sources:
        if layer in ix.source_layers:
            _top_sources(state, layer, query, key, attention_mask, kwargs)
    elif ix.src_t.numel():  # (corpus mode without --sources: its targets' rows are never computed)
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
        state.v[:, layer] = value[ix.tok_b, :, ix.tok_pos, :].to(dt)
    return out, None


SOURCE_CHUNK_BYTES = 1 << 27  # float32 probabilities computed at once by _top_sources


def _top_sources(
    state: _Capture,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> None:
    """Corpus mode with sources: for every target row, per head, the ``K`` largest attention
    probabilities over the kept positions (``src_rank >= 0``) and their row offsets (target's rank
    minus source's: the source's store row is the target's row minus it), written to
    ``state.attn`` viewed as [nT, 2, K, L, H] (0: weights, 1: offsets; a slot past the target's
    kept sources has weight 0 and offset 0).  Rows go in chunks of bounded size."""
    ix = state.index
    K = ix.sources
    assert ix.src_rank is not None
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    nT, H, T = ix.target_b.numel(), query.shape[1], key.shape[2]
    B, Hkv, G = query.shape[0], key.shape[1], query.shape[1] // key.shape[1]
    step = max(1, SOURCE_CHUNK_BYTES // (4 * H * T * T))  # batch rows whose [H, T, T] scores fit
    dst = state.attn.view(nT, 2, K, *state.attn.shape[1:])
    dt = state.attn.dtype
    softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
    cols = torch.arange(T, device=query.device)
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        sel = torch.nonzero((ix.target_b >= b0) & (ix.target_b < b1)).flatten()
        if not sel.numel():
            continue
        # every query row of these windows at once (one matmul per kv head), then the targets' rows
        q = query[b0:b1].float().reshape(b1 - b0, Hkv, G * query.shape[2], -1)
        scores = (q @ key[b0:b1].float().transpose(-1, -2)).view(b1 - b0, H, query.shape[2], T) * float(
            scaling
        )
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        tb, tp = ix.target_b[sel] - b0, ix.target_pos[sel]
        rows = scores[tb, :, tp]  # [n, H, T]
        if attention_mask is None:
            keep = cols[None, :] <= tp[:, None]
            if window is not None:
                keep &= cols[None, :] > tp[:, None] - window
            rows = rows.masked_fill(~keep[:, None, :], float("-inf"))
        else:
            m = attention_mask[tb + b0, :, tp, :T]
            rows = rows.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else rows + m.float()
        probs = torch.softmax(rows, dim=-1)
        rank = ix.src_rank[tb + b0]  # [n, T]
        own = ix.src_rank[tb + b0, tp]  # [n]
        probs = probs.masked_fill(((rank < 0) | (rank > own[:, None]))[:, None, :], -1.0)
        w, j = torch.topk(probs, min(K, T), dim=-1)  # [n, H, K] (a batch of short windows: fewer)
        valid = w > 0  # (a source of weight 0, e.g. outside a sliding window, is no source)
        offset = own[:, None, None] - torch.gather(rank[:, None, :].expand(-1, H, -1), 2, j)
        dst[sel, 0, : w.shape[-1], layer] = torch.where(valid, w, 0.0).permute(0, 2, 1).to(dt)
        dst[sel, 1, : w.shape[-1], layer] = torch.where(valid, offset, 0).permute(0, 2, 1).to(dt)


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
                self.state.mlp[:, layer] = args[0][ix.target_b, ix.target_pos].to(self.dtype)

        return hook

    def _embed_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.state is not None:
            h = args[0] if args else kwargs["hidden_states"]
            ix = self.state.index
            self.state.resid[:, 0] = h[ix.target_b, ix.target_pos].to(self.dtype)

    def _resid_hook(self, slot: int) -> Callable[..., None]:
        last = slot == self.geometry.n_layers

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.state is not None:
                h = output[0] if isinstance(output, tuple) else output
                ix = self.state.index
                rows = h[ix.target_b, ix.target_pos]
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
