"""Lexical shortcuts in a probe run's errors (``actstore shortcuts``): Spearman rho, Mass and
StrongAlign-x of the errors' TokenScores against lexical cues, recorded as a run of its own
(``shortcut_errors``, ``shortcut_summary``; ``probe_run`` names the run it read).

    out = run_shortcuts(store, ShortcutsConfig(probe_run="probe-..."))
    out.result.summary, out.run_id, out.tables
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from actstore.core.store import StoreReader
from actstore.jobs.record import AnalysisOutcome, read_run_column
from actstore.jobs.settings import ShortcutsConfig
from actstore.query.analyses.shortcuts import ShortcutResult, shortcut_analysis, shortcut_figure


@dataclass
class ShortcutsOutcome(AnalysisOutcome[ShortcutResult]):
    figure: str | None = None  # the one figure (also in ``figures``)


def run_shortcuts(store: StoreReader, cfg: ShortcutsConfig) -> ShortcutsOutcome:
    """Score the run's errors against the cues, draw the figure, record the run."""
    started = time.time()
    res = shortcut_analysis(store, cfg.probe_run, n_cues=cfg.n_cues)
    figure = None
    if cfg.figures:
        os.makedirs(cfg.figures, exist_ok=True)
        figure = shortcut_figure(res, os.path.join(cfg.figures, f"shortcuts_{cfg.probe_run}.png"))
    out = ShortcutsOutcome(res, figures=[figure] if figure else [], figure=figure)
    if cfg.save:
        tables = {
            "shortcut_errors": read_run_column(res.errors, "probe_run"),
            "shortcut_summary": read_run_column(res.summary, "probe_run"),
        }
        config = {"probe_run": cfg.probe_run, "n_cues": cfg.n_cues}
        out.record(store, "shortcuts", config, tables, started)
    return out
