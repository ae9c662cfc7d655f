"""Run the method comparison (``actstore agree``): every method's reading of the store's facts,
their pairwise agreement, and the result tables.

    cfg = AgreeConfig(methods=("trace", "patch", "logit_lens"), runs=("trace-2026...",))
    out = run_agreement(store, cfg)
    out.result["pairs"]                       # per pair of methods: key-layer and verdict agreement
    out.run_id, out.tables                    # written unless cfg.save is False

The tuned lens is trained with Adam on the KL (``cfg.tuned``; ``ridge`` is the closed-form fit) on
the store's facts that are not compared, ``cfg.steps`` steps of ``cfg.batch`` facts;
``result["tuned_lens"]`` and the run's config record how.

The settings, ``AgreeConfig``, are in :mod:`actstore.jobs.settings`; the definitions of each reading
in :mod:`actstore.query.methods.readings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from actstore.core.errors import MethodsError
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.jobs.settings import AgreeConfig
from actstore.query.analyses.lens_methods import CORPUS_PREFIX
from actstore.query.methods.agreement import agreement, agreement_table, default_tolerance
from actstore.query.methods.probe import LayerProbeConfig, probe_reading
from actstore.query.methods.readings import (
    COMPARISON_TRAIN,
    MethodReading,
    attention_reading,
    causal_shares,
    fact_ids,
    key_mlp_at_subject,
    latest_run,
    lens_reading,
    patch_reading,
    stored_outputs,
    trace_reading,
    tuned_lens_reading,
)
from actstore.query.methods.study import store_strata

Log = Callable[[str], None]


@dataclass
class AgreeOutcome:
    run_id: str
    result: dict[str, Any]  # JSON-ready: pairs, consensus, causal shares, per-method summaries
    readings: list[MethodReading]
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def split_runs(store: StoreReader, runs: Sequence[str]) -> tuple[str | None, str | None]:
    """(trace run, patch run) among ``runs``: each id is looked up in ``trace_effects`` and
    ``patch_effects``; an id in neither is an error.  None where no id names a run of that table."""
    found: dict[str, str] = {}
    files = store.table_files()
    have = {
        kind: set(store.sql(f"SELECT DISTINCT run_id FROM {table}").column("run_id").to_pylist())
        if table in files
        else set()
        for table, kind in (("trace_effects", "trace"), ("patch_effects", "patch"))
    }
    for run in runs:
        hit = next((kind for kind, ids in have.items() if run in ids), None)
        if hit is None:
            raise MethodsError(f"{store.url}: no run {run!r} in trace_effects or patch_effects")
        if hit in found and found[hit] != run:
            raise MethodsError(f"two {hit} runs given ({found[hit]}, {run}); compare one of each")
        found[hit] = run
    return found.get("trace"), found.get("patch")


def run_agreement(
    store: StoreReader,
    cfg: AgreeConfig,
    log: Log | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> AgreeOutcome:
    """Read each method of ``cfg.methods`` over the store's facts and compare their key layers and
    verdicts; write ``method_readings``, ``method_agreement`` and a ``runs`` row unless
    ``cfg.save`` is False, and the profile curves when ``cfg.figures`` names a folder.
    ``progress(step, loss)`` is called while the tuned lens trains."""
    say = log or (lambda m: None)
    train = replace(COMPARISON_TRAIN, steps=cfg.steps, batch=cfg.batch, seed=cfg.seed)
    if "tuned_lens" in cfg.methods and cfg.tuned != "ridge":
        train.check()
    started = time.time()
    trace_run, patch_run = split_runs(store, cfg.runs)
    trace_run, patch_run = cfg.trace_run or trace_run, cfg.patch_run or patch_run
    wanted = list(cfg.methods)
    L = store.geometry.n_layers
    tol = default_tolerance(L) if cfg.tolerance is None else cfg.tolerance
    readings: dict[str, MethodReading] = {}
    if "trace" in wanted:
        readings["trace"] = trace_reading(store, trace_run, cfg.plateau)
    if "patch" in wanted:
        readings["patch"] = patch_reading(store, patch_run, cfg.plateau)
    if readings:
        ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    else:
        ids = fact_ids(store, None, correct_only=True)
    if ids.size == 0:
        raise MethodsError(f"{store.url}: no facts to compare")
    say(f"{ids.size} facts; reading the store")
    out = stored_outputs(store, ids)
    extra: dict[str, Any] = {"sublayers_additive": out.additive}
    if "logit_lens" in wanted:
        readings["logit_lens"] = lens_reading(store, out, plateau=cfg.plateau)
    if "tuned_lens" in wanted:
        say(
            f"tuned lens: the translators stored by {cfg.tuned}"
            if cfg.tuned.startswith(CORPUS_PREFIX)
            else f"tuned lens ({cfg.tuned}): fitting on the facts not compared"
        )
        readings["tuned_lens"] = tuned_lens_reading(store, out, cfg.tuned, train, cfg.plateau, progress)
        extra["tuned_lens"] = readings["tuned_lens"].info
        extra["tuned_lens_train_facts"] = readings["tuned_lens"].info["train_facts"]
    if "attention" in wanted:
        readings["attention"] = attention_reading(store, out, cfg.plateau)
    if "probe" in wanted:
        say("probes: cross-validated object probes on every residual index")
        readings["probe"], extra["probe"] = probe_reading(
            store, out, LayerProbeConfig(min_count=cfg.probe_min_count, folds=cfg.probe_folds), cfg.plateau
        )
    ordered = [readings[m] for m in wanted]
    # the permutation null shuffles facts within their methods2k stratum (else their relation), their
    # relation, or all together (cfg.null_grouping)
    strata = store_strata(store, ids)
    order = {"stratum": ("stratum", "relation"), "relation": ("relation",), "none": ()}[cfg.null_grouping]
    grouping = next((g for g in order if g in strata), "")
    result = agreement(
        ordered, tol, strata.get(grouping) if grouping else None, permutations=cfg.permutations
    )
    result["null_grouping"] = grouping
    if "trace" in readings:
        result["causal_shares"] = causal_shares(
            readings["trace"], readings.get("patch"), L, key_mlp_at_subject(store, trace_run)
        )
    result.update(extra)
    result["n_layers"] = L
    result["plateau"] = cfg.plateau
    result["model"] = store.manifest.model.get("name")
    result["verdict_mlp_share"] = {
        r.method: (float(np.mean(r.verdict[r.verdict != ""] == "mlp")) if (r.verdict != "").any() else None)
        for r in ordered
    }
    result["key_layer_median"] = {
        r.method: float(np.median(r.key_layer[r.key_layer >= 0])) if (r.key_layer >= 0).any() else None
        for r in ordered
    }
    result["n_facts"] = {r.method: int(len(r.example_ids)) for r in ordered}
    result["tolerance"] = tol
    run_id = new_run_id("agree")
    outcome = AgreeOutcome(run_id, result, ordered)
    if cfg.save:
        import pyarrow as pa

        tables = {
            "method_readings": pa.concat_tables([r.table() for r in ordered]),
            "method_agreement": agreement_table(result),
        }
        used = {
            "trace": latest_run(store, "trace_effects", trace_run) if "trace" in readings else trace_run,
            "patch": latest_run(store, "patch_effects", patch_run) if "patch" in readings else patch_run,
        }
        config = {
            "trace_run": used["trace"],
            "patch_run": used["patch"],
            "methods": wanted,
            "tolerance": tol,
            "plateau": cfg.plateau,
            "tuned_lens": extra.get("tuned_lens"),
        }
        outcome.tables += record_run(store, "agree", config, tables, started=started, run_id=run_id).tables
    if cfg.figures:
        from actstore.query.analyses.plotting import profile_curves

        title = f"{result['model']}: mean per-layer profiles"
        outcome.figures.append(str(profile_curves(ordered, Path(cfg.figures) / "method_profiles.png", title)))
    return outcome
