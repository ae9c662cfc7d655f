"""RelSpec feature selection and per-episode standardisation ("Tracing Relational Knowledge Recall", ACL 2026 Findings).

Our definition (the paper leaves it open): on an episode's support set, for every relation c
of the episode, features are ranked by the absolute standardised mean difference between the
support rows of c and the other support rows: Cohen's d, (mean_c - mean_rest) / s_pooled with
the pooled within-group variance.  The top ``top_k`` features of each relation are kept and
the union over relations is the episode's feature set.  The probe then sees each selected
feature standardised with the support mean and population standard deviation; queries are
standardised with the same support statistics.

Everything works on a batch of episodes at once: ``xs`` is ``[B, n*k, F]`` (class-major rows).
Features constant over the support set get d = 0 and are standardised to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SELECT_BATCH = 2
POOLED_EPS = 1e-6  # floor on the pooled variance, relative to the feature's support variance


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


def smd_scores(xs: torch.Tensor, n_way: int, k_shot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cohen's d of each relation vs the rest on support sets ``xs`` [B, n*k, F] (class-major).

    Returns (d [B, n, F], support mean [B, F], support population std [B, F], 1 where constant).
    With class means m_c, overall mean m, W = the within-class sum of squares over all classes
    and T = W + k sum_c (m_c - m)^2 the total one, the pooled sum of squares of "c" and "rest"
    is T - k n/(n-1) (m_c - m)^2 and m_c - m_rest = n/(n-1) (m_c - m); so one pass over ``xs``
    gives every relation's d.  The pooled variance has a floor of ``POOLED_EPS`` times the
    feature's own support variance: d stays scale-invariant per feature and is 0 for constant
    features."""
    B, S, F = xs.shape
    n, k = n_way, k_shot
    if S != n * k:
        raise ValueError(f"support has {S} rows, expected n_way*k_shot = {n * k}")
    if n < 2:
        raise ValueError("RelSpec needs at least two relations per episode")
    grouped = xs.view(B, n, k, F)
    dev = grouped.mean(2)  # [B, n, F] class means (torch.var_mean over this axis is ~10x slower)
    total = (grouped - dev[:, :, None]).square_().sum((1, 2))  # within-class SS, [B, F]
    mean = dev.mean(1)
    dev.sub_(mean[:, None])
    total.add_(dev.square().sum(1), alpha=k)  # total SS
    r = n / (n - 1)
    pooled = dev.square().mul_(-k * r).add_(total[:, None]).clamp_min_(0).div_(max(S - 2, 1))
    pooled.add_(total[:, None], alpha=POOLED_EPS / S).add_(1e-30).sqrt_()
    d = dev.mul_(r).div_(pooled)
    std = total.div_(S).sqrt_()
    return d, mean, torch.where(std > 0, std, torch.ones_like(std))


def select_features(xs: torch.Tensor, n_way: int, k_shot: int, top_k: int) -> Selected:
    """RelSpec on a batch of support sets ``xs`` [B, n*k, F] (float32)."""
    B, _, F = xs.shape
    k = min(top_k, F)
    mask = torch.zeros((B, F), dtype=torch.bool)
    mean = torch.empty((B, F))
    std = torch.empty((B, F))
    for i in range(0, B, SELECT_BATCH):  # small groups keep the [b, n, F] temporaries in cache
        d, mean[i : i + SELECT_BATCH], std[i : i + SELECT_BATCH] = smd_scores(
            xs[i : i + SELECT_BATCH], n_way, k_shot
        )
        top = torch.topk(d.abs_(), k, dim=-1, sorted=False).indices  # [b, n, k]
        mask[i : i + SELECT_BATCH].scatter_(1, top.reshape(top.shape[0], -1), True)
    counts = mask.sum(1)
    width = int(counts.max())
    nz = mask.nonzero()  # (episode, feature) pairs, sorted by episode then feature
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(nz.shape[0]) - starts[nz[:, 0]]
    index = torch.zeros((B, width), dtype=torch.long)
    index[nz[:, 0], slot] = nz[:, 1]
    valid = torch.arange(width)[None, :] < counts[:, None]
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
