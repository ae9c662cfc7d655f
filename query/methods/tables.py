"""The tables of a method-comparison run: per method and stratum (method_metrics), per pair of methods
(method_pair_metrics) and across model sizes (method_cross_size)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.query.analyses.stats import proportion_interval
from actstore.query.methods.chance import PERMUTATIONS, ChanceFigure, consensus_chance, pair_chance
from actstore.query.methods.effects import FORMS, clean_probabilities, effect_forms, partial_correlation
from actstore.query.methods.metrics import (
    RESAMPLES,
    Summary,
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
from actstore.query.methods.readings import SEED_001, SEED_001_CONSENSUS, MethodReading

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


CHANCE_COLUMNS = (
    "chance",
    "chance_low",
    "chance_high",
    "null_low",
    "null_high",
    "p_value",
    "excess",
    "excess_low",
    "excess_high",
    "kappa",
    "kappa_low",
    "kappa_high",
    "chance_pooled",
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
    # agreement against chance (actstore.query.methods.chance); null on the effect rows
    + [(c, pa.float64()) for c in CHANCE_COLUMNS]
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
    null_grouping: str = ""  # the grouping whose strata the permutation null shuffles within ("" : all facts)


def compute_metrics(
    readings: Sequence[MethodReading],
    strata: Mapping[str, Mapping[int, str]],
    tolerance: int,
    effects: pa.Table | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
    p_clean: Mapping[int, float] | None = None,
    null_grouping: str = "stratum",
    permutations: int = PERMUTATIONS,
) -> MetricsResult:
    """The metrics of every reading, overall and per group of each grouping in ``strata`` (a
    grouping name, e.g. ``relation`` or ``freq_band``, -> example id -> group label), the pairwise
    agreement with intervals and, when ``effects`` (a ``site_effects`` table of one mode) is given,
    intervention effectiveness and the effect correlation between methods.  Consistency is computed
    within the groups of the ``relation`` grouping when there is one (else of the first grouping)
    and summarised like the other metrics.

    Effects are read in the forms of :mod:`actstore.query.methods.effects` (raw, relative to
    ``p_clean``: example id -> P(o | clean), by default the knock-out rows' ``p_base``; log-odds):
    ``located_effect``/``effectiveness`` are the raw form, ``..._relative`` and ``..._logodds`` the
    others.  Every agreement row carries its chance level, permutation null, excess and kappa
    (:mod:`actstore.query.methods.chance`, ``permutations`` shuffles within the groups of
    ``null_grouping``, else of ``relation``, else of all facts)."""
    rows: list[dict[str, Any]] = []
    forms = effect_forms(effects, p_clean) if effects is not None else {}
    pc = (
        dict(p_clean)
        if p_clean is not None
        else (clean_probabilities(effects) if effects is not None else {})
    )
    grouping = next((g for g in (null_grouping, "relation") if g in strata), "")
    null_strata = strata.get(grouping) if grouping else None
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
        for form, table in forms.items():
            eff = effectiveness(located_sites(r), table)
            if form == "raw":
                f.update(
                    {
                        "located_effect": eff.located,
                        "random_effect": eff.random,
                        "effectiveness": eff.net,
                        "beats_random": eff.beats_random,
                    }
                )
            else:
                f.update({f"located_effect_{form}": eff.located, f"effectiveness_{form}": eff.net})
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
                        {"method": r.method, "grouping": grouping, "group": g, "metric": name, **asdict(s)}
                    )
    pair_rows: list[dict[str, Any]] = []

    def add(
        a: str, b: str, metric: str, s: Summary, paper: float | None, ch: ChanceFigure | None = None
    ) -> None:
        row: dict[str, Any] = {"method_a": a, "method_b": b, "metric": metric, **asdict(s), "paper": paper}
        row.update(ch.columns() if ch is not None else dict.fromkeys(CHANCE_COLUMNS))
        pair_rows.append(row)

    by = {r.method: r for r in readings}
    for a, b in itertools.combinations([r.method for r in readings], 2):
        ag = pair_agreement(by[a], by[b], tolerance)
        chance = pair_chance(by[a], by[b], tolerance, null_strata, permutations, resamples, seed)
        seed_fig = SEED_001.get((a, b)) or SEED_001.get((b, a))
        for metric, key, paper in (
            ("key_layer", "key", seed_fig[0] / 100 if seed_fig else None),
            ("key_layer_exact", "exact", None),
            ("verdict", "verdict", seed_fig[1] / 100 if seed_fig else None),
        ):
            add(a, b, metric, summarise(ag[key], resamples, seed), paper, chance[metric])
        if effects is not None:
            fa, fb = per_fact[a], per_fact[b]
            common = np.intersect1d(fa["example_ids"], fb["example_ids"])
            ia, ib = np.searchsorted(fa["example_ids"], common), np.searchsorted(fb["example_ids"], common)
            for form in FORMS:
                name = "located_effect" if form == "raw" else f"located_effect_{form}"
                if name not in fa:
                    continue
                s = paired_correlation(fa[name][ia], fb[name][ib], resamples, seed)
                metric = "effect_correlation" if form == "raw" else f"effect_correlation_{form}"
                add(a, b, metric, s, seed_fig[2] if seed_fig and form == "raw" else None)
            if pc:
                clean = np.asarray([pc.get(int(i), np.nan) for i in common], dtype=np.float64)
                s = partial_correlation(
                    fa["located_effect"][ia], fb["located_effect"][ib], clean, resamples, seed
                )
                add(a, b, "effect_partial_correlation", s, None)
    if len(readings) >= 2:
        s = summarise(consensus(readings, tolerance), resamples, seed)
        ch = consensus_chance(readings, tolerance, null_strata, permutations, resamples, seed)
        add("all", "all", "consensus", s, SEED_001_CONSENSUS / 100, ch)
    return MetricsResult(
        pa.Table.from_pylist(rows, schema=METRICS),
        pa.Table.from_pylist(pair_rows, schema=PAIRS),
        per_fact,
        grouping,
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
    """The ACL 2025 method study's cross-size figures for one model: key MLP layer as a share of depth (at the
    subject's last token, ``subject_site`` from :func:`actstore.query.methods.readings.key_mlp_at_subject`, and over
    all positions from the tracing MLP profile), the MLP and attention shares of the causal effect
    (tracing: peak windowed-MLP effect / (peak MLP + peak attention), positive parts; patching:
    positive recovery summed over layers, likewise), and the recall success rate (facts answered /
    facts, with a Wilson interval)."""

    rows: list[dict[str, Any]] = []

    def add(metric: str, vals: np.ndarray) -> None:
        v = np.asarray(vals, dtype=np.float64)
        v = v[np.isfinite(v)]
        s = summarise(v, resamples, seed)
        q25, q75 = (float(np.quantile(v, 0.25)), float(np.quantile(v, 0.75))) if v.size else (np.nan, np.nan)
        rows.append(
            {"model": model, "n_layers": n_layers, "metric": metric, **asdict(s), "q25": q25, "q75": q75}
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
