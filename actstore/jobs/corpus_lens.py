"""Train the tuned lens on a corpus store and compare it with the logit lens on held-out documents
(``actstore corpus-lens``); record the run.

out = run_corpus_lens(store, CorpusLensConfig(steps=100))
out.summary                      # per residual index: held-out KL of the logit and the tuned lens
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.jobs.settings import CorpusLensConfig
from actstore.query.analyses.corpus_lens import TRANSLATORS_TABLE, corpus_lens_study, translators_table
from actstore.query.analyses.readout import TunedLens
from actstore.query.analyses.tuned_lens import TrainConfig


@dataclass
class CorpusLensOutcome:
    run_id: str
    summary: list[dict[str, Any]]  # per residual index
    result: dict[str, Any]  # JSON-ready
    tables: list[str] = field(default_factory=list)
    lens: TunedLens | None = None  # the trained translators (stored as tuned_lens_translators)


def run_corpus_lens(
    store: StoreReader, cfg: CorpusLensConfig, progress: Callable[[int, float], None] | None = None
) -> CorpusLensOutcome:
    """The study of :func:`actstore.query.analyses.corpus_lens.corpus_lens_study`; writes the ``corpus_lens``
    table (one row per residual index), the translators (``tuned_lens_translators``, read back by
    ``agree --tuned corpus:STORE``) and a ``runs`` row unless ``cfg.save`` is False."""
    started = time.time()
    train = TrainConfig(
        optimizer=cfg.optimizer, steps=cfg.steps, batch=cfg.batch, seed=cfg.seed, device="auto"
    )
    study = corpus_lens_study(
        store,
        held_out=cfg.held_out,
        max_train_rows=cfg.max_train_rows,
        max_eval_rows=cfg.max_eval_rows,
        config=train,
        progress=progress,
    )
    summary = study.summary()
    run_id = new_run_id("corpus_lens")
    out = CorpusLensOutcome(run_id, summary, {}, lens=study.lens)
    split = study.split
    counts = {
        "train_documents": int(split.train_documents.size),
        "eval_documents": int(split.eval_documents.size),
        "train_rows": int(split.train_rows.size),
        "eval_rows": int(split.eval_rows.size),
    }
    if cfg.save:
        table = pa.table(
            {
                "index": pa.array([x["index"] for x in summary], pa.int32()),
                "kl_logit": pa.array([x["kl_logit"] for x in summary], pa.float64()),
                "kl_tuned": pa.array([x["kl_tuned"] for x in summary], pa.float64()),
            }
        )
        run_config = {"held_out": cfg.held_out, "train": train.describe(), **counts}
        out.tables += record_run(
            store,
            "corpus_lens",
            run_config,
            {"corpus_lens": table, TRANSLATORS_TABLE: translators_table(study.lens)},
            started=started,
            run_id=run_id,
        ).tables
    info = study.lens.info
    out.result = {
        "store": store.url,
        "run_id": run_id,
        **counts,
        "train": train.describe(),
        "loss_first": info.get("loss_first"),
        "loss_last": info.get("loss_last"),
        "per_index": summary,
        "tables": out.tables,
        "seconds": round(time.time() - started, 2),
    }
    return out


__all__ = ["CorpusLensOutcome", "run_corpus_lens"]
