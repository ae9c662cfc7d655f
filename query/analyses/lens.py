"""Logit lens and tuned lens over the stored residual stream (no model needed).

The store keeps the residual stream at each fact's last token, ``resid`` [n, L+1, d_model]
(index 0 = embeddings, i = output of layer i-1, before the final norm), and the final norm and
unembedding.  For residual index i:

    logit lens   logits_i = U final_norm(h_i) (+ unembedding bias; Gemma's logit soft-capping)
    tuned lens   logits_i = U final_norm(h_i + h_i D_i + b_i)   an affine translator per index

At i = L the logit lens is the model's own output (the stored ``targets.top_token_id``).

Tuned-lens translators, two fitting rules:

- ``adam`` / ``sgd`` (default ``adam``; :mod:`actstore.query.analyses.tuned_lens`): the tuned lens of Belrose et
  al. (2023), identity-initialised translators trained by gradient descent on the KL divergence
  from the model's final distribution to the lens distribution, with the ``tuned-lens``
  package's optimiser settings;
- ``ridge`` (ours, kept as an option): ridge regression of the last residual h_L on h_i, shrunk
  toward the identity,

    min_{D,b} || (H_L - H_i) - H_i D - b ||^2 + lambda ||D||^2,

  solved in closed form on the training facts' stored residuals.  lambda is ``alpha`` times the
  mean eigenvalue of the centred H_i^T H_i; ``alpha`` is picked per index from ``ALPHAS`` by the
  error on a held-out fifth of the training facts (refit on all of them afterwards).  It matches
  states, not distributions; its intercept learns which objects the training relations have.

Reported per index: the object's (first token's) probability and rank, and whether it is the
top token, for each fact, and the mean KL from the model's output; evaluated on facts held out
from the translators' training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import InvalidSetting, LensError
from actstore.core.tables import rows_table
from actstore.query.analyses.readout import (
    ALPHAS,
    TUNED_METHODS,
    FinalReadout,
    LensReading,
    TunedLens,
    read_objects,
)
from actstore.query.analyses.tuned_lens import TrainConfig, kl_per_index, train_tuned_lens
from actstore.query.select.selection import Selection

__all__ = [
    "ALPHAS",
    "TUNED_METHODS",
    "FinalReadout",
    "LensError",
    "LensReading",
    "TunedLens",
    "read_objects",
    "LensStudy",
    "lens_study",
    "split_facts",
    "stored_residuals",
    "LENS_SCHEMA",
    "fit_lens",
    "fit_tuned_lens",
]

# ------------------------------------------------------------------------------------ study


def split_facts(
    example_ids: np.ndarray, train_fraction: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids): a seeded random split of facts."""
    if not 0 < train_fraction < 1:
        raise InvalidSetting("train_fraction", f"must be between 0 and 1, not {train_fraction}")
    ids = np.asarray(example_ids)
    perm = np.random.default_rng(seed).permutation(ids.size)
    k = int(round(train_fraction * ids.size))
    if k < 5 or ids.size - k < 1:
        raise LensError(
            f"{ids.size} facts are too few to split into training (>= 5) and held-out (>= 1) facts"
        )
    return np.sort(ids[perm[:k]]), np.sort(ids[perm[k:]])


@dataclass
class LensStudy:
    """Logit and tuned lens over the facts of a store, the tuned lens evaluated on held-out facts."""

    example_ids: np.ndarray  # [n] evaluated (held-out) facts
    train_ids: np.ndarray
    logit: LensReading
    tuned: LensReading | None
    final_top: np.ndarray  # [n] the model's greedy token recorded at ingest
    alphas: list[float] = field(default_factory=list)
    method: str | None = None  # the tuned lens's fitting rule (None: logit lens only)
    kl_logit: np.ndarray | None = None  # [L+1] mean KL(model output || logit lens) on the evaluated facts
    kl_tuned: np.ndarray | None = None  # [L+1] the same for the tuned lens

    def summary(self) -> list[dict[str, Any]]:
        """Per residual index: mean object probability, median rank and top-1 share, both lenses."""
        rows = []
        K = self.logit.prob.shape[1]
        for i in range(K):
            row: dict[str, Any] = {"index": i, "layer": i - 1}
            for name, r, kl in (("logit", self.logit, self.kl_logit), ("tuned", self.tuned, self.kl_tuned)):
                if r is None:
                    continue
                if kl is not None:
                    row[f"{name}_kl"] = float(kl[i])
                row[f"{name}_prob"] = float(r.prob[:, i].mean())
                row[f"{name}_logprob"] = float(np.log(np.maximum(r.prob[:, i], 1e-300)).mean())
                row[f"{name}_rank_median"] = float(np.median(r.rank[:, i]))
                row[f"{name}_top1"] = float((r.rank[:, i] == 0).mean())
            rows.append(row)
        return rows

    def table(self) -> pa.Table:
        """One row per (fact, lens, residual index)."""
        rows = []
        for name, r in (("logit", self.logit), ("tuned", self.tuned)):
            if r is None:
                continue
            rows += [
                (int(self.example_ids[j]), name, "heldout", i, i - 1, float(r.prob[j, i]))
                + (int(r.rank[j, i]), int(r.top[j, i]))
                for j, i in np.ndindex(r.prob.shape)
            ]
        return rows_table(rows, LENS_SCHEMA)


LENS_SCHEMA = pa.schema(
    [
        ("example_id", pa.int64()),
        ("lens", pa.string()),
        ("split", pa.string()),
        ("index", pa.int32()),
        ("layer", pa.int32()),
        ("object_prob", pa.float64()),
        ("object_rank", pa.int64()),
        ("top_token_id", pa.int64()),
    ]
)


