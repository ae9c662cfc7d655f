"""A finished method study re-read against chance, from its stored runs only (no tracing, patching or
intervention is run again): the readings as the study reads them (:func:`actstore.query.methods.study.study_readings`),
the key-layer variants of :mod:`actstore.query.methods.keys`, the metrics of
:func:`actstore.query.methods.tables.compute_metrics` (pairs with their chance level, kappa and excess;
effect correlations raw, relative, log-odds and partial) for both intervention modes, on all traced
facts and on the facts ROME's filter keeps (:func:`actstore.query.methods.study.rome_filter`), and the
same pairs against the within-relation null.  ``actstore study chance`` runs it on a study's state.

    figures = reread_study(store, StudyRuns(trace_runs, patch_runs, {"knockout": effects_run}), ["trace", "patch"])
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from actstore.core.errors import MethodsError
from actstore.query.analyses.corpus_lens import load_corpus_lens
from actstore.query.analyses.lens_methods import CORPUS_PREFIX
from actstore.query.analyses.tuned_lens import TrainConfig
from actstore.query.methods.agreement import default_tolerance
from actstore.query.methods.chance import (
    PERMUTATIONS,
    RESAMPLES,
    coded_chance,
    consensus_chance,
    group_codes,
    pair_chance,
)
from actstore.query.methods.keys import (
    lens_variant_readings,
    patch_position_readings,
    trace_centre_reading,
    trace_window,
    window_kernel,
)
from actstore.query.methods.metrics import subset_reading
from actstore.query.methods.readings import MethodReading, stored_outputs
from actstore.query.methods.study import (
    ROME_THRESHOLD,
    rome_filter,
    store_strata,
    study_readings,
    trace_clean_probabilities,
    trace_total_effects,
)
from actstore.query.methods.tables import compute_metrics

SUBSTITUTES = {  # variant -> the base method it stands in for
    "trace@centre": "trace",
    "patch@subject_last": "patch",
    "patch@last": "patch",
    "logit_lens@top10": "logit_lens",
    "logit_lens@half": "logit_lens",
    "tuned_lens@top10": "tuned_lens",  # (with tuned = corpus:STORE: the lens is a stored object)
    "tuned_lens@half": "tuned_lens",
}


def _row(a: str, b: str, metric: str, figure: Any) -> dict[str, Any]:
    """A row of the re-read's tables: the two methods, the metric and the figure's fields."""
    return {"method_a": a, "method_b": b, "metric": metric, **figure.__dict__}


@dataclass(frozen=True)
class StudyRuns:
    """The runs of a study that a re-read reads: trace and patch runs, and the site-effect run of each
    intervention mode (``knockout``, ``restore``)."""

    trace_runs: Sequence[str]
    patch_runs: Sequence[str] = ()
    effect_runs: Mapping[str, str] = field(default_factory=dict)


def _variants(
    store: Any,
    runs: StudyRuns,
    readings: Mapping[str, MethodReading],
    tuned: str | None,
    other_trace_runs: Sequence[str] | None,
) -> tuple[int, dict[str, MethodReading]]:
    """The trace runs' window and the key-layer variants of the readings."""
    L = store.geometry.n_layers
    window = trace_window(store, list(runs.trace_runs))
    variants = {"trace@centre": trace_centre_reading(readings["trace"], window, L)}
    if "patch" in readings:
        variants.update(patch_position_readings(store, list(runs.patch_runs)))
    lenses = [m for m in ("logit_lens", "tuned_lens") if m in readings]
    # both lenses read the same facts (study_readings reads them from one StoredOutputs): read them once
    out = stored_outputs(store, readings[lenses[0]].example_ids) if lenses else None
    if out is not None and "logit_lens" in readings:
        variants.update(lens_variant_readings(store, out, readings["logit_lens"]))
    corpus = tuned is not None and tuned.startswith(CORPUS_PREFIX)
    if out is not None and corpus and "tuned_lens" in readings:  # the same two keys through the translators
        lens = load_corpus_lens(str(tuned), store)
        variants.update(lens_variant_readings(store, out, readings["tuned_lens"], tuned=lens))
    if other_trace_runs:  # another study's trace runs on the same store (another window), on these facts
        w = trace_window(store, list(other_trace_runs))
        if w == window:
            raise MethodsError(f"also_trace: its trace runs have this study's window ({w})")
        r = subset_reading(
            study_readings(store, ["trace"], other_trace_runs, [])["trace"], readings["trace"].example_ids
        )
        variants[f"trace@w{w}"] = replace(r, method=f"trace@w{w}")
    return window, variants


def _variant_rows(
    rs: Mapping[str, MethodReading],
    vs: Mapping[str, MethodReading],
    null: Mapping[int, str] | None,
    tol: int,
    window: int,
    n_layers: int,
    permutations: int,
    resamples: int,
) -> list[dict[str, Any]]:
    """Each variant against every base method but its own and against the other variants; the other
    methods' keys inside the trace key's window; the consensus with a variant in place of its method."""
    rows = []
    every = {**rs, **vs}
    for x, y in itertools.combinations(list(every), 2):
        if SUBSTITUTES.get(x, x) == SUBSTITUTES.get(y, y) or (x in rs and y in rs):
            continue
        ch = pair_chance(every[x], every[y], tol, null, permutations, resamples)
        for metric in ("key_layer", "key_layer_exact", "verdict"):
            rows.append(_row(x, y, metric, ch[metric]))
    tr = rs["trace"]
    kernel = window_kernel(window, n_layers)
    for other in [m for m in every if SUBSTITUTES.get(m, m) != "trace"]:
        o = every[other]
        common = np.intersect1d(tr.example_ids, o.example_ids)
        kt = tr.key_layer[np.searchsorted(tr.example_ids, common)]
        ko = o.key_layer[np.searchsorted(o.example_ids, common)]
        ok = (kt >= 0) & (ko >= 0)
        groups = (
            group_codes([null.get(int(i), "") for i in common[ok]])
            if null
            else np.zeros(int(ok.sum()), np.int64)
        )
        f = coded_chance(kt[ok], ko[ok], groups, kernel, permutations, resamples)
        rows.append(_row("trace", other, "in_trace_window", f))
    for v, base in SUBSTITUTES.items():
        if base not in rs:
            continue
        group = [vs[v] if m == base else r for m, r in rs.items()]
        f = consensus_chance(group, tol, null, permutations, resamples)
        rows.append(_row("all", f"all, {v} for {base}", "consensus", f))
    return rows


