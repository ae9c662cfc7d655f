"""Relation probes (``actstore probe``): one settings object (:class:`ProbeRequest`, in
:mod:`actstore.jobs.settings`) to the probe run's result tables and ``runs`` row; and views of a stored
probe run for the command line: the layer x head HeadScore grid, the run's contrast reading, and the
knowledge-base files a correlation reads.

    out = run_probe(store, ProbeRequest(probe=ProbeConfig(kind="attn_head", episodes=100)))
    out.output.accuracy, out.run_id, out.tables
    grid = headscore_grid(store, out.run_id, relation="P17")
    grid.scores                              # [len(grid.layers), len(grid.heads)], NaN where no head
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from actstore.core.errors import InvalidSetting
from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.jobs.settings import ProbeRequest
from actstore.query.analyses.attribution import run_row
from actstore.query.analyses.probe import ProbeConfig, ProbeOutput
from actstore.query.analyses.probe import run_probe as probe_episodes
from actstore.query.analyses.probe_tables import WEIGHTS_GROUP_ROWS, probe_tables

CONTRAST_TEXT = {
    "renormalised": "renormalised (dW = W_c_hat - sum pi'_c W_c, pi' renormalised over the competitors; ours)",
    "seed": "seed (dW = W_c_hat - sum pi_c W_c, the full softmax; the formula of arXiv 2604.19934)",
}


def contrast_text(reading: str | None) -> str:
    """One line saying which reading of dW a HeadScore/TokenScore used."""
    return CONTRAST_TEXT[reading or "renormalised"]


def run_contrast(store: StoreReader, run_id: str) -> str:
    """The contrast reading the probe run ``run_id`` was made with."""

    return ProbeConfig.from_json(str(run_row(store, run_id)["config"])).contrast


@dataclass
class HeadScoreGrid:
    run_id: str
    relation: str | None
    layers: list[int]
    heads: list[int]  # -1: the whole layer
    scores: np.ndarray  # [len(layers), len(heads)] mean HeadScore weighted by predictions, NaN where none
    n_predictions: int
    contrast: str


def headscore_grid(store: StoreReader, run_id: str, relation: str | None = None) -> HeadScoreGrid:
    """Mean HeadScore per layer x head over the run's query predictions (only those whose gold
    relation is ``relation`` when given)."""

    run_row(store, run_id)  # an unknown run: one line naming the runs there are
    cond, params = "run_id = ?", [run_id]
    if relation is not None:
        known = [
            r["relation_id"]
            for r in store.sql(
                f"SELECT DISTINCT relation_id FROM head_scores WHERE {cond} ORDER BY 1", params
            ).to_pylist()
        ]
        if relation not in known:
            raise InvalidSetting(
                "relation", f"unknown relation {relation!r} for run {run_id} (one of {', '.join(known)})"
            )
        cond, params = cond + " AND relation_id = ?", [run_id, relation]
    rows = store.sql(
        f"SELECT layer, head, sum(score * n) / greatest(sum(n), 1) AS score, sum(n) AS n "
        f"FROM head_scores WHERE {cond} GROUP BY 1, 2 ORDER BY 1, 2",
        params,
    ).to_pylist()
    layers = sorted({r["layer"] for r in rows})
    heads = sorted({r["head"] for r in rows})
    grid = np.full((len(layers), len(heads)), np.nan)
    for r in rows:
        grid[layers.index(r["layer"]), heads.index(r["head"])] = r["score"]
    n_pred = int(max((r["n"] for r in rows), default=0))
    return HeadScoreGrid(run_id, relation, layers, heads, grid, n_pred, run_contrast(store, run_id))


def expand_files(patterns: Sequence[str]) -> list[str]:
    """Every file the glob ``patterns`` match, in order; a pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if not hits:
            raise InvalidSetting("kb", f"{pattern}: no such file")
        files += hits
    return files


def record_probe(store: StoreReader, out: ProbeOutput) -> list[str]:
    """Write every result table of the probe run and its ``runs`` row; return the tables' paths."""
    recorded = record_run(
        store,
        "probe",
        out.config.to_json(),
        probe_tables(out),
        started=out.started,
        finished=out.started + out.seconds,
        run_id=out.run_id,
        row_groups={"probe_weights": WEIGHTS_GROUP_ROWS},
    )
    return recorded.tables


@dataclass
class ProbeOutcome:
    run_id: str
    output: ProbeOutput  # the episodes, their accuracy and the probe's settings
    tables: list[str] = field(default_factory=list)  # empty when not saved


def run_probe(store: StoreReader, req: ProbeRequest) -> ProbeOutcome:
    """Train and evaluate the probe's episodes (:func:`actstore.query.analyses.probe.run_probe`), then
    record the run (:func:`record_probe`) unless ``req.save`` is False."""
    out = probe_episodes(store, req.probe, progress=req.progress)
    return ProbeOutcome(out.run_id, out, record_probe(store, out) if req.save else [])
