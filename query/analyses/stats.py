"""Statistics used by the analyses, written once, on scipy: correlations and intervals.

Conventions shared by every function here:

* inputs are flattened and cast to float64; pairs where either value is not finite are dropped
  before anything is computed (so a NaN marks a missing point, never poisons a result);
* a result that is not defined (fewer than three points for a correlation, a constant input, no
  values for an interval) is NaN, never an exception or a warning.

Functions:

* :func:`pearson`, :func:`spearman`: coefficient and two-sided p-value
  (``scipy.stats.pearsonr`` / ``scipy.stats.spearmanr``);
* :func:`mean_interval`: the normal interval of a mean, mean +- z * sd / sqrt(n)
  (z = ``scipy.stats.norm.ppf((1 + level) / 2)``, 1.95996 for 95%; sd with ddof=1);
* :func:`proportion_interval`: a binomial interval for k successes out of n (Wilson by default,
  ``scipy.stats.binomtest(...).proportion_ci``);
* :func:`bootstrap_interval`: a seeded percentile bootstrap interval of a statistic
  (``scipy.stats.bootstrap``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from actstore.core.dependencies import scipy_stats as stats
from actstore.core.errors import StatsError

NAN = float("nan")


def _correlation(
    test: Callable[[np.ndarray, np.ndarray], Any], a: ArrayLike, b: ArrayLike
) -> tuple[float, float]:
    """``test``'s statistic and p-value over the finite pairs of ``a`` and ``b`` (flattened, of one
    size), or (NaN, NaN) for fewer than three pairs or a constant input."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if x.size != y.size:
        raise StatsError(f"a correlation needs two inputs of one length, not {x.size} and {y.size}")
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return NAN, NAN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nearly constant inputs warn about precision
        res = test(x, y)
    return float(res.statistic), float(res.pvalue)


def pearson(a: ArrayLike, b: ArrayLike) -> tuple[float, float]:
    """Pearson's r and its two-sided p-value over the finite pairs of ``a`` and ``b`` (any shapes of
    one size, flattened): (r, p), or (NaN, NaN) for fewer than three pairs or a constant input."""
    return _correlation(stats.pearsonr, a, b)


def spearman(a: ArrayLike, b: ArrayLike) -> tuple[float, float]:
    """Spearman's rho and its two-sided p-value over the finite pairs, as :func:`pearson`."""
    return _correlation(stats.spearmanr, a, b)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise StatsError(f"a confidence level is between 0 and 1, not {level}")


def mean_interval(values: ArrayLike, level: float = 0.95) -> tuple[float, float]:
    """Normal interval of the mean of the finite ``values``: mean -+ z * sd(ddof=1) / sqrt(n).

    One value gives (mean, mean) (no spread to estimate); none gives (NaN, NaN).
    """
    _check_level(level)
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return NAN, NAN
    mean = float(v.mean())
    if v.size == 1:
        return mean, mean
    half = float(stats.norm.ppf(0.5 + level / 2)) * float(v.std(ddof=1)) / float(np.sqrt(v.size))
    return mean - half, mean + half


def proportion_interval(
    successes: int, trials: int, level: float = 0.95, method: str = "wilson"
) -> tuple[float, float]:
    """Binomial interval of a proportion (an accuracy): ``successes`` out of ``trials``.

    ``method``: ``"wilson"`` (default), ``"wilsoncc"`` (with continuity correction) or ``"exact"``
    (Clopper-Pearson), as ``scipy.stats.binomtest(...).proportion_ci`` names them.  No trials gives
    (NaN, NaN).
    """
    _check_level(level)
    if method not in ("wilson", "wilsoncc", "exact"):
        raise StatsError(f"interval method must be wilson, wilsoncc or exact, not {method!r}")
    k, n = int(successes), int(trials)
    if n < 0 or not 0 <= k <= max(n, 0):
        raise StatsError(f"{k} successes out of {n} trials is not a proportion")
    if n == 0:
        return NAN, NAN
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=level, method=method)
    return float(ci.low), float(ci.high)


def bootstrap_interval(
    values: ArrayLike,
    statistic: Callable[..., Any] = np.mean,
    *,
    level: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over the finite ``values``: resampled with
    replacement ``n_resamples`` times from a generator seeded with ``seed``, so a result repeats.

    ``statistic``: a numpy reduction that takes ``axis`` (``np.mean``, ``np.median``).  Fewer than
    two values give (NaN, NaN); values that are all equal give (statistic, statistic).
    """
    _check_level(level)
    if n_resamples < 1:
        raise StatsError(f"the bootstrap needs at least one resample, not {n_resamples}")
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size < 2:
        return NAN, NAN
    if np.ptp(v) == 0:
        value = float(statistic(v, axis=-1))
        return value, value
    res = stats.bootstrap(
        (v,),
        statistic,
        confidence_level=level,
        n_resamples=n_resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)
