"""Max-activating contexts (``actstore topk``): the top ``k`` rows of every unit of one layer, from one
streaming pass (:func:`actstore.query.analyses.topk.top_activations`), recorded as the ``topk_contexts``
result table of a ``topk`` run; its settings are :class:`~actstore.jobs.settings.TopkConfig`.

    out = run_topk(store, TopkConfig(kind="mlp", layer=3, k=20))
    out.result.values, out.run_id, out.tables
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.jobs.record import AnalysisOutcome
from actstore.jobs.settings import TopkConfig
from actstore.query.analyses.topk import TopK, top_activations
from actstore.query.select.selection import Selection

TopkOutcome = AnalysisOutcome[TopK]


def load_directions(path: str, store: StoreReader | None = None) -> np.ndarray:
    """The directions of ``--kind direction``: an [m, F] (or [F]) array in a .npy file, or one direction
    spec of dfa (``probe:``, ``neuron:``, ``token:``, ``sae:``) read on ``store``."""
    if store is not None and path.split(":")[0] in ("probe", "neuron", "token", "sae"):
        from actstore.jobs.model import direction_for

        return direction_for(store, path)[None]
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise QueryError(f"topk: cannot read {path} as a .npy array ({e})") from None


def run_topk(store: StoreReader, cfg: TopkConfig) -> TopkOutcome:
    """Select the rows (``cfg.where``: one predicate over ``examples``), find the top ``k`` of every
    unit, record the run (unless ``cfg.save`` is False)."""

    started = time.time()
    directions = None if cfg.direction_file is None else load_directions(cfg.direction_file, store)
    assert cfg.layer is not None  # TopkConfig refuses None
    sel = Selection.from_sql(store, cfg.where)
    res = top_activations(
        sel,
        cfg.kind,
        cfg.layer,
        cfg.k,
        on=cfg.on,
        directions=directions,
        batch_rows=cfg.batch_rows,
        progress=cfg.progress,
    )
    out = TopkOutcome(res)
    if cfg.save:
        config: dict[str, Any] = {"kind": cfg.kind, "layer": cfg.layer, "k": cfg.k, "where": cfg.where}
        config["rows"] = len(sel)
        if cfg.kind == "direction":
            config.update(on=cfg.on, direction_file=cfg.direction_file, units=int(res.values.shape[0]))
        out.record(store, "topk", config, {"topk_contexts": res.table}, started)
    return out