def stored_residuals(
    store: Any, example_ids: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(resid [n, L+1, d], object token ids [n], stored top token ids [n]) in ``example_ids`` order."""

    ids = np.asarray(example_ids, dtype=np.int64)
    if ids.size == 0:
        raise LensError("no facts selected")
    sel = Selection.from_ids(store, ids.tolist())
    got = sel.example_ids
    x = sel.features("resid")
    t = (
        store.sql("SELECT example_id, object_token_id, top_token_id FROM targets")
        .to_pandas()
        .set_index("example_id")
    )
    order = np.searchsorted(got, ids)
    if got.size != ids.size or not np.array_equal(got[order], ids):
        raise LensError("some selected facts have no stored residual stream")
    return x[order], t.loc[ids, "object_token_id"].to_numpy(), t.loc[ids, "top_token_id"].to_numpy()


def lens_study(
    store: Any,
    eval_ids: Sequence[int] | np.ndarray,
    train_ids: Sequence[int] | np.ndarray | None,
    *,
    method: str = "adam",
    alphas: Sequence[float] = ALPHAS,
    seed: int = 0,
    train_config: TrainConfig | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[LensStudy, TunedLens | None]:
    """Logit lens on ``eval_ids``; with ``train_ids``, a tuned lens fit on them and read on ``eval_ids``.

    ``method``: ``adam`` or ``sgd`` (trained on the KL; ``train_config`` a
    :class:`actstore.query.analyses.tuned_lens.TrainConfig`, its optimizer and seed replaced by ``method`` and
    ``seed``; ``progress`` as in :func:`actstore.query.analyses.tuned_lens.train_tuned_lens`) or ``ridge`` (closed
    form, ``alphas``)."""
    if method not in TUNED_METHODS:
        raise LensError(f"unknown tuned-lens method {method!r} (one of {', '.join(TUNED_METHODS)})")
    readout = FinalReadout.from_store(store)
    resid, obj, top = stored_residuals(store, eval_ids)
    if (obj < 0).any():
        raise LensError("some selected facts have no object token")
    logit = read_objects(readout, resid, obj)
    kl_logit = kl_per_index(readout, resid)
    tuned_reading, lens, kl_tuned = None, None, None
    train = np.asarray(train_ids if train_ids is not None else [], dtype=np.int64)
    if train_ids is not None:
        overlap = np.intersect1d(train, np.asarray(eval_ids))
        if overlap.size:
            raise LensError(f"{overlap.size} facts are both training and evaluation facts of the tuned lens")
        tr_resid, _, _ = stored_residuals(store, train)
        lens = fit_lens(
            readout, tr_resid, method, replace(train_config or TrainConfig(), seed=seed), alphas, progress
        )
        if method != "ridge":
            lens.info["train_kl_logit"] = kl_per_index(readout, tr_resid).tolist()
            lens.info["train_kl_tuned"] = kl_per_index(readout, tr_resid, lens).tolist()
        tuned_reading = read_objects(readout, lens.translate(resid), obj)
        kl_tuned = kl_per_index(readout, resid, lens)
    study = LensStudy(
        np.asarray(eval_ids, dtype=np.int64),
        train,
        logit,
        tuned_reading,
        top,
        lens.alphas if lens else [],
        lens.method if lens else None,
        kl_logit,
        kl_tuned,
    )
    return study, lens


# ------------------------------------------------------------------------------------ fitting


def fit_lens(
    readout: FinalReadout,
    resid: np.ndarray,
    method: str = "adam",
    config: TrainConfig | None = None,
    alphas: Sequence[float] = ALPHAS,
    progress: Callable[[int, float], None] | None = None,
) -> TunedLens:
    """Tuned-lens translators from training residuals ``resid`` [n, L+1, d] by ``method``.

    ``adam`` / ``sgd``: :func:`actstore.query.analyses.tuned_lens.train_tuned_lens` with ``config`` (its optimizer
    replaced by ``method``); ``ridge``: :meth:`TunedLens.fit_ridge` with ``alphas`` and the
    config's seed.  ``lens.info`` records the method, the configuration (the learning rate
    resolved; ridge: the chosen alphas and the seed), the number of training rows and the seconds."""
    if method not in TUNED_METHODS:
        raise LensError(f"unknown tuned-lens method {method!r} (one of {', '.join(TUNED_METHODS)})")
    cfg = config or TrainConfig()
    started = time.time()
    if method == "ridge":
        lens = TunedLens.fit_ridge(resid, alphas, cfg.seed)
        lens.info["config"] = {"alphas": list(lens.alphas), "seed": cfg.seed}
    else:
        lens = train_tuned_lens(readout, resid, replace(cfg, optimizer=method), progress=progress)
    lens.info.update(
        {
            "method": method,
            "rows": int(np.asarray(resid).shape[0]),
            "seconds": round(time.time() - started, 2),
        }
    )
    return lens


def fit_tuned_lens(
    store: Any,
    train_ids: Sequence[int] | np.ndarray,
    method: str = "adam",
    config: TrainConfig | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> TunedLens:
    """:func:`fit_lens` on the stored residual streams of the facts ``train_ids``."""
    if method not in TUNED_METHODS:  # before reading the residuals
        raise LensError(f"unknown tuned-lens method {method!r} (one of {', '.join(TUNED_METHODS)})")
    return fit_lens(
        FinalReadout.from_store(store),
        stored_residuals(store, train_ids)[0],
        method,
        config,
        progress=progress,
    )
