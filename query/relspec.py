"""RelSpec feature selection and per-episode standardisation (SPEC section 5, seed 000).

Our definition (the paper leaves it open): on an episode's support set, each feature is
first standardised with the support mean and (population) standard deviation; then, for
every relation c of the episode, features are ranked by the absolute standardised mean
difference (Cohen's d with the pooled within-group variance) between the rows of c and the
other support rows.  The top ``top_k`` features of each relation are kept and the union over
relations is the episode's feature set.  Queries are standardised with the support
statistics.  Cohen's d is invariant to the per-feature standardisation, which is done first
only for numerical accuracy.

Everything works on a batch of episodes at once: ``xs`` is ``[B, n*k, F]`` (class-major rows).
Features constant over the support set are standardised to 0 and get d = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POOLED_EPS = 1e-6  # relative floor on the pooled variance (times its mean over features)


@dataclass(frozen=True)
class Selected:
    """The features chosen for a batch of episodes, padded to a common width."""

    index: torch.Tensor  # [B, Fm] feature indices (ascending per episode; padding repeats index 0)
    valid: torch.Tensor  # [B, Fm] bool, False on padding
    mean: torch.Tensor  # [B, Fm] support mean of each selected feature (0 on padding)
    std: torch.Tensor  # [B, Fm] support std (1 on padding and on constant features)

    @property
    def counts(self) -> torch.Tensor:
        return self.valid.sum(1)


def support_stats(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std over the support rows; std 1 where a feature is constant."""
    mean = xs.mean(1)
    std = xs.std(1, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return mean, std


def smd_scores(xs_std: torch.Tensor, n_way: int, k_shot: int) -> torch.Tensor:
    """Cohen's d of each relation vs the rest, ``[B, n, F]``, from support features already
    standardised per episode (mean 0, population variance 1 or 0 per feature)."""
    B, S, F = xs_std.shape
    if S != n_way * k_shot:
        raise ValueError(f"support has {S} rows, expected n_way*k_shot = {n_way * k_shot}")
    grouped = xs_std.view(B, n_way, k_shot, F)
    mc = grouped.mean(2)  # [B, n, F]
    sq_c = grouped.square().sum(2)  # [B, n, F]
    total_sq = sq_c.sum(1, keepdim=True)  # [B, 1, F]: S or 0
    rest = S - k_shot
    mr = -k_shot * mc / rest  # the overall mean is 0
    ss_c = (sq_c - k_shot * mc.square()).clamp_min(0)
    ss_r = (total_sq - sq_c - rest * mr.square()).clamp_min(0)
    pooled = (ss_c + ss_r) / max(S - 2, 1)
    floor = POOLED_EPS * pooled.mean(-1, keepdim=True) + 1e-30
    return (mc - mr) / torch.sqrt(pooled + floor)


def select_features(xs: torch.Tensor, n_way: int, k_shot: int, top_k: int) -> Selected:
    """RelSpec on a batch of support sets ``xs`` [B, n*k, F] (float32)."""
    B, _, F = xs.shape
    mean, std = support_stats(xs)
    xs_std = (xs - mean[:, None]) / std[:, None]
    score = smd_scores(xs_std, n_way, k_shot).abs()  # [B, n, F]
    del xs_std
    k = min(top_k, F)
    top = torch.topk(score, k, dim=-1, sorted=False).indices  # [B, n, k]
    mask = torch.zeros((B, F), dtype=torch.bool)
    mask.scatter_(1, top.reshape(B, -1), True)
    counts = mask.sum(1)
    width = int(counts.max())
    # Selected indices first, in ascending order (a stable sort keeps feature order).
    order = torch.sort(mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    valid = torch.arange(width)[None, :] < counts[:, None]
    index = torch.where(valid, order, torch.zeros_like(order))
    sel_mean = torch.where(valid, torch.gather(mean, 1, index), torch.zeros(()))
    sel_std = torch.where(valid, torch.gather(std, 1, index), torch.ones(()))
    return Selected(index, valid, sel_mean, sel_std)


def gather_standardized(matrix: torch.Tensor, positions: torch.Tensor, sel: Selected) -> torch.Tensor:
    """Rows ``positions`` [B, R] of ``matrix`` [N, F], restricted to each episode's selected
    features and standardised with its support statistics: ``[B, R, Fm]`` float32, exactly 0
    on padding.  Only the selected entries are read (no ``[B, R, F]`` intermediate)."""
    x = matrix[positions[:, :, None], sel.index[:, None, :]].to(torch.float32)
    out = (x - sel.mean[:, None]) / sel.std[:, None]
    return out * sel.valid[:, None].to(out.dtype)
