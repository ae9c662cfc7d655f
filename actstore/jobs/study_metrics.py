"""The last steps of ``actstore study run``: every method's reading of the traced facts
(:func:`actstore.query.methods.study.study_readings`; the tuned lens fit on the facts not traced and
recorded in the state as ``tuned_lens``), the located sites, the interventions on them and on random
layers (``site_effects``, knock-out and restore, one ``effects`` run per mode, reused while it covers
the same facts: ``effects_<mode>_facts``), and the metrics (:func:`actstore.query.methods.tables.compute_metrics`)
per method, overall and per stratum, the pair table with bootstrap intervals and the cross-size row,
recorded as one ``methods`` run per mode (``method_metrics``, ``method_pair_metrics``,
``method_cross_size``) and written to the summary file."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.interventions.effectiveness import EffectConfig, noise_std_for, site_effects, sites_by_fact
from actstore.interventions.facts import stored_facts
from actstore.interventions.runner import InterventionRunner
from actstore.jobs.methods import record_method_metrics
from actstore.jobs.model import load_store_model, model_for_store
from actstore.jobs.record import record_run
from actstore.jobs.study_settings import StudyRunConfig
from actstore.jobs.study_state import save_state, write_summary
from actstore.query.methods.agreement import default_tolerance
from actstore.query.methods.metrics import located_sites
from actstore.query.methods.readings import COMPARISON_TRAIN, MethodReading, key_mlp_at_subject
from actstore.query.methods.study import store_strata, study_readings, trace_clean_probabilities
from actstore.query.methods.tables import compute_metrics, cross_size_rows
from actstore.query.select.selection import Selection

Log = Callable[[str], None]


def migrate_patch_state(store: StoreReader, state: dict[str, Any]) -> None:
    """States written before incremental patching hold one ``patch_run``: it becomes the first of
    ``patch_runs``, and the facts it patched (read from the store) the first ``patched``; facts it
    skipped for want of a counterfactual are tried again, and skipped again."""
    state.setdefault("patch_runs", [])
    state.setdefault("patched", [])
    old = state.pop("patch_run", None)
    if old and old not in state["patch_runs"]:
        ids = store.sql("SELECT DISTINCT example_id FROM patch_effects WHERE run_id = ? ORDER BY 1", [old])
        state["patch_runs"].insert(0, old)
        state["patched"] = [int(i) for i in ids.column("example_id").to_pylist()] + state["patched"]


def _readings(
    store: StoreReader, cfg: StudyRunConfig, state: dict[str, Any], say: Log
) -> dict[str, MethodReading]:
    methods = list(cfg.methods)
    if not state["patch_runs"] and "patch" in methods:
        methods.remove("patch")
    tuned_config = replace(
        COMPARISON_TRAIN,
        steps=cfg.tuned_steps,
        batch=cfg.tuned_batch,
        lr=cfg.tuned_lr,
        seed=cfg.tuned_seed,
        device=cfg.device,
    )
    t_lens = time.time()

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 25 == 0 or step == cfg.tuned_steps:
            say(
                f"tuned lens ({cfg.tuned}): step {step}/{cfg.tuned_steps}, sum of per-index KL {loss:.4f}, "
                f"{time.time() - t_lens:.0f}s"
            )

    readings = study_readings(
        store,
        methods,
        state["trace_runs"],
        tuned=cfg.tuned,
        tuned_config=tuned_config,
        progress=progress,
        patch_runs=state["patch_runs"],
    )
    if "tuned_lens" in readings:
        state["tuned_lens"] = readings["tuned_lens"].info
        save_state(Path(cfg.state), state)
        tl = state["tuned_lens"]
        say(f"tuned lens ({cfg.tuned}): {tl['train_facts']} training facts, {tl['seconds']:.0f}s")
    say("readings: " + ", ".join(f"{m} {len(r.example_ids)}" for m, r in readings.items()))
    return readings


def _effects(
    store: StoreReader,
    cfg: StudyRunConfig,
    state: dict[str, Any],
    readings: dict[str, MethodReading],
    say: Log,
) -> dict[str, pa.Table]:
    """Mode -> the site effects of the located and random sites (a run of the state reused while it
    covers the same facts)."""
    sites = sites_by_fact(located_sites(r) for r in readings.values())
    ids = [int(i) for i in sorted(sites)]
    effects: dict[str, pa.Table] = {}
    loaded, runner = None, None
    for mode in cfg.modes:
        key = f"effects_{mode}_run"
        if state.get(key) and state.get(f"effects_{mode}_facts") == ids:  # the same facts: reuse the run
            effects[mode] = store.sql(
                "SELECT * EXCLUDE (run_id) FROM site_effects WHERE run_id = ?", [state[key]]
            )
            continue
        if loaded is None or runner is None:
            loaded = load_store_model(store, model_for_store(store, None), quiet=True, device=cfg.device)
            runner = InterventionRunner(loaded.model)
        effect = EffectConfig(mode=mode, random_draws=cfg.random_draws, samples=cfg.samples)
        std = noise_std_for(loaded.model, store, runner, effect.noise_scale) if mode == "restore" else 0.0
        facts = stored_facts(store, Selection.from_ids(store, ids), correct_only=False)
        t0 = time.time()
        table = site_effects(runner, facts, sites, effect, std)
        rid = record_run(
            store,
            "effects",
            {**effect.__dict__, "noise_std": std, "facts": len(facts)},
            {"site_effects": table},
            started=t0,
        ).run_id
        state[key] = rid
        state[f"effects_{mode}_facts"] = ids
        state[f"effects_{mode}_seconds"] = time.time() - t0
        save_state(Path(cfg.state), state)
        effects[mode] = table
        say(
            f"{mode}: {table.num_rows} site effects of {len(facts)} facts in {time.time() - t0:.0f}s; run {rid}"
        )
    return effects


def measure_study(store: StoreReader, cfg: StudyRunConfig, state: dict[str, Any], say: Log) -> dict[str, str]:
    """Readings, interventions and metrics of the state's runs (the module docstring); return the
    ``methods`` run recorded per mode (``none`` when no mode is asked)."""
    started = time.time()
    migrate_patch_state(store, state)
    readings = _readings(store, cfg, state, say)
    effects = _effects(store, cfg, state, readings, say)
    L = store.geometry.n_layers
    tol = default_tolerance(L)
    all_ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    strata = store_strata(store, all_ids)
    summary: dict[str, Any] = {
        "model": store.manifest.model.get("name"),
        "n_layers": L,
        "tolerance": tol,
        "readings": {m: int(len(r.example_ids)) for m, r in readings.items()},
        "tuned_lens": state.get("tuned_lens"),
    }
    trace = readings.get("trace")
    # the cross-size row does not depend on the intervention mode: it is computed once, with the first mode
    site = (
        np.concatenate([key_mlp_at_subject(store, r) for r in state["trace_runs"]])
        if trace is not None
        else None
    )
    p_clean = trace_clean_probabilities(store, state["trace_runs"]) if state["trace_runs"] else None
    runs: dict[str, str] = {}
    modes: list[str] = list(effects) or ["none"]
    for i, mode in enumerate(modes):
        res = compute_metrics(
            list(readings.values()), strata, tol, effects.get(mode), resamples=cfg.resamples, p_clean=p_clean
        )
        cross = None
        if i == 0:
            cross = cross_size_rows(
                str(summary["model"]),
                L,
                trace,
                readings.get("patch"),
                site,
                int(state["answered"]),
                int(state["facts"]),
                resamples=cfg.resamples,
            )
        rid = new_run_id("methods")
        config = {
            "mode": mode,
            "trace_runs": state["trace_runs"],
            "patch_runs": state["patch_runs"],
            "effects_run": state.get(f"effects_{mode}_run"),
            "methods": list(readings),
            "tolerance": tol,
            "tuned_lens": state.get("tuned_lens"),
        }
        record_method_metrics(store, rid, res, cross, config, started)
        state[f"metrics_{mode}_run"] = rid
        runs[mode] = rid
        summary[mode] = {"run_id": rid, "metrics": res.metrics.to_pylist(), "pairs": res.pairs.to_pylist()}
        if cross is not None:
            summary["cross_size"] = cross.to_pylist()
        say(f"metrics ({mode}): run {rid}")
    save_state(Path(cfg.state), state)
    if cfg.out:
        write_summary(Path(cfg.out), {"state": state, **summary})
        say(f"wrote {cfg.out}")
    return runs
