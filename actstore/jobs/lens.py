"""Run the logit and tuned lens over a store's facts (``actstore lens``) and record the run.

out = run_lens(store, LensRunConfig(where="relation_id = 'P17'", tuned="adam"))
out.summary                      # per residual index: mean p(object), median rank, top-1, KL
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.jobs.settings import LensRunConfig
from actstore.query.analyses.lens import LensError, lens_study, split_facts
from actstore.query.analyses.tuned_lens import TrainConfig
from actstore.query.methods.readings import fact_ids
from actstore.query.select.selection import Selection


@dataclass
class LensOutcome:
    run_id: str
    summary: list[dict[str, Any]]  # per residual index
    result: dict[str, Any]  # JSON-ready summary of the run
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    steps: int = 0  # tuned-lens training steps and learning rate (adam, sgd)
    learning_rate: float = 0.0


def run_lens(
    store: StoreReader, cfg: LensRunConfig, progress: Callable[[int, float], None] | None = None
) -> LensOutcome:
    """Evaluate the logit lens (and the tuned lens, trained on ``train_fraction`` of the facts) on
    the held-out facts; write the ``lens`` table and a ``runs`` row unless ``cfg.save`` is False.
    ``progress(step, loss)`` is called while the tuned lens trains."""

    started = time.time()
    method = cfg.tuned
    config = TrainConfig(
        optimizer=method if method not in (None, "ridge") else "adam",
        steps=cfg.steps,
        batch=cfg.batch,
        seed=cfg.seed,
        device="auto",
    )
    if method not in (None, "ridge"):
        config.check()
    ids = fact_ids(store, Selection.from_sql(store, cfg.where), cfg.correct_only)
    if ids.size == 0:
        raise LensError(
            f"{store.url}: no facts with an object" + (f" where {cfg.where}" if cfg.where else "")
        )
    if method is None:
        train, held = None, ids
    else:
        train, held = split_facts(ids, cfg.train_fraction, cfg.seed)
    study, tuned = lens_study(
        store, held, train, method=method or "adam", seed=cfg.seed, train_config=config, progress=progress
    )
    summary = study.summary()
    final_match = float((study.logit.top[:, -1] == study.final_top).mean())
    tuned_config: dict[str, Any] | None = None
    if method == "ridge":
        tuned_config = {"alphas": study.alphas}
    elif method is not None:
        tuned_config = config.describe()
    run_id = new_run_id("lens")
    out = LensOutcome(run_id, summary, {})
    if cfg.save:
        run_config = {
            "where": cfg.where,
            "correct_only": cfg.correct_only,
            "seed": cfg.seed,
            "train_fraction": None if method is None else cfg.train_fraction,
            "tuned": method,
            "tuned_config": tuned_config,
        }
        tables = {"lens": study.table()}
        out.tables += record_run(store, "lens", run_config, tables, started=started, run_id=run_id).tables
    if cfg.figures:
        from actstore.query.analyses.plotting import lens_curves

        title = f"{store.manifest.model.get('name')}: {study.example_ids.size} held-out facts"
        out.figures.append(str(lens_curves(summary, Path(cfg.figures) / "lens_curves.png", title)))
    training: dict[str, Any] = {}
    if tuned is not None and method != "ridge":
        training = {
            k: tuned.info[k]
            for k in ("rows", "loss_first", "loss_last", "seconds", "train_kl_logit", "train_kl_tuned")
        }
    out.result = {
        "store": store.url,
        "run_id": run_id,
        "n_eval": int(study.example_ids.size),
        "n_train": int(study.train_ids.size),
        "final_index_matches_model": final_match,
        "tuned_method": method,
        "tuned_config": tuned_config,
        "tuned_training": training,
        "ridge_alphas": study.alphas,
        "per_index": summary,
        "tables": out.tables,
        "figures": out.figures,
        "seconds": round(time.time() - started, 2),
    }
    out.steps, out.learning_rate = config.steps, config.learning_rate
    return out
