"""actstore.query.analyses.stats against independent computations: numpy formulae, and scipy called directly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from actstore.core.errors import StatsError
from actstore.query.analyses.stats import (
    bootstrap_interval,
    mean_interval,
    pearson,
    proportion_interval,
    spearman,
)


def _rng() -> np.random.Generator:
    return np.random.default_rng(7)


def _pearson_by_hand(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """r from centred sums; p from the t statistic with n - 2 degrees of freedom (regularised beta)."""
    xc, yc = x - x.mean(), y - y.mean()
    r = float((xc * yc).sum() / math.sqrt((xc**2).sum() * (yc**2).sum()))
    df = x.size - 2
    t2 = r * r * df / (1 - r * r)
    p = float(special.betainc(df / 2, 0.5, df / (df + t2)))
    return r, p


def test_pearson_equals_the_textbook_formula_and_its_t_test() -> None:
    rng = _rng()
    x = rng.normal(size=40)
    y = 0.6 * x + rng.normal(size=40) * 0.9
    r, p = pearson(x, y)
    r0, p0 = _pearson_by_hand(x, y)
    assert r == pytest.approx(r0, rel=1e-12)
    assert p == pytest.approx(p0, rel=1e-9)
    assert 0 < p < 0.05  # a real correlation, not a degenerate one


def test_pearson_flattens_shapes_and_drops_non_finite_pairs() -> None:
    rng = _rng()
    x = rng.normal(size=(3, 5, 4))
    y = x**3 + rng.normal(size=(3, 5, 4))
    xb, yb = x.copy(), y.copy()
    xb[0, 0, 0] = np.nan
    yb[1, 2, 3] = np.inf
    keep = np.isfinite(xb) & np.isfinite(yb)
    assert pearson(xb, yb) == pytest.approx(_pearson_by_hand(x[keep], y[keep]), rel=1e-9)
    assert pearson(x, y)[0] == pytest.approx(float(np.corrcoef(x.ravel(), y.ravel())[0, 1]), rel=1e-12)


@pytest.mark.parametrize(
    "x, y",
    [
        ([1.0, 2.0], [2.0, 1.0]),  # too short
        ([1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]),  # constant
        ([1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0]),
        ([1.0, np.nan, 3.0, np.nan], [2.0, 3.0, np.nan, 1.0]),  # one finite pair left
        ([], []),
    ],
)
def test_undefined_correlations_are_nan(x: list[float], y: list[float]) -> None:
    for f in (pearson, spearman):
        r, p = f(x, y)
        assert math.isnan(r) and math.isnan(p)


def test_correlations_need_inputs_of_one_length() -> None:
    with pytest.raises(StatsError, match="one length"):
        pearson([1.0, 2.0, 3.0], [1.0, 2.0])


def test_spearman_is_pearson_of_the_ranks_and_matches_scipy() -> None:
    rng = _rng()
    x = rng.normal(size=30)
    y = np.exp(x) + rng.normal(size=30) * 0.5
    x[4] = x[9]  # a tie: average ranks
    rho, p = spearman(x, y)
    rx, ry = stats.rankdata(x), stats.rankdata(y)
    assert rho == pytest.approx(float(np.corrcoef(rx, ry)[0, 1]), rel=1e-12)
    assert p == pytest.approx(float(stats.spearmanr(x, y).pvalue), rel=1e-12)


def test_mean_interval_is_mean_plus_minus_z_times_standard_error() -> None:
    v = _rng().uniform(0.2, 0.9, size=25)
    lo, hi = mean_interval(v)
    sem = math.sqrt(((v - v.mean()) ** 2).sum() / (v.size - 1)) / math.sqrt(v.size)
    assert (lo + hi) / 2 == pytest.approx(v.mean(), rel=1e-12)
    assert (hi - lo) / 2 == pytest.approx(1.959963984540054 * sem, rel=1e-12)
    lo90, hi90 = mean_interval(v, level=0.90)
    assert (hi90 - lo90) / 2 == pytest.approx(1.6448536269514722 * sem, rel=1e-12)


def test_mean_interval_edges() -> None:
    assert mean_interval([0.4]) == (0.4, 0.4)
    assert all(math.isnan(x) for x in mean_interval([]))
    assert mean_interval([0.5, np.nan, 0.7]) == pytest.approx(mean_interval([0.5, 0.7]))
    with pytest.raises(StatsError, match="between 0 and 1"):
        mean_interval([0.1, 0.2], level=95)


def test_wilson_interval_equals_its_closed_form() -> None:
    z = 1.959963984540054
    for k, n in ((0, 10), (7, 20), (20, 20), (133, 400)):
        lo, hi = proportion_interval(k, n)
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        assert lo == pytest.approx(max(0.0, centre - half), abs=1e-12)
        assert hi == pytest.approx(min(1.0, centre + half), abs=1e-12)


def test_exact_interval_equals_beta_quantiles() -> None:
    k, n = 7, 20
    lo, hi = proportion_interval(k, n, method="exact")
    assert lo == pytest.approx(float(stats.beta.ppf(0.025, k, n - k + 1)), rel=1e-9)
    assert hi == pytest.approx(float(stats.beta.ppf(0.975, k + 1, n - k)), rel=1e-9)


def test_proportion_interval_bad_input() -> None:
    assert all(math.isnan(x) for x in proportion_interval(0, 0))
    with pytest.raises(StatsError, match="not a proportion"):
        proportion_interval(5, 3)
    with pytest.raises(StatsError, match="method"):
        proportion_interval(1, 3, method="normal")


def test_bootstrap_interval_equals_a_percentile_bootstrap_by_hand() -> None:
    v = _rng().exponential(size=30)
    lo, hi = bootstrap_interval(v, n_resamples=2000, seed=3)
    # scipy draws all resample indices at once from the generator: [n_resamples, n]
    idx = np.random.default_rng(3).integers(0, v.size, size=(2000, v.size))
    means = v[idx].mean(axis=1)
    assert lo == pytest.approx(float(np.percentile(means, 2.5)), rel=1e-9)
    assert hi == pytest.approx(float(np.percentile(means, 97.5)), rel=1e-9)
    assert lo < v.mean() < hi
    assert bootstrap_interval(v, n_resamples=2000, seed=3) == (lo, hi)  # seeded: repeats


def test_bootstrap_interval_of_the_median_and_edges() -> None:
    v = _rng().normal(size=41)
    lo, hi = bootstrap_interval(v, np.median, n_resamples=500, seed=1)
    assert lo <= float(np.median(v)) <= hi
    assert bootstrap_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert all(math.isnan(x) for x in bootstrap_interval([1.0]))
    with pytest.raises(StatsError, match="resample"):
        bootstrap_interval(v, n_resamples=0)
