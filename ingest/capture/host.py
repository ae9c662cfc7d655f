"""What a batch's capture leaves on the host: its arrays copied off the device, and the model's
next-token predictions at the targets (top token, and the log-probability and rank of a given token)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _host(t: torch.Tensor) -> np.ndarray:
    """One device-to-host copy; bfloat16 travels as its uint16 bits."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
        return _host(t).view(np.uint16)
    return t.cpu().numpy()


def to_host(tensors: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Copy a batch's captured arrays to host memory.

    On CUDA every array goes into a freshly pinned buffer with a non-blocking copy, and the
    stream is synchronised once for the whole batch; on the CPU the tensors already live in
    host memory and are only viewed as numpy.
    """
    if not any(tensors[n].is_cuda for n in names):
        return {n: _host(tensors[n]) for n in names}
    pinned: dict[str, torch.Tensor] = {}
    for n in names:
        src = tensors[n].view(torch.int16) if tensors[n].dtype == torch.bfloat16 else tensors[n]
        buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        buf.copy_(src, non_blocking=True)
        pinned[n] = buf
    torch.cuda.current_stream().synchronize()
    return {
        n: (b.numpy().view(np.uint16) if tensors[n].dtype == torch.bfloat16 else b.numpy())
        for n, b in pinned.items()
    }


def predictions(logits: torch.Tensor, object_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per target (``logits`` [n, vocab]): the top token id, and the log-probability and rank (0 = the
    top) of ``object_ids`` [n] (NaN and -1 where the id is -1)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.argmax(-1).cpu().numpy().astype(np.int32)
    obj = torch.as_tensor(object_ids, device=logp.device)
    safe = obj.clamp(min=0)
    lp = logp.gather(1, safe[:, None])[:, 0]
    rank = (logp > lp[:, None]).sum(-1)
    has = obj >= 0
    lp_np = torch.where(has, lp, torch.full_like(lp, float("nan"))).cpu().numpy().astype(np.float32)
    rank_np = torch.where(has, rank, torch.full_like(rank, -1)).cpu().numpy().astype(np.int32)
    return top, lp_np, rank_np
