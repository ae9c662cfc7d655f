"""Padding a list of tokenized prompts into one batch and building its gather indices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actstore.ingest.capture.fused import BatchIndex
from actstore.ingest.records import TokenizedPrompt


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T] each example's own positions 0.., whatever the padding
    index: BatchIndex
    n_tokens: list[int]  # stored tokens per example (= target_position + 1)


def pad_batch(
    prompts: Sequence[TokenizedPrompt], pad_id: int, side: str, device: torch.device
) -> PaddedBatch:
    """Pad to the longest prompt on ``side`` ("left" or "right"); one target per prompt (its last token)."""
    lengths = [p.target_position + 1 for p in prompts]
    T, B = max(lengths), len(prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    offsets = [T - n if side == "left" else 0 for n in lengths]
    for b, (p, n, o) in enumerate(zip(prompts, lengths, offsets)):
        ids[b, o : o + n] = torch.tensor(p.input_ids[:n], dtype=torch.long)
        mask[b, o : o + n] = 1
    length_t = torch.tensor(lengths)
    offset_t = torch.tensor(offsets)
    rows = torch.arange(B)
    # Every stored token of example b: positions 0..n_b-1, at padded positions o_b + j.
    tok_b = torch.repeat_interleave(rows, length_t)
    starts = torch.cumsum(length_t, 0) - length_t
    local = torch.arange(int(length_t.sum())) - torch.repeat_interleave(starts, length_t)
    tok_pos = local + offset_t[tok_b]
    index = BatchIndex(
        target_b=rows.to(device),
        target_pos=(offset_t + length_t - 1).to(device),
        src_t=tok_b.to(device),  # the sources of a target are exactly its example's stored tokens
        src_pos=tok_pos.to(device),
        tok_b=tok_b.to(device),
        tok_pos=tok_pos.to(device),
    )
    # Explicit positions: with left padding, absolute position embeddings (GPT-2) would
    # otherwise see shifted positions.
    positions = (torch.cumsum(mask, 1) - 1).clamp(min=0)
    return PaddedBatch(ids.to(device), mask.to(device), positions.to(device), index, lengths)
