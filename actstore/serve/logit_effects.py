"""A unit's logit effects on its page (:mod:`actstore.serve.corpus`): the direction the unit writes and
the tokens it promotes and suppresses most through the final norm's weight and the unembedding."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.core.store import StoreReader
from actstore.serve.common import kept


def logit_effects(store: StoreReader, vec: np.ndarray | None, n: int = 12) -> dict[str, Any] | None:
    """The tokens whose logits ``vec`` (a d_model write direction) raises and lowers most, through the
    final norm's weight and the unembedding (None when the store holds no unembedding)."""
    if vec is None or not store.has_weight("unembed") and not store.has_weight("embed"):
        return None
    U = kept(store, "unembed", (), lambda: store.weight("unembed"))  # read once (weights never change)
    w = vec.astype(np.float32)
    if store.has_weight("final_norm_weight"):
        w = w * kept(store, "final_norm_weight", (), lambda: store.weight("final_norm_weight"))
    logits = U @ w
    top = np.argsort(-logits)[:n]
    bottom = np.argsort(logits)[:n]
    names = _token_names(store, np.concatenate([top, bottom]))
    return {
        "promoted": [
            {"token_id": int(i), "token": names.get(int(i), str(i)), "logit": float(logits[i])} for i in top
        ],
        "suppressed": [
            {"token_id": int(i), "token": names.get(int(i), str(i)), "logit": float(logits[i])}
            for i in bottom
        ],
        "through": "final norm weight x unembedding"
        if store.has_weight("final_norm_weight")
        else "unembedding",
    }


def _token_names(store: StoreReader, ids: np.ndarray) -> dict[int, str]:
    try:
        from actstore.query.select.store_tokenizer import stored_tokenizer

        tok = kept(store, "tokenizer", (), lambda: stored_tokenizer(store))
        return {int(i): str(tok.decode([int(i)])) for i in ids}  # the token's text (a space as a space)
    except Exception:  # noqa: BLE001  (no tokenizer stored: ids are shown)
        return {}


def write_vector(
    store: StoreReader, kind: str, layer: int, index: int, vec: np.ndarray | None
) -> np.ndarray | None:
    """The d_model direction the unit writes (a neuron's row of W_down; a direction itself, or the one a
    head is read along; None for a head's norm, whose output is not one direction)."""
    if kind == "mlp" and store.has_weight("W_down"):
        w = kept(store, f"W_down:{layer}", (), lambda: store.weight("W_down", layer))  # [d_mlp, d_model]
        return np.asarray(w[index], dtype=np.float32)
    if kind in ("direction", "head"):
        return vec
    return None
