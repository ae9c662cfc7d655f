"""The metrics of An Empirical Study of Mechanistic Interpretability Approaches for Factual Recall (ACL 2025) of interpretability methods on factual recall, per method and per stratum.

Every method's reading (:mod:`actstore.query.methods.readings`: a per-layer profile per fact, a key layer and an
MLP-vs-attention verdict; tracing, patching and the lenses also give the two component profiles)
names a *located site* per fact: (verdict component, key layer).  On that:

    precision     localisation precision, per fact: the positive effect at the located site over
                  the positive effect summed over all layers and both components,
                  ``max(c[v, k], 0) / sum_{c', l} max(c[c', l], 0)`` (c = the method's component
                  profiles, v the verdict, k the key layer; a method without component profiles
                  (attention attribution, or a lens on a model whose sublayers do not add up) uses
                  its profile alone).  1 = all of the method's effect sits at one layer and one
                  component; 1/(2L) = spread evenly.  ``layer_precision`` is the same with both
                  components summed at the key layer.  Undefined (NaN) where the method gives no
                  site or no positive effect.
    consistency   per fact: 1 when its key layer lies within ``tolerance`` layers of the median key
                  layer of the facts of its group (relation, or stratum) that the method reads,
                  else 0; ``verdict_consistency``: 1 when its verdict is its group's majority
                  verdict.  Groups with fewer than 2 read facts give NaN.
    effectiveness intervention effectiveness, per fact: the effect of intervening on the located
                  site minus the mean effect of the same intervention on random layers of the same
                  component (the ``site_effects`` table of
                  :mod:`actstore.interventions.effectiveness`: knock-out = the drop in P(object) when
                  the component's output is zeroed at the layer from the subject's first token to
                  the last token; restore = the gain in P(object) when, with the subject's
                  embeddings noised, the clean output is restored there).  ``located_effect``, and
                  ``beats_random``: the share of random draws whose effect is below the located one.
    effect correlation  between two methods: Pearson r over the facts both read of their
                  located-site effects, with a paired bootstrap interval.

Agreement (key layer within ``tolerance``, verdicts equal, all-method consensus) is computed per
fact as in :func:`actstore.query.methods.readings.agreement` and reported with percentile bootstrap 95% intervals
over facts (:func:`actstore.query.analyses.stats.bootstrap_interval`; 2,000 resamples by default).  Every figure
carries its number of facts.  Summaries: the mean over facts with its bootstrap interval.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from actstore.core.dependencies import scipy_stats as stats
from actstore.core.errors import MethodsError
from actstore.query.analyses.stats import bootstrap_interval, pearson
from actstore.query.methods.readings import MethodReading, common_keys

RESAMPLES = 2000
COMPONENTS = ("mlp", "attn")


# ------------------------------------------------------------------------------------ readings


def concat_readings(readings: Sequence[MethodReading]) -> MethodReading:
    """One reading from several of one method (e.g. trace runs over disjoint facts), sorted by fact;
    a fact read twice keeps its first reading."""
    if not readings:
        raise MethodsError("no readings to join")
    method = readings[0].method
    if any(r.method != method for r in readings):
        raise MethodsError("readings of different methods cannot be joined")
    ids = np.concatenate([r.example_ids for r in readings])
    _, first = np.unique(ids, return_index=True)
    order = first[np.argsort(ids[first])]

    def cat(xs: list[np.ndarray | None]) -> np.ndarray | None:
        if any(x is None for x in xs):
            return None
        return np.concatenate([x for x in xs if x is not None])[order]

    profile = cat([r.profile for r in readings])
    key = cat([r.key_layer for r in readings])
    verdict = cat([r.verdict for r in readings])
    assert profile is not None and key is not None and verdict is not None
    return MethodReading(
        method,
        ids[order],
        profile,
        key,
        verdict,
        cat([r.mlp for r in readings]),
        cat([r.attn for r in readings]),
    )


def subset_reading(reading: MethodReading, example_ids: np.ndarray | Sequence[int]) -> MethodReading:
    """``reading`` restricted to the facts of ``example_ids`` that it reads (order kept)."""
    keep = np.isin(reading.example_ids, np.asarray(example_ids, dtype=np.int64))

    def cut(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[keep]

    return MethodReading(
        reading.method,
        reading.example_ids[keep],
        reading.profile[keep],
        reading.key_layer[keep],
        reading.verdict[keep],
        cut(reading.mlp),
        cut(reading.attn),
        dict(reading.info),
    )


@dataclass(frozen=True)
class Sites:
    """Located sites of one method: per fact the key layer (-1: none) and component ('' : none)."""

    method: str
    example_ids: np.ndarray  # [n] int64, sorted
    layer: np.ndarray  # [n] int64
    component: np.ndarray  # [n] object: "mlp" | "attn" | ""


def located_sites(reading: MethodReading) -> Sites:
    comp = np.asarray([v if v in COMPONENTS else "" for v in reading.verdict], dtype=object)
    layer = np.where(comp != "", reading.key_layer, -1).astype(np.int64)
    comp = np.where(layer >= 0, comp, "").astype(object)
    return Sites(reading.method, reading.example_ids.astype(np.int64), layer, comp)


# ------------------------------------------------------------------------------------ per-fact metrics


def positive_part(x: np.ndarray) -> np.ndarray:
    return np.clip(np.where(np.isfinite(x), x, 0.0), 0.0, None)


def localisation_precision(reading: MethodReading, by_component: bool = True) -> np.ndarray:
    """Per fact (in ``reading.example_ids`` order): the share of the method's positive effect at its
    located site (``by_component``: that layer's verdict component; else both components at the key
    layer).  [n] float, NaN where undefined (see the module docstring)."""
    n = len(reading.example_ids)
    out = np.full(n, np.nan)
    key = reading.key_layer
    if reading.mlp is not None and reading.attn is not None:
        grid = np.stack([positive_part(reading.mlp), positive_part(reading.attn)], axis=1)  # [n, 2, L]
        total = grid.sum(axis=(1, 2))
        for i in range(n):
            if key[i] < 0 or total[i] <= 0:
                continue
            if by_component:
                v = reading.verdict[i]
                if v not in COMPONENTS:
                    continue
                out[i] = grid[i, COMPONENTS.index(v), key[i]] / total[i]
            else:
                out[i] = grid[i, :, key[i]].sum() / total[i]
        return out
    prof = positive_part(reading.profile)
    total = prof.sum(axis=1)
    for i in range(n):
        if key[i] >= 0 and total[i] > 0:
            out[i] = prof[i, key[i]] / total[i]
    return out


def consistency(
    reading: MethodReading, groups: Mapping[int, str], tolerance: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per fact: (key layer within ``tolerance`` of its group's median key layer, verdict equal to its
    group's majority verdict), as 1.0 / 0.0, NaN where the fact has no key layer (verdict) or its
    group fewer than 2 such facts.  ``groups``: example id -> group label (facts absent: NaN)."""
    ids = reading.example_ids
    label = np.asarray([groups.get(int(i), None) for i in ids], dtype=object)
    key_ok = np.full(len(ids), np.nan)
    ver_ok = np.full(len(ids), np.nan)
    for g in {x for x in label if x is not None}:
        rows = np.flatnonzero(label == g)
        k = reading.key_layer[rows]
        has = rows[k >= 0]
        if has.size >= 2:
            med = float(np.median(reading.key_layer[has]))
            key_ok[has] = (np.abs(reading.key_layer[has] - med) <= tolerance).astype(float)
        v = reading.verdict[rows]
        vr = rows[np.isin(v, COMPONENTS)]
        if vr.size >= 2:
            vals, counts = np.unique(reading.verdict[vr].astype(str), return_counts=True)
            majority = vals[np.argmax(counts)] if (counts == counts.max()).sum() == 1 else None
            ver_ok[vr] = (reading.verdict[vr] == majority).astype(float) if majority is not None else 0.5
    return key_ok, ver_ok


