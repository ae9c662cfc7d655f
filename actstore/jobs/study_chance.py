"""``actstore study chance``: a finished study's state re-read against chance from the stored runs
(:func:`actstore.query.methods.reread.reread_study`), its figures written to ``--out``.  Nothing is
written into the store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from actstore.core.errors import MethodsError
from actstore.core.store import StoreReader
from actstore.jobs.study_settings import StudyChanceConfig
from actstore.jobs.study_state import existing_state, write_summary
from actstore.query.analyses.lens_methods import CORPUS_PREFIX
from actstore.query.methods.readings import COMPARISON_TRAIN
from actstore.query.methods.reread import StudyRuns, reread_study


def run_chance(
    store: StoreReader, cfg: StudyChanceConfig, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every figure of the re-read of the study in ``cfg.state`` (the tuned lens, when asked, fit as
    the study fit it: its recorded steps, batch, learning rate and seed); written to ``cfg.out``."""
    state = existing_state(Path(cfg.state))
    if not state["trace_runs"]:
        raise MethodsError(f"{cfg.state}: no trace runs to re-read")
    methods = list(cfg.methods)
    patch_runs = list(state.get("patch_runs", []))
    if not patch_runs and "patch" in methods:  # a study without patching reads no patch run
        methods.remove("patch")
    train = COMPARISON_TRAIN
    fitted = (state.get("tuned_lens") or {}).get("config")
    if cfg.tuned and not cfg.tuned.startswith(CORPUS_PREFIX) and fitted:
        train = replace(
            COMPARISON_TRAIN,
            steps=fitted["steps"],
            batch=fitted["batch"],
            lr=fitted["lr"],
            seed=fitted["seed"],
        )
    other = existing_state(Path(cfg.also_trace))["trace_runs"] if cfg.also_trace else None
    effect_runs = {
        mode: state[f"effects_{mode}_run"]
        for mode in ("knockout", "restore")
        if state.get(f"effects_{mode}_run")
    }
    result = reread_study(
        store,
        StudyRuns(state["trace_runs"], patch_runs, effect_runs),
        methods,
        tuned=cfg.tuned,
        tuned_config=train,
        other_trace_runs=other,
        threshold=cfg.threshold,
        permutations=cfg.permutations,
        resamples=cfg.resamples,
        log=log,
    )
    if cfg.out:
        write_summary(Path(cfg.out), result)
    return result
