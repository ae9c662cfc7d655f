"""The tables of a method-comparison run: per method and stratum (method_metrics), per pair of methods
(method_pair_metrics) and across model sizes (method_cross_size)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.query.method_metrics import (
    RESAMPLES,
    consensus,
    consistency,
    effectiveness,
    localisation_precision,
    located_sites,
    pair_agreement,
    paired_correlation,
    positive_part,
    summarise,
)
from actstore.query.methods import SEED_001, SEED_001_CONSENSUS, MethodReading

# The seed's cross-size table (GPT-2 small / medium / large): key MLP layer position (share of
# depth), MLP and attention shares of the causal effect (%), recall success rate (%).
SEED_001_CROSS_SIZE = {
    "GPT-2 Small": {"key_mlp_layer": "50-70%", "mlp_share": 62.3, "attn_share": 37.7, "recall": 45.2},
    "GPT-2 Medium": {"key_mlp_layer": "55-75%", "mlp_share": 58.7, "attn_share": 41.3, "recall": 63.8},
    "GPT-2 Large": {"key_mlp_layer": "60-80%", "mlp_share": 55.2, "attn_share": 44.8, "recall": 78.1},
}


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
        pm = positive_part(np.nanmax(np.where(np.isfinite(trace.mlp), trace.mlp, np.nan), axis=1))
        pa_ = positive_part(np.nanmax(np.where(np.isfinite(trace.attn), trace.attn, np.nan), axis=1))
        ok = (pm + pa_) > 0
        share = np.where(ok, pm / np.where(ok, pm + pa_, 1.0), np.nan)
        add("trace_mlp_share", share)
        add("trace_attn_share", 1 - share)
    if patch is not None and patch.mlp is not None and patch.attn is not None:
        sm, sa = positive_part(patch.mlp).sum(axis=1), positive_part(patch.attn).sum(axis=1)
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