@dataclass
class Effectiveness:
    """Per fact of one method: located-site effect, mean random-site effect, their difference, and
    the share of random draws below the located effect.  NaN where the site or effects are missing."""

    example_ids: np.ndarray
    located: np.ndarray
    random: np.ndarray
    net: np.ndarray
    beats_random: np.ndarray


def effectiveness(sites: Sites, effects: pa.Table) -> Effectiveness:
    """Intervention effectiveness of ``sites`` from a ``site_effects`` table (columns example_id,
    component, layer, random (bool), effect; one mode)."""
    d = effects.to_pydict()
    loc: dict[tuple[int, str, int], float] = {}
    rnd: dict[tuple[int, str], list[float]] = {}
    for e, c, layer, r, eff in zip(d["example_id"], d["component"], d["layer"], d["random"], d["effect"]):
        if r:
            rnd.setdefault((int(e), str(c)), []).append(float(eff))
        else:
            loc[(int(e), str(c), int(layer))] = float(eff)
    n = len(sites.example_ids)
    located, random_, beats = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    for i, (e, c, layer) in enumerate(zip(sites.example_ids, sites.component, sites.layer)):
        if c == "" or layer < 0:
            continue
        v = loc.get((int(e), str(c), int(layer)))
        draws = rnd.get((int(e), str(c)), [])
        if v is None or not draws:
            continue
        located[i] = v
        random_[i] = float(np.mean(draws))
        beats[i] = float(np.mean(np.asarray(draws) < v))
    return Effectiveness(sites.example_ids, located, random_, located - random_, beats)


# ------------------------------------------------------------------------------------ summaries