def reread_study(
    store: Any,
    runs: StudyRuns,
    methods: Sequence[str],
    *,
    tuned: str | None = None,
    tuned_config: TrainConfig | None = None,
    other_trace_runs: Sequence[str] | None = None,
    threshold: float = ROME_THRESHOLD,
    permutations: int = PERMUTATIONS,
    resamples: int = RESAMPLES,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every figure of the re-read (the module docstring) as one JSON-ready dict: the readings and
    their key-layer medians, the tuned lens's record, ROME's filter, and per subset (``all``,
    ``rome``) the pairs and methods of each mode, the variants, the within-relation null and the
    strata of the null.  ``methods`` must hold ``trace``; ``tuned`` (adam, sgd, ridge or
    ``corpus:STORE[#RUN]``) adds the tuned lens, fit with ``tuned_config``; ``other_trace_runs``
    (trace runs of another window) adds the variant ``trace@wN``."""
    say = log or (lambda message: None)
    t0 = time.time()
    if "trace" not in methods:
        raise MethodsError("a re-read needs the trace method")
    wanted = list(methods) + (["tuned_lens"] if tuned and "tuned_lens" not in methods else [])
    L = store.geometry.n_layers
    tol = default_tolerance(L)
    readings = study_readings(
        store, wanted, runs.trace_runs, runs.patch_runs, tuned=tuned or "adam", tuned_config=tuned_config
    )
    say(
        "readings: "
        + ", ".join(f"{m} {len(r.example_ids)}" for m, r in readings.items())
        + f" ({time.time() - t0:.0f}s)"
    )
    window, variants = _variants(store, runs, readings, tuned, other_trace_runs)
    say(f"variants ({time.time() - t0:.0f}s)")
    ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    strata = store_strata(store, ids)
    te = trace_total_effects(store, runs.trace_runs)
    p_clean = trace_clean_probabilities(store, runs.trace_runs)
    rome = rome_filter(te, strata.get("stratum", {}), threshold)
    effects = {
        mode: store.sql("SELECT * EXCLUDE (run_id) FROM site_effects WHERE run_id = ?", [run])
        for mode, run in runs.effect_runs.items()
        if run
    }
    null = strata.get("stratum")
    every = {**readings, **variants}
    result: dict[str, Any] = {
        "model": store.manifest.model.get("name"),
        "n_layers": L,
        "tolerance": tol,
        "window": window,
        "permutations": permutations,
        "resamples": resamples,
        "readings": {m: int(len(r.example_ids)) for m, r in every.items()},
        "key_layer_median": {m: float(np.median(r.key_layer[r.key_layer >= 0])) for m, r in every.items()},
        "key_layer_distinct": {
            m: int(np.unique(r.key_layer[r.key_layer >= 0]).size) for m, r in every.items()
        },
        "tuned_lens": readings["tuned_lens"].info if "tuned_lens" in readings else None,
        "rome_filter": {
            "threshold": rome.threshold,
            "facts": int(len(te)),
            "removed": int(rome.removed.size),
            "removed_ids": rome.removed.tolist(),
            "removed_per_stratum": rome.removed_per_stratum,
            "strata": len(rome.facts_per_stratum),
        },
    }
    for subset, keep in (("all", ids), ("rome", rome.kept)):
        rs = {m: subset_reading(r, keep) for m, r in readings.items()}
        vs = {m: subset_reading(r, keep) for m, r in variants.items()}
        block: dict[str, Any] = {}
        for mode, eff in effects.items():
            res = compute_metrics(
                list(rs.values()), strata, tol, eff, resamples, p_clean=p_clean, permutations=permutations
            )
            block[mode] = {
                "pairs": res.pairs.to_pylist(),
                "null_grouping": res.null_grouping,
                "methods": [r for r in res.metrics.to_pylist() if r["grouping"] == "all"],
            }
            say(f"{subset} / {mode}: metrics ({time.time() - t0:.0f}s)")
        block["variants"] = _variant_rows(rs, vs, null, tol, window, L, permutations, resamples)
        # the same pairs against two other nulls: shuffles within relations, and over all facts
        # (the latter is kappa's p_e, in every row as chance_pooled)
        rel = strata.get("relation")
        pooled = consensus_chance(list(rs.values()), tol, rel, permutations, resamples)
        block["relation_null"] = [
            _row(x, y, m, f)
            for x, y in itertools.combinations(list(rs), 2)
            for m, f in pair_chance(rs[x], rs[y], tol, rel, permutations, resamples).items()
        ] + [_row("all", "all", "consensus", pooled)]
        sizes = (
            np.bincount(group_codes([null.get(int(i), "") for i in keep])) if null else np.array([len(keep)])
        )
        block["stratum_sizes"] = {
            "strata": int(sizes.size),
            "single_fact_strata": int((sizes == 1).sum()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
        }
        block["n_facts"] = int(len(keep))
        result[subset] = block
    result["seconds"] = time.time() - t0
    return result
