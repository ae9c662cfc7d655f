"""Over-fitted or under-trained? The stored corpus-trained tuned lens (``actstore corpus-lens``) and
the logit lens read again at a few residual indices, on positions the lens trained on and on the
held-out ones, with the run's own document split (same seed, held-out share and row counts).

    python -m benchmarks.corpus_lens_fit STORE --indices 15,16,17 --train-rows 512

A translator that is worse than the logit lens on held-out positions but better on training ones is
over-fitted; worse on both, it is under-trained.  The KL is computed here by its own loop (the final
distribution against the lens's, in float64), not by ``kl_per_index``."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import actstore
from actstore.core.store import StoreReader
from actstore.query.analyses.corpus_lens import corpus_residuals, load_corpus_lens, split_documents
from actstore.query.analyses.readout import FinalReadout, TunedLens
from benchmarks.common import emit


def kl_at(
    store: StoreReader, lens: TunedLens, readout: FinalReadout, rows: np.ndarray, indices: list[int]
) -> dict[str, float]:
    """Mean KL(final || lens) over ``rows`` at each of ``indices``, for the logit and the tuned lens."""
    x = torch.as_tensor(corpus_residuals(store, rows), dtype=torch.float32)
    total: dict[str, float] = {}
    with torch.no_grad():
        for lo in range(0, len(x), 16):
            h = x[lo : lo + 16]
            target = torch.log_softmax(readout.logits(h[:, -1]).double(), -1)
            p = target.exp()
            for k in indices:
                for name, hk in (("logit", h[:, k]), ("tuned", lens.translate_index(h[:, k], k))):
                    q = torch.log_softmax(readout.logits(hk).double(), -1)
                    key = f"{k}/{name}"
                    total[key] = total.get(key, 0.0) + float((p * (target - q)).sum())
    return {k: round(v / max(len(x), 1), 4) for k, v in sorted(total.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--indices", default="15,16,17")
    ap.add_argument("--train-rows", type=int, default=512, help="training positions read (of those drawn)")
    ap.add_argument("--held-out", type=float, default=0.2, help="as the run's --held-out")
    ap.add_argument("--max-train-rows", type=int, default=16384, help="as the run's")
    ap.add_argument("--max-eval-rows", type=int, default=1024, help="as the run's")
    ap.add_argument("--seed", type=int, default=0, help="as the run's")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    store = actstore.open(a.store)
    split = split_documents(store, a.held_out, a.max_train_rows, a.max_eval_rows, a.seed)
    lens = load_corpus_lens(f"corpus:{a.store}", store)
    readout = FinalReadout.from_store(store)
    indices = [int(v) for v in a.indices.split(",")]
    rng = np.random.default_rng(a.seed + 1)
    train = np.sort(rng.choice(split.train_rows, min(a.train_rows, split.train_rows.size), replace=False))
    t0 = time.perf_counter()
    out = {
        "store": a.store,
        "train_rows": int(train.size),
        "eval_rows": int(split.eval_rows.size),
        "train": kl_at(store, lens, readout, train, indices),
        "held_out": kl_at(store, lens, readout, split.eval_rows, indices),
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    emit(out, a.json)


if __name__ == "__main__":
    main()
