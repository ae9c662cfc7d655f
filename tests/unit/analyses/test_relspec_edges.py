"""RelSpec's Cohen's d at its edges, against a plain loop over relations and features.

Found by mutation testing (``make mutants``): the numpy oracle in test_oracles_probe.py runs
5-way 5-shot support sets on real-valued features, where the smallest degrees of freedom, the
variance floor and constant features never come into play.  Here: one and two rows per
relation, a feature with no within-relation variance (the floor alone decides d), a constant
feature (d = 0, standardised with sd 1), and the two bad shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actstore.query.analyses.relspec import POOLED_EPS, smd_scores


def cohens_d_loop(x: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [n*k, F] class-major -> (d [n, F], mean [F], sd [F]) by the module docstring's definition,
    one relation and one feature at a time."""
    S, F = x.shape
    d = np.zeros((n, F))
    for f in range(F):
        col = x[:, f].astype(np.float64)
        total_var = col.var()  # population variance of the support
        for c in range(n):
            own = col[c * k : (c + 1) * k]
            rest = np.concatenate([col[: c * k], col[(c + 1) * k :]])
            ss = ((own - own.mean()) ** 2).sum() + ((rest - rest.mean()) ** 2).sum()
            pooled_var = ss / max(S - 2, 1) + POOLED_EPS * total_var
            d[c, f] = (own.mean() - rest.mean()) / math.sqrt(pooled_var + 1e-30)
    sd = x.astype(np.float64).std(0)
    return d, x.mean(0), np.where(sd > 0, sd, 1.0)


@pytest.mark.parametrize(("n", "k"), [(2, 1), (3, 1), (2, 2), (4, 3)])
def test_smd_scores_equal_a_loop(n: int, k: int) -> None:
    rng = np.random.default_rng(n * 10 + k)
    S = n * k
    x = rng.normal(size=(S, 6))
    x[:, 1] = 2.5  # constant: d = 0, sd reported as 1
    x[:, 2] = np.repeat(np.arange(n, dtype=float), k) * 3.0  # no within-relation variance when k > 1
    x[:, 3] *= 1e3  # scale: d is scale-invariant
    d, mean, sd = smd_scores(torch.from_numpy(x[None]).double(), n, k)
    want_d, want_mean, want_sd = cohens_d_loop(x, n, k)
    np.testing.assert_allclose(d[0].numpy(), want_d, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(mean[0].numpy(), want_mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sd[0].numpy(), want_sd, rtol=1e-12, atol=1e-12)
    assert (d[0, :, 1] == 0).all() and sd[0, 1] == 1.0


def test_variance_floor_alone_sets_d_when_relations_do_not_vary_within() -> None:
    # Two relations, two rows each, values 1, 1 | 3, 3: no within-relation variance; the support's
    # population variance is 1, so the pooled sd is sqrt(POOLED_EPS) and d = +-2 / sqrt(POOLED_EPS).
    x = torch.tensor([[[1.0], [1.0], [3.0], [3.0]]], dtype=torch.float64)
    d, _, sd = smd_scores(x, 2, 2)
    want = 2.0 / math.sqrt(POOLED_EPS)
    np.testing.assert_allclose(d[0, :, 0].numpy(), [-want, want], rtol=1e-9)
    assert sd[0, 0].item() == pytest.approx(1.0)


def test_bad_support_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"^support has 5 rows, expected n_way\*k_shot = 6$"):
        smd_scores(torch.zeros(1, 5, 3), 3, 2)
    with pytest.raises(ValueError, match="^RelSpec needs at least two relations per episode$"):
        smd_scores(torch.zeros(1, 4, 3), 1, 4)
