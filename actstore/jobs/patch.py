"""Activation patching (``actstore patch``): one settings object (:class:`PatchRequest`, in
:mod:`actstore.jobs.settings`) to its result tables and ``runs`` row."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from actstore.core.errors import InvalidSetting, PatchError
from actstore.core.progress import progress_bar
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.interventions.patching import (
    ActivationPatcher,
    PatchPair,
    choose_counterfactuals,
    effects_table,
    pairs_table,
)
from actstore.interventions.runner import InterventionRunner
from actstore.interventions.tracing import stored_facts
from actstore.jobs.model import load_request_model
from actstore.jobs.record import record_run
from actstore.jobs.settings import PatchRequest
from actstore.query.select.selection import Selection

__all__ = ["PatchOutcome", "PatchRequest", "parse_pair", "run_patch"]


@dataclass
class PatchOutcome:
    run_id: str
    results: list[Any]
    skipped: list[dict[str, Any]]
    config: dict[str, Any]
    seconds: float
    tables: list[str] = field(default_factory=list)


def parse_pair(text: str) -> tuple[int, int]:
    """``"12:40"`` (or ``"12,40"``) -> (12, 40)."""
    parts = text.replace(",", ":").split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise InvalidSetting("pairs", f"{text!r} is not CLEAN_ID:COUNTERFACTUAL_ID") from None


def run_patch(store: StoreReader, req: PatchRequest) -> PatchOutcome:
    """Activation patching: clean activations into a counterfactual prompt of the same relation."""

    started = time.time()
    cfg = req.patch
    skipped: list[dict[str, Any]] = []
    if req.pairs:
        ids = sorted({i for p in req.pairs for i in p})
        got = {
            f.example_id: f
            for f in stored_facts(store, Selection.from_ids(store, ids), correct_only=False, check=False)
        }
        missing = [i for i in ids if i not in got]
        if missing:
            raise PatchError(f"{store.url}: no fact {missing[0]} with an object token")
        pairs = [PatchPair(got[c], got[x]) for c, x in req.pairs]
    else:
        facts = stored_facts(
            store, Selection.from_sql(store, req.where), correct_only=not req.all_facts, limit=req.limit
        )
        # counterfactuals are facts the model answers, or any fact with --all-facts
        candidates = [
            f
            for f in stored_facts(store, correct_only=not req.all_facts, check=False)
            if f.subject_span[0] >= 0
        ]
        pairs, skipped = choose_counterfactuals(facts, candidates)
    for p in pairs:
        p.check()  # a counterfactual of another relation, a subject not in its prompt: one line, before the model
    if not pairs:
        raise PatchError(
            f"{store.url}: no fact with a counterfactual to patch"
            + (f" ({skipped[0]['reason']})" if skipped else "")
        )
    model, loaded = load_request_model(store, req)
    patcher = ActivationPatcher(InterventionRunner(loaded.model), cfg)
    t0 = time.time()
    with progress_bar(total=len(pairs), unit="fact", desc="patch", enabled=not req.quiet) as bar:
        results = patcher.patch(pairs, progress=bar.update)
    out = PatchOutcome(new_run_id("patch"), results, skipped, dict(cfg.__dict__), time.time() - t0)
    if req.save:
        pairs_text = [f"{c}:{x}" for c, x in req.pairs]
        config = {**cfg.__dict__, **req.facts_config(model), "pairs": pairs_text, "skipped": skipped}
        tables = {"patch_effects": effects_table(results), "patch_pairs": pairs_table(results)}
        out.tables += record_run(store, "patch", config, tables, started=started, run_id=out.run_id).tables
    return out