@dataclass(frozen=True)
class Summary:
    n: int
    value: float
    low: float
    high: float


def summarise(values: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> Summary:
    """Mean of the finite ``values`` with its percentile bootstrap 95% interval."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return Summary(0, float("nan"), float("nan"), float("nan"))
    lo, hi = bootstrap_interval(v, np.mean, n_resamples=resamples, seed=seed)
    return Summary(int(v.size), float(v.mean()), lo, hi)


def paired_correlation(a: np.ndarray, b: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> Summary:
    """Pearson r of the pairs where both are finite, with a paired percentile bootstrap interval
    (scipy.stats.bootstrap, ``paired=True``); NaN with fewer than 3 pairs or no spread."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    m = np.isfinite(a) & np.isfinite(b)
    x, y = a[m], b[m]
    r, _ = pearson(x, y) if x.size >= 2 else (float("nan"), float("nan"))
    if x.size < 3 or not np.isfinite(r):
        return Summary(int(x.size), float(r), float("nan"), float("nan"))

    def stat(u: np.ndarray, w: np.ndarray, axis: int = -1) -> np.ndarray:
        u = u - u.mean(axis=axis, keepdims=True)
        w = w - w.mean(axis=axis, keepdims=True)
        den = np.sqrt((u * u).sum(axis=axis) * (w * w).sum(axis=axis))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray((u * w).sum(axis=axis) / den)

    with warnings.catch_warnings():  # a resample without spread has no r; scipy says so once per call
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap(
            (x, y),
            stat,
            paired=True,
            vectorized=True,
            n_resamples=resamples,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Summary(int(x.size), float(r), lo, hi)


def pair_agreement(ra: MethodReading, rb: MethodReading, tolerance: int) -> dict[str, np.ndarray]:
    """Per fact both read: ``key`` (key layers within ``tolerance``), ``exact`` (equal key layers),
    ``verdict`` (equal verdicts; NaN where either has none), as 1.0 / 0.0, and the fact ids."""
    common = np.intersect1d(ra.example_ids, rb.example_ids)
    ia, ib = np.searchsorted(ra.example_ids, common), np.searchsorted(rb.example_ids, common)
    ka, kb = ra.key_layer[ia], rb.key_layer[ib]
    ok = (ka >= 0) & (kb >= 0)
    va, vb = ra.verdict[ia], rb.verdict[ib]
    vok = np.isin(va, COMPONENTS) & np.isin(vb, COMPONENTS)
    return {
        "example_ids": common,
        "key": np.where(ok, (np.abs(ka - kb) <= tolerance).astype(float), np.nan),
        "exact": np.where(ok, (ka == kb).astype(float), np.nan),
        "verdict": np.where(vok, (va == vb).astype(float), np.nan),
    }


def reading_agreement(
    ra: MethodReading, rb: MethodReading, tolerance: int, resamples: int = RESAMPLES, seed: int = 0
) -> dict[str, Summary]:
    """How far two readings of the same facts agree, e.g. one method under two settings (tracing with
    2 and with 10 noise samples): over the facts both read, the shares ``key`` (key layers within
    ``tolerance``), ``exact`` and ``verdict`` as in :func:`pair_agreement`, ``key_distance`` (mean
    absolute difference of the key layers, facts where both have one) and ``profile_r`` (mean over
    facts of the Pearson r of the two per-layer profiles, on the layers where both are finite; NaN
    for a fact with fewer than 3 such layers or a flat profile), each with its percentile bootstrap
    95% interval over facts."""
    ag = pair_agreement(ra, rb, tolerance)
    common = ag["example_ids"]
    ia, ib = np.searchsorted(ra.example_ids, common), np.searchsorted(rb.example_ids, common)
    ka, kb = ra.key_layer[ia], rb.key_layer[ib]
    dist = np.where((ka >= 0) & (kb >= 0), np.abs(ka - kb).astype(float), np.nan)
    prof_r = np.asarray([pearson(ra.profile[i], rb.profile[j])[0] for i, j in zip(ia, ib)], dtype=np.float64)
    values = {
        "key": ag["key"],
        "exact": ag["exact"],
        "verdict": ag["verdict"],
        "key_distance": dist,
        "profile_r": prof_r,
    }
    return {name: summarise(v, resamples, seed) for name, v in values.items()}


def consensus(readings: Sequence[MethodReading], tolerance: int) -> np.ndarray:
    """Per fact every method reads with a key layer: 1.0 when all key layers lie within ``tolerance``."""
    common, keys = common_keys(readings)
    if common.size == 0:
        return np.zeros(0)
    defined = (keys >= 0).all(axis=0)
    spread = keys.max(axis=0) - keys.min(axis=0)
    return (spread[defined] <= tolerance).astype(float)


# ------------------------------------------------------------------------------------ the tables


# ------------------------------------------------------------------------------------ from a store
