"""The tuned lens trained as Belrose et al. train it: on the residual stream at every position of a text
corpus, evaluated on documents it never saw.

A corpus store (``actstore ingest --positions all --kinds resid``) holds residual index ``i``
(0: embeddings, ``i``: output of block ``i - 1``) at every kept token.  The documents are split
once, by a seeded permutation of their numbers in the ``positions`` table: a share of them
(``held_out``) is never trained on.  Rows are sampled from each side (``max_train_rows``,
``max_eval_rows``), the translators are trained on the KL to the model's own final distribution
(:func:`actstore.query.tuned_lens.train_tuned_lens`), and both lenses are read on the held-out
positions: the mean KL per residual index, the logit lens's and the tuned lens's.

Cost: reading the split reads two integer columns of ``positions`` (linear in the store's
positions); the features read are the sampled rows only (``rows x (L + 1) x d_model`` values);
training is ``steps x batch x L`` products with the unembedding (the vocabulary dominates).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.errors import LensError
from actstore.core.store import StoreReader
from actstore.query.readout import FinalReadout, TunedLens
from actstore.query.selection import Selection
from actstore.query.tuned_lens import TrainConfig, kl_per_index, train_tuned_lens


@dataclass(frozen=True)
class CorpusSplit:
    """Rows (example ids) of the training and the held-out documents, as sampled."""

    train_documents: np.ndarray
    eval_documents: np.ndarray
    train_rows: np.ndarray
    eval_rows: np.ndarray


@dataclass
class CorpusLensStudy:
    split: CorpusSplit
    kl_logit: np.ndarray  # [L + 1] mean KL(final || logit lens) on the held-out rows, nats
    kl_tuned: np.ndarray  # [L + 1] the same through the tuned lens (index L: 0)
    lens: TunedLens

    def summary(self) -> list[dict[str, Any]]:
        """One dict per residual index: the two KLs and their ratio."""
        return [
            {
                "index": i,
                "kl_logit": float(a),
                "kl_tuned": float(b),
                "tuned_better": bool(b < a) if i < len(self.kl_logit) - 1 else None,
            }
            for i, (a, b) in enumerate(zip(self.kl_logit, self.kl_tuned, strict=True))
        ]


def check_corpus_residuals(store: StoreReader) -> int:
    """L + 1 (the residual indices) when ``store`` is a corpus store that kept every index of
    ``resid``; one error line otherwise."""
    ingest = store.manifest.ingest
    if ingest.get("positions") != "all":
        raise LensError(
            f"{store.url}: not a corpus store (ingest it with --positions all --kinds resid over a text corpus)"
        )
    n_index = store.geometry.n_layers + 1
    kept = (ingest.get("kept") or {}).get("resid") or []
    missing = sorted(set(range(n_index)) - set(kept))
    if missing:
        raise LensError(
            f"{store.url}: the tuned lens needs resid at every residual index 0..{n_index - 1}; "
            f"index {missing[0]} was not kept (ingest with --kinds resid and no --layers)"
        )
    return n_index


def split_documents(
    store: StoreReader, held_out: float, max_train_rows: int, max_eval_rows: int, seed: int
) -> CorpusSplit:
    """Documents permuted by ``seed``; the first ``held_out`` share (at least one) is held out.
    Rows are drawn without replacement from each side, at most the given numbers, in store order."""
    if not 0 < held_out < 1:
        raise LensError(f"held_out must be a share in (0, 1), not {held_out}")
    t = store.sql("SELECT example_id, document FROM positions WHERE document >= 0")
    ids = t.column("example_id").to_numpy()
    docs = t.column("document").to_numpy()
    uniq = np.unique(docs)
    if uniq.size < 2:
        raise LensError(f"{store.url}: the corpus has {uniq.size} document(s); a held-out split needs two")
    rng = np.random.default_rng(seed)
    order = rng.permutation(uniq)
    n_eval = min(uniq.size - 1, max(1, round(held_out * uniq.size)))
    eval_docs, train_docs = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    held = np.isin(docs, eval_docs)

    def draw(pool: np.ndarray, n: int) -> np.ndarray:
        return np.sort(pool if pool.size <= n else rng.choice(pool, n, replace=False))

    return CorpusSplit(
        train_docs, eval_docs, draw(ids[~held], max_train_rows), draw(ids[held], max_eval_rows)
    )


def corpus_residuals(store: StoreReader, rows: np.ndarray) -> np.ndarray:
    """``resid`` [n, L + 1, d_model] of the rows (example ids, increasing)."""
    return Selection.from_ids(store, rows.tolist()).features("resid")


def corpus_lens_study(
    store: StoreReader,
    *,
    held_out: float = 0.2,
    max_train_rows: int = 16384,
    max_eval_rows: int = 4096,
    config: TrainConfig | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> CorpusLensStudy:
    """Train the tuned lens on the training documents' positions and compare it with the logit lens on
    the held-out documents' positions (``config``: the training; its seed also draws the split)."""
    check_corpus_residuals(store)
    cfg = config or TrainConfig()
    cfg.check()
    split = split_documents(store, held_out, max_train_rows, max_eval_rows, cfg.seed)
    readout = FinalReadout.from_store(store)
    lens = train_tuned_lens(readout, corpus_residuals(store, split.train_rows), cfg, progress=progress)
    held = corpus_residuals(store, split.eval_rows)
    return CorpusLensStudy(split, kl_per_index(readout, held), kl_per_index(readout, held, lens), lens)


__all__ = [
    "CorpusLensStudy",
    "CorpusSplit",
    "check_corpus_residuals",
    "corpus_lens_study",
    "corpus_residuals",
    "split_documents",
]
