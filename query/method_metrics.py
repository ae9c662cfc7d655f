"""The seed-001 metrics of interpretability methods on factual recall, per method and per stratum.

Every method's reading (:mod:`actstore.query.methods`: a per-layer profile per fact, a key layer and an
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
                  :mod:`actstore.ingest.interventions.effectiveness`: knock-out = the drop in P(object) when
                  the component's output is zeroed at the layer from the subject's first token to
                  the last token; restore = the gain in P(object) when, with the subject's
                  embeddings noised, the clean output is restored there).  ``located_effect``, and
                  ``beats_random``: the share of random draws whose effect is below the located one.
    effect correlation  between two methods: Pearson r over the facts both read of their
                  located-site effects, with a paired bootstrap interval.

Agreement (key layer within ``tolerance``, verdicts equal, all-method consensus) is computed per
fact as in :func:`actstore.query.methods.agreement` and reported with percentile bootstrap 95% intervals
over facts (:func:`actstore.query.stats.bootstrap_interval`; 2,000 resamples by default).  Every figure
carries its number of facts.  Summaries: the mean over facts with its bootstrap interval.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import MethodsError
from actstore.query.methods import SEED_001, SEED_001_CONSENSUS, MethodReading
from actstore.query.stats import bootstrap_interval, pearson
from actstore.query.tuned_lens import TrainConfig

RESAMPLES = 2000
COMPONENTS = ("mlp", "attn")

# The seed's cross-size table (GPT-2 small / medium / large): key MLP layer position (share of
# depth), MLP and attention shares of the causal effect (%), recall success rate (%).
SEED_001_CROSS_SIZE = {
    "GPT-2 Small": {"key_mlp_layer": "50-70%", "mlp_share": 62.3, "attn_share": 37.7, "recall": 45.2},
    "GPT-2 Medium": {"key_mlp_layer": "55-75%", "mlp_share": 58.7, "attn_share": 41.3, "recall": 63.8},
    "GPT-2 Large": {"key_mlp_layer": "60-80%", "mlp_share": 55.2, "attn_share": 44.8, "recall": 78.1},
}


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


def _positive(x: np.ndarray) -> np.ndarray:
    return np.clip(np.where(np.isfinite(x), x, 0.0), 0.0, None)


def localisation_precision(reading: MethodReading, by_component: bool = True) -> np.ndarray:
    """Per fact (in ``reading.example_ids`` order): the share of the method's positive effect at its
    located site (``by_component``: that layer's verdict component; else both components at the key
    layer).  [n] float, NaN where undefined (see the module docstring)."""
    n = len(reading.example_ids)
    out = np.full(n, np.nan)
    key = reading.key_layer
    if reading.mlp is not None and reading.attn is not None:
        grid = np.stack([_positive(reading.mlp), _positive(reading.attn)], axis=1)  # [n, 2, L]
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
    prof = _positive(reading.profile)
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
    from scipy import stats

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
    common = readings[0].example_ids
    for r in readings[1:]:
        common = np.intersect1d(common, r.example_ids)
    if common.size == 0:
        return np.zeros(0)
    keys = np.stack([r.key_layer[np.searchsorted(r.example_ids, common)] for r in readings])
    defined = (keys >= 0).all(axis=0)
    spread = keys.max(axis=0) - keys.min(axis=0)
    return (spread[defined] <= tolerance).astype(float)


# ------------------------------------------------------------------------------------ the tables


METRICS = pa.schema(
    [
        ("method", pa.string()),
        ("grouping", pa.string()),
        ("group", pa.string()),
        ("metric", pa.string()),
        ("n", pa.int32()),
        ("value", pa.float64()),
        ("low", pa.float64()),
        ("high", pa.float64()),
    ]
)
PAIRS = pa.schema(
    [
        ("method_a", pa.string()),
        ("method_b", pa.string()),
        ("metric", pa.string()),
        ("n", pa.int32()),
        ("value", pa.float64()),
        ("low", pa.float64()),
        ("high", pa.float64()),
        ("paper", pa.float64()),
    ]
)
CROSS_SIZE = pa.schema(
    [
        ("model", pa.string()),
        ("n_layers", pa.int32()),
        ("metric", pa.string()),
        ("n", pa.int32()),
        ("value", pa.float64()),
        ("low", pa.float64()),
        ("high", pa.float64()),
        ("q25", pa.float64()),
        ("q75", pa.float64()),
    ]
)


@dataclass
class MetricsResult:
    metrics: pa.Table  # METRICS
    pairs: pa.Table  # PAIRS
    per_fact: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # method -> name -> [n]


def compute_metrics(
    readings: Sequence[MethodReading],
    strata: Mapping[str, Mapping[int, str]],
    tolerance: int,
    effects: pa.Table | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> MetricsResult:
    """The metrics of every reading, overall and per group of each grouping in ``strata`` (a
    grouping name, e.g. ``relation`` or ``freq_band``, -> example id -> group label), the pairwise
    agreement with intervals and, when ``effects`` (a ``site_effects`` table of one mode) is given,
    intervention effectiveness and the effect correlation between methods.  Consistency is computed
    within the groups of the ``relation`` grouping when there is one (else of the first grouping)
    and summarised like the other metrics."""
    rows: list[dict[str, Any]] = []
    per_fact: dict[str, dict[str, np.ndarray]] = {}
    home = "relation" if "relation" in strata else next(iter(strata), None)
    for r in readings:
        f: dict[str, np.ndarray] = {
            "example_ids": r.example_ids,
            "precision": localisation_precision(r, True),
            "layer_precision": localisation_precision(r, False),
        }
        if home is not None:
            f["consistency"], f["verdict_consistency"] = consistency(r, strata[home], tolerance)
        if effects is not None:
            eff = effectiveness(located_sites(r), effects)
            f.update(
                {
                    "located_effect": eff.located,
                    "random_effect": eff.random,
                    "effectiveness": eff.net,
                    "beats_random": eff.beats_random,
                }
            )
        per_fact[r.method] = f
        groupings: dict[str, Mapping[int, str]] = {"all": {int(i): "all" for i in r.example_ids}, **strata}
        for grouping, labels in groupings.items():
            lab = np.asarray([labels.get(int(i), None) for i in r.example_ids], dtype=object)
            for g in sorted({x for x in lab if x is not None}):
                m = lab == g
                for name, vals in f.items():
                    if name == "example_ids":
                        continue
                    s = summarise(vals[m], resamples, seed)
                    rows.append(
                        {
                            "method": r.method,
                            "grouping": grouping,
                            "group": g,
                            "metric": name,
                            "n": s.n,
                            "value": s.value,
                            "low": s.low,
                            "high": s.high,
                        }
                    )
    pair_rows: list[dict[str, Any]] = []
    by = {r.method: r for r in readings}
    for a, b in itertools.combinations([r.method for r in readings], 2):
        ag = pair_agreement(by[a], by[b], tolerance)
        seed_fig = SEED_001.get((a, b)) or SEED_001.get((b, a))
        for metric, paper in (
            ("key_layer", seed_fig[0] / 100 if seed_fig else None),
            ("key_layer_exact", None),
            ("verdict", seed_fig[1] / 100 if seed_fig else None),
        ):
            s = summarise(
                ag[{"key_layer": "key", "key_layer_exact": "exact", "verdict": "verdict"}[metric]],
                resamples,
                seed,
            )
            pair_rows.append(
                {
                    "method_a": a,
                    "method_b": b,
                    "metric": metric,
                    "n": s.n,
                    "value": s.value,
                    "low": s.low,
                    "high": s.high,
                    "paper": paper,
                }
            )
        if effects is not None:
            fa, fb = per_fact[a], per_fact[b]
            common = np.intersect1d(fa["example_ids"], fb["example_ids"])
            ea = fa["located_effect"][np.searchsorted(fa["example_ids"], common)]
            eb = fb["located_effect"][np.searchsorted(fb["example_ids"], common)]
            s = paired_correlation(ea, eb, resamples, seed)
            pair_rows.append(
                {
                    "method_a": a,
                    "method_b": b,
                    "metric": "effect_correlation",
                    "n": s.n,
                    "value": s.value,
                    "low": s.low,
                    "high": s.high,
                    "paper": seed_fig[2] if seed_fig else None,
                }
            )
    if len(readings) >= 2:
        s = summarise(consensus(readings, tolerance), resamples, seed)
        pair_rows.append(
            {
                "method_a": "all",
                "method_b": "all",
                "metric": "consensus",
                "n": s.n,
                "value": s.value,
                "low": s.low,
                "high": s.high,
                "paper": SEED_001_CONSENSUS / 100,
            }
        )
    return MetricsResult(
        pa.Table.from_pylist(rows, schema=METRICS), pa.Table.from_pylist(pair_rows, schema=PAIRS), per_fact
    )


def cross_size_rows(
    model: str,
    n_layers: int,
    trace: MethodReading | None,
    patch: MethodReading | None,
    subject_site: np.ndarray | None,
    answered: int,
    facts: int,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> pa.Table:
    """The seed's cross-size figures for one model: key MLP layer as a share of depth (at the
    subject's last token, ``subject_site`` from :func:`actstore.query.methods.key_mlp_at_subject`, and over
    all positions from the tracing MLP profile), the MLP and attention shares of the causal effect
    (tracing: peak windowed-MLP effect / (peak MLP + peak attention), positive parts; patching:
    positive recovery summed over layers, likewise), and the recall success rate (facts answered /
    facts, with a Wilson interval)."""
    from actstore.query.stats import proportion_interval

    rows: list[dict[str, Any]] = []

    def add(metric: str, vals: np.ndarray) -> None:
        v = np.asarray(vals, dtype=np.float64)
        v = v[np.isfinite(v)]
        s = summarise(v, resamples, seed)
        q25, q75 = (float(np.quantile(v, 0.25)), float(np.quantile(v, 0.75))) if v.size else (np.nan, np.nan)
        rows.append(
            {
                "model": model,
                "n_layers": n_layers,
                "metric": metric,
                "n": s.n,
                "value": s.value,
                "low": s.low,
                "high": s.high,
                "q25": q25,
                "q75": q75,
            }
        )

    if subject_site is not None:
        add("key_mlp_layer_subject_last", subject_site)
    if trace is not None and trace.mlp is not None and trace.attn is not None:
        q = np.where(np.isfinite(trace.mlp), trace.mlp, -np.inf)
        add("key_mlp_layer_any_position", np.argmax(q, axis=1) / max(1, n_layers - 1))
        pm = _positive(np.nanmax(np.where(np.isfinite(trace.mlp), trace.mlp, np.nan), axis=1))
        pa_ = _positive(np.nanmax(np.where(np.isfinite(trace.attn), trace.attn, np.nan), axis=1))
        ok = (pm + pa_) > 0
        share = np.where(ok, pm / np.where(ok, pm + pa_, 1.0), np.nan)
        add("trace_mlp_share", share)
        add("trace_attn_share", 1 - share)
    if patch is not None and patch.mlp is not None and patch.attn is not None:
        sm, sa = _positive(patch.mlp).sum(axis=1), _positive(patch.attn).sum(axis=1)
        ok = (sm + sa) > 0
        share = np.where(ok, sm / np.where(ok, sm + sa, 1.0), np.nan)
        add("patch_mlp_share", share)
        add("patch_attn_share", 1 - share)
    lo, hi = proportion_interval(answered, facts)
    rows.append(
        {
            "model": model,
            "n_layers": n_layers,
            "metric": "recall_success",
            "n": facts,
            "value": answered / facts if facts else float("nan"),
            "low": lo,
            "high": hi,
            "q25": float("nan"),
            "q75": float("nan"),
        }
    )
    return pa.Table.from_pylist(rows, schema=CROSS_SIZE)


# ------------------------------------------------------------------------------------ from a store


GROUPINGS = ("relation", "freq_band", "uniqueness", "source_set", "stratum")


def study_readings(
    store: Any,
    methods: Sequence[str],
    trace_runs: Sequence[str] = (),
    patch_runs: Sequence[str] = (),
    plateau: float | None = None,
    probe_min_count: int = 5,
    tuned: str = "adam",
    tuned_config: TrainConfig | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, MethodReading]:
    """Each method's reading of the store's traced (and patched) facts, as ``actstore agree`` reads
    them, with the traces of several runs joined (:func:`concat_readings`), and likewise the patches
    of several runs (``patch_runs``, over disjoint facts); no runs named reads the newest run of
    each.  The tuned lens is fit
    on the facts not compared, as ``agree`` fits it (:func:`actstore.query.methods.tuned_lens_reading`:
    ``tuned`` = adam, sgd or ridge, ``tuned_config`` default ``COMPARISON_TRAIN``); its reading's
    ``info`` records the fit."""
    from actstore.core.errors import LensError
    from actstore.query.methods import (
        PLATEAU,
        LayerProbeConfig,
        attention_reading,
        fact_ids,
        lens_reading,
        patch_reading,
        probe_reading,
        stored_outputs,
        trace_reading,
        tuned_lens_reading,
    )
    from actstore.query.readout import TUNED_METHODS

    if "tuned_lens" in methods and tuned not in TUNED_METHODS:  # before the other readings
        raise LensError(f"unknown tuned-lens method {tuned!r} (one of {', '.join(TUNED_METHODS)})")
    plat = PLATEAU if plateau is None else plateau
    out: dict[str, MethodReading] = {}
    if "trace" in methods:
        runs: list[str | None] = list(trace_runs) or [None]
        out["trace"] = concat_readings([trace_reading(store, r, plat) for r in runs])
    if "patch" in methods:
        patches: list[str | None] = list(patch_runs) or [None]
        out["patch"] = concat_readings([patch_reading(store, r, plat) for r in patches])
    ids = (
        np.unique(np.concatenate([r.example_ids for r in out.values()]))
        if out
        else fact_ids(store, None, True)
    )
    if ids.size == 0:
        raise MethodsError(f"{store.url}: no facts to compare")
    so = stored_outputs(store, ids)
    if "logit_lens" in methods:
        out["logit_lens"] = lens_reading(store, so, plateau=plat)
    if "tuned_lens" in methods:
        out["tuned_lens"] = tuned_lens_reading(store, so, tuned, tuned_config, plat, progress)
    if "attention" in methods:
        out["attention"] = attention_reading(store, so, plat)
    if "probe" in methods:
        out["probe"], _ = probe_reading(store, so, LayerProbeConfig(min_count=probe_min_count), plat)
    return {m: out[m] for m in methods if m in out}


def store_strata(store: Any, example_ids: Sequence[int] | np.ndarray) -> dict[str, dict[int, str]]:
    """Grouping -> example id -> label for the facts: ``relation`` (the relation id) and, where the
    examples carry methods2k tags in ``meta``, ``freq_band``, ``uniqueness``, ``source_set``,
    ``stratum``."""
    ids = [int(i) for i in example_ids]
    out: dict[str, dict[int, str]] = {g: {} for g in GROUPINGS}
    if not ids:
        return {"relation": {}}
    t = store.sql(
        "SELECT example_id, relation_id, meta FROM examples WHERE example_id IN "
        f"({', '.join(str(i) for i in ids)})"
    ).to_pylist()
    import json

    for r in t:
        e = int(r["example_id"])
        out["relation"][e] = str(r["relation_id"])
        meta = json.loads(r["meta"] or "{}")
        for g in GROUPINGS[1:]:
            if meta.get(g) not in (None, ""):
                out[g][e] = str(meta[g])
    return {g: m for g, m in out.items() if m}
