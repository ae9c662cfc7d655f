"""The method-comparison study's readings from a store: every method's reading of the facts a study
traced and patched, and the strata (relation, subject frequency, uniqueness, source set) of those facts."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.errors import MethodsError
from actstore.query.analyses.lens_methods import check_tuned_method
from actstore.query.analyses.tuned_lens import TrainConfig
from actstore.query.methods.defaults import PLATEAU
from actstore.query.methods.metrics import concat_readings
from actstore.query.methods.probe import LayerProbeConfig, probe_reading
from actstore.query.methods.readings import (
    MethodReading,
    attention_reading,
    fact_ids,
    lens_reading,
    patch_reading,
    stored_outputs,
    trace_reading,
    tuned_lens_reading,
)

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
    on the facts not compared, as ``agree`` fits it (:func:`actstore.query.methods.readings.tuned_lens_reading`:
    ``tuned`` = adam, sgd or ridge, ``tuned_config`` default ``COMPARISON_TRAIN``); its reading's
    ``info`` records the fit."""

    if "tuned_lens" in methods:  # before the other readings
        check_tuned_method(tuned)
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

    for r in t:
        e = int(r["example_id"])
        out["relation"][e] = str(r["relation_id"])
        meta = json.loads(r["meta"] or "{}")
        for g in GROUPINGS[1:]:
            if meta.get(g) not in (None, ""):
                out[g][e] = str(meta[g])
    return {g: m for g, m in out.items() if m}


# ------------------------------------------------------------------------------------ ROME's filter

ROME_THRESHOLD = 0.0  # facts whose corruption lowers P(object) by at most this are left out


@dataclass(frozen=True)
class RomeFilter:
    """The facts kept by ROME's filter and how many each stratum lost."""

    threshold: float
    kept: np.ndarray  # example ids, sorted
    removed: np.ndarray  # example ids, sorted
    removed_per_stratum: dict[str, int]  # stratum -> facts removed (strata that lost none absent)
    facts_per_stratum: dict[str, int]  # stratum -> facts before the filter


def _trace_fact_column(store: Any, trace_runs: Sequence[str], column: str) -> dict[int, float]:
    if not trace_runs:
        raise MethodsError("no trace runs named")
    rows = store.sql(
        f"SELECT example_id, {column} AS v, run_id FROM trace_facts WHERE list_contains($runs, run_id) "
        "ORDER BY run_id, example_id",
        {"runs": list(trace_runs)},
    ).to_pylist()
    out: dict[int, float] = {}
    for r in rows:
        out.setdefault(int(r["example_id"]), float(r["v"]))
    return out


def trace_total_effects(store: Any, trace_runs: Sequence[str]) -> dict[int, float]:
    """example id -> total effect TE = p_clean - p_corrupt of its trace (the first run that has it)."""
    return _trace_fact_column(store, trace_runs, "total_effect")


def trace_clean_probabilities(store: Any, trace_runs: Sequence[str]) -> dict[int, float]:
    """example id -> P(object | clean prompt) of its trace (the first run that has it): the p_clean of
    the relative effects (:mod:`actstore.query.methods.effects`)."""
    return _trace_fact_column(store, trace_runs, "p_clean")


def rome_filter(
    total_effect: Mapping[int, float], strata: Mapping[int, str], threshold: float = ROME_THRESHOLD
) -> RomeFilter:
    """Keep the facts whose total effect is above ``threshold`` (ROME traces only facts the noise
    hurts; ours: the threshold is stated, 0 by default); count the removed facts per stratum
    (``strata``: example id -> label; unlabelled facts count under "")."""
    ids = np.asarray(sorted(total_effect), dtype=np.int64)
    te = np.asarray([total_effect[int(i)] for i in ids], dtype=np.float64)
    keep = np.isfinite(te) & (te > threshold)
    removed: dict[str, int] = {}
    per: dict[str, int] = {}
    for i, k in zip(ids, keep):
        s = strata.get(int(i), "")
        per[s] = per.get(s, 0) + 1
        if not k:
            removed[s] = removed.get(s, 0) + 1
    return RomeFilter(
        float(threshold), ids[keep], ids[~keep], dict(sorted(removed.items())), dict(sorted(per.items()))
    )
