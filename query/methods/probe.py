"""The probe reading of the method comparison: per-layer logistic probes of the object, cross-validated
over the facts, whose accuracy per layer is the method's profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actstore.core.errors import MethodsError
from actstore.query.analyses.lens import stored_residuals
from actstore.query.methods.defaults import PLATEAU
from actstore.query.methods.readings import MethodReading, StoredOutputs, key_layers


@dataclass(frozen=True)
class LayerProbeConfig:
    """Settings of the per-layer object probes that read where a fact is (not :class:`actstore.query.analyses.probe.ProbeConfig`,
    the few-shot relation probe)."""

    min_count: int = 5  # objects with fewer facts in the store are not probe classes
    folds: int = 3
    l2: float = 1e-3
    steps: int = 60  # L-BFGS iterations
    seed: int = 0


def probe_reading(
    store: Any, out: StoredOutputs, cfg: LayerProbeConfig = LayerProbeConfig(), plateau: float = PLATEAU
) -> tuple[MethodReading, dict[str, Any]]:
    """Cross-validated object probes on every residual index; the reading of ``out``'s facts whose
    object is a probe class, and a summary (classes, facts, per-index accuracy)."""
    t = store.sql("""SELECT e.example_id, e.object FROM examples e JOIN targets t USING (example_id)
                     WHERE t.object_token_id >= 0 ORDER BY e.example_id""").to_pandas()
    counts = t["object"].value_counts()
    classes = sorted(counts[counts >= max(cfg.min_count, cfg.folds)].index.tolist())
    if len(classes) < 2:
        raise MethodsError(
            f"{store.url}: fewer than 2 objects have {cfg.min_count} facts; no object probe "
            "(ingest more facts or lower --probe-min-count)"
        )
    t = t[t["object"].isin(classes)]
    ids = t["example_id"].to_numpy(np.int64)
    y = np.searchsorted(np.asarray(classes), t["object"].to_numpy())

    X, _, _ = stored_residuals(store, ids)  # [N, K, d]
    probs, weights, fold_of = _cv_probes(X, y, len(classes), cfg)
    acc = (probs.argmax(-1) == y[:, None]).mean(axis=0)  # [K]
    p_true = probs[np.arange(len(y)), :, y]  # [N, K]
    keep = np.isin(out.example_ids, ids)
    eval_ids = out.example_ids[keep]
    pos = np.searchsorted(ids, eval_ids)
    profile = p_true[pos, 1:] - p_true[pos, :-1]  # [n, L]
    key = key_layers(profile, plateau)
    verdict = np.array([""] * len(eval_ids), dtype=object)
    if out.additive:
        sub = np.flatnonzero(keep)
        for j, (i, k) in enumerate(zip(pos, key)):
            W, sigma = weights[fold_of[i]]  # [K, d, C], [K, d]
            w = W[k + 1] / sigma[k + 1][:, None]  # raw-feature weights of the probe after layer k
            c = y[i]
            margin = w[:, c] - np.delete(w, c, axis=1).mean(axis=1)  # [d]
            a = float(out.attn[sub[j], k] @ margin)
            m = float(out.mlp[sub[j], k] @ margin)
            verdict[j] = "mlp" if m >= a else "attn"
    summary = {
        "classes": len(classes),
        "facts": int(len(ids)),
        "folds": cfg.folds,
        "accuracy_per_index": [round(float(a), 4) for a in acc],
        "chance": round(1 / len(classes), 4),
        "evaluated_facts": int(keep.sum()),
    }
    return MethodReading("probe", eval_ids, profile, key.astype(np.int64), verdict), summary


def _cv_probes(
    X: np.ndarray, y: np.ndarray, C: int, cfg: LayerProbeConfig
) -> tuple[np.ndarray, dict[int, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Stratified k-fold multinomial logistic probes on all K indices at once (one batched problem).
    Returns held-out probabilities [N, K, C], per-fold (W [K, d, C], sigma [K, d]), each fact's fold."""
    N, K, d = X.shape
    rng = np.random.default_rng(cfg.seed)
    fold_of = np.zeros(N, np.int64)
    for c in range(C):
        idx = rng.permutation(np.flatnonzero(y == c))
        fold_of[idx] = np.arange(idx.size) % cfg.folds
    probs = np.zeros((N, K, C))
    weights: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    Xt = torch.as_tensor(X, dtype=torch.float32).transpose(0, 1)  # [K, N, d]
    yt = torch.as_tensor(y, dtype=torch.long)
    for f in range(cfg.folds):
        tr = torch.as_tensor(np.flatnonzero(fold_of != f))
        te = torch.as_tensor(np.flatnonzero(fold_of == f))
        mu = Xt[:, tr].mean(1, keepdim=True)
        sd = Xt[:, tr].std(1, keepdim=True) + 1e-6
        Ztr, Zte = (Xt[:, tr] - mu) / sd, (Xt[:, te] - mu) / sd
        W, b = _fit_logistic(Ztr, yt[tr], C, cfg)
        with torch.no_grad():
            p = torch.softmax(torch.bmm(Zte, W) + b, dim=-1)  # [K, n_te, C]
            probs[te.numpy()] = p.transpose(0, 1).numpy()
            weights[f] = (W.numpy().copy(), sd[:, 0].numpy().copy())
    return probs, weights, fold_of


def _fit_logistic(
    Z: torch.Tensor, y: torch.Tensor, C: int, cfg: LayerProbeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """K independent multinomial logistic regressions (Z [K, n, d], labels y [n]) solved jointly by L-BFGS."""
    K, _, d = Z.shape
    W = torch.zeros((K, d, C), requires_grad=True)
    b = torch.zeros((K, 1, C), requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1.0, max_iter=cfg.steps, line_search_fn="strong_wolfe")
    yy = y.repeat(K)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = torch.bmm(Z, W) + b  # [K, n, C]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, C), yy) * K + cfg.l2 * (W**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return W.detach(), b.detach()
