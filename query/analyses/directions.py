"""Directions read from a store's runs: a probe run's weights as a residual direction (``probe:``).

A probe run (``actstore probe``) keeps each episode's trained probe in its ``probe_weights`` table
(:func:`actstore.query.analyses.explain.stored_weights`): the selected features of the run's feature
vector, their support mean and std, the weights ``W`` [Fm, C] and bias.  A query ``x`` is scored
``((x[features] - mean) / std) @ W + b``, so class ``c``'s logit against the others moves along

    d_c = (W[:, c] - mean_{c' != c} W[:, c']) / std        (scattered into the run's feature vector)

per unit of the feature vector (a layer for ``resid``/``attn``/``mlp``, a (layer, head) for
``attn_head``/``attn_entity``/``mlp_group``: each a ``d_model`` vector).  This is the contrast of
Tracing Relational Knowledge Recall in Large Language Models (arXiv 2604.19934) with the competitors
weighted equally (no query to weigh them by; ours), averaged over the run's episodes in which the
relation is a class (ours).

Spec: ``probe:[STORE:]RUN:RELATION[:UNIT]``: ``STORE`` (a store's path) holds the run when it is not
the store being read (a probe trains on a prompt store; the direction is read on a corpus store of the
same model); ``UNIT`` is ``LAYER`` or ``LAYER.HEAD`` of the run's units (needed when the run has more
than one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.query.analyses.probe_config import ProbeConfig

#: The probe kinds whose units are residual-stream vectors (``z`` is per head in d_head: no direction).
RESIDUAL_KINDS = ("resid", "attn", "mlp", "attn_head", "attn_entity", "mlp_group")


def probe_direction(store: StoreReader, rest: str) -> np.ndarray:
    """The direction ``probe:`` + ``rest`` names (see the module docstring), float32 [d_model]."""
    parts = rest.split(":")
    other: StoreReader | None = None
    if len(parts) >= 3 and Path(parts[0]).is_dir():
        from actstore.core.store import open_reader

        try:
            other = open_reader(parts[0])
        except Exception as e:  # noqa: BLE001  (any reason a path is no store: one line)
            raise QueryError(f"direction: {parts[0]} is not a readable store ({e})") from None
        parts = parts[1:]
    if len(parts) not in (2, 3) or not all(parts):
        raise QueryError("direction: probe:[STORE:]RUN:RELATION[:LAYER[.HEAD]]")
    src = other or store
    if other is not None:
        mine, theirs = store.manifest.model.get("name"), other.manifest.model.get("name")
        if mine != theirs or other.geometry.d_model != store.geometry.d_model:
            raise QueryError(
                f"direction: the probe's store is of model {theirs!r}, this store of {mine!r}: "
                "a probe direction applies to the model it was trained on"
            )
    run, relation = parts[0], parts[1]
    return _probe_unit(src, run, relation, parts[2] if len(parts) == 3 else None)


def _probe_unit(store: StoreReader, run: str, relation: str, unit: str | None) -> np.ndarray:
    files = store.table_files()
    if not files.get("probe_runs"):
        raise QueryError(f"direction: the store {store.url} holds no probe runs")
    got = store.sql("SELECT config FROM probe_runs WHERE run_id = ?", [run]).to_pylist()
    if not got:
        known = store.sql("SELECT run_id FROM probe_runs ORDER BY run_id").column(0).to_pylist()
        raise QueryError(f"direction: no probe run {run!r} (runs: {', '.join(map(str, known[:8]))})")
    cfg = ProbeConfig.from_json(str(got[0]["config"]))
    if cfg.kind not in RESIDUAL_KINDS:
        raise QueryError(
            f"direction: probe run {run} is over {cfg.kind}, not a residual-stream kind "
            f"({', '.join(RESIDUAL_KINDS)})"
        )
    if not files.get("probe_weights"):
        raise QueryError(
            f"direction: probe run {run} stored no weights (run it again without --no-store-weights)"
        )
    eps = store.sql(
        "SELECT e.relations, e.support_ids, w.n_way, w.features, w.std, w.weight FROM probe_episodes e "
        "JOIN probe_weights w USING (run_id, seed, episode) "
        "WHERE e.run_id = ? AND list_contains(e.relations, ?) ORDER BY e.seed, e.episode",
        [run, relation],
    ).to_pylist()
    if not eps:
        raise QueryError(
            f"direction: relation {relation!r} is a class of no stored episode of probe run {run}"
        )
    layers, heads = _units(store, cfg, int(eps[0]["support_ids"][0]))
    d = store.geometry.d_model
    total = np.zeros(len(layers) * d, np.float64)
    for e in eps:
        c, n_way = list(e["relations"]).index(relation), int(e["n_way"])
        W = np.asarray(e["weight"], np.float32).reshape(-1, n_way)
        others = np.delete(W, c, axis=1).mean(1) if n_way > 1 else 0.0
        coef = (W[:, c] - others) / np.asarray(e["std"], np.float32)
        feats = np.asarray(e["features"], np.int64)
        if feats.size and feats.max() >= total.size:
            raise QueryError(f"direction: probe run {run}'s features do not fit its units (a damaged table)")
        np.add.at(total, feats, coef)
    total /= len(eps)
    per_unit = total.reshape(len(layers), d)
    labels = [f"{x}" if h < 0 else f"{x}.{h}" for x, h in zip(layers, heads, strict=True)]
    if unit is None:
        if len(labels) != 1:
            raise QueryError(
                f"direction: probe run {run} has {len(labels)} units: add :LAYER or :LAYER.HEAD "
                f"(one of {', '.join(labels[:12])}{', ...' if len(labels) > 12 else ''})"
            )
        return per_unit[0].astype(np.float32)
    if unit not in labels:
        raise QueryError(
            f"direction: probe run {run} has no unit {unit} (units: {', '.join(labels[:12])} ...)"
        )
    return per_unit[labels.index(unit)].astype(np.float32)


def _units(store: StoreReader, cfg: ProbeConfig, example_id: int) -> tuple[list[int], list[int]]:
    """(layer, head) of each d_model unit of the run's feature vector, in its order (head -1 for a
    per-layer kind): the run's features of one of its rows, loaded as the run loaded them."""
    from actstore.query.analyses.probe_features import load_features
    from actstore.query.select.selection import Selection

    fm = load_features(
        store,
        cfg.kind,
        rows=Selection.from_ids(store, [example_id]),
        layers=cfg.layers,
        heads=cfg.heads,
        groups=cfg.groups,
    )
    if fm.unit_size != store.geometry.d_model:
        raise QueryError(
            f"direction: probe run over {cfg.kind} has units of {fm.unit_size} numbers, not d_model"
        )
    layer, head = fm.unit_labels()
    return [int(x) for x in layer], [int(x) for x in head]
