"""Any direction decomposed (direct feature attribution, TokenScore at any token): for a direction
``u`` [d_model] and a corpus store ingested with ``--sources K``,

    score(t, l, h, j)  = u . Delta_att,h(t, j) = A_h(t, j) * (V_kv(h)(j) . p_{l,h}),   p_{l,h} = W_O,h u
    remainder(t, l, h) = u . rem_h(t) W_O,h   = z_h(t) . p_{l,h} - sum_j score(t, l, h, j)
    mlp(t, l)          = u . mlp_l(t)         = a_l(t) . (W_down,l u) + b_down,l . u

(TokenScore, arXiv 2604.19934, for any direction instead of an unembedding row.)  Everything is
computed in factor space: one ``d_head`` dot product per (row, layer, head, source), no ``d_model``
vector per source.  :func:`dfa_top` streams a selection in blocks and keeps the top ``k`` terms and
the per-head totals, in memory bounded by ``k`` and the block size.

Directions (:func:`load_direction`): ``FILE.npy`` (a [d_model] vector, or ``FILE.npy:ROW`` of an
[m, d_model] array), ``neuron:LAYER:INDEX`` (the neuron's output weights, its row of ``W_down``),
``token:ID`` (the token's unembedding row through the final norm's weight), ``sae:PATH:INDEX[:dec|enc]``
(a latent's decoder (default) or encoder row from a SAELens folder (cfg.json and
sae_weights.safetensors), a dictionary_learning ``ae.pt`` (read as its ``AutoEncoder.from_pretrained``
reads it: decoder columns normalised, encoder rows scaled to match), or an SAE's .npy matrix),
``probe:[STORE:]RUN:RELATION[:LAYER[.HEAD]]`` (a probe run's weights for a relation:
:mod:`actstore.query.analyses.directions`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader
from actstore.query.select.corpus_sources import read_rows, require_sources
from actstore.query.select.weights import weights


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise QueryError(f"direction: {what} must be an integer, not {text!r}") from None


def load_direction(store: StoreReader, spec: str) -> np.ndarray:
    """The direction ``spec`` names (see the module docstring), as float32 [d_model], its width checked."""
    g = store.geometry
    kind, _, rest = spec.partition(":")
    if kind == "neuron":
        parts = rest.split(":")
        if len(parts) not in (2, 3):
            raise QueryError("direction: neuron:LAYER:INDEX[:out] (its output weights, the row of W_down)")
        layer, index = _int(parts[0], "the layer"), _int(parts[1], "the neuron")
        if len(parts) == 3 and parts[2] != "out":
            raise QueryError(
                "direction: a neuron's input weights are not stored (the store keeps W_down); use neuron:LAYER:INDEX"
            )
        if not 0 <= layer < g.n_layers:
            raise QueryError(f"direction: layer {layer} out of range 0..{g.n_layers - 1}")
        if not 0 <= index < g.d_mlp:
            raise QueryError(f"direction: neuron {index} out of range 0..{g.d_mlp - 1}")
        u = store.weight("W_down", layer)[index]
    elif kind == "token":
        from actstore.query.analyses.readout import FinalReadout

        tid = _int(rest, "the token id")
        r = FinalReadout.from_store(store)
        if not 0 <= tid < r.unembed.shape[0]:
            raise QueryError(f"direction: token {tid} out of range 0..{r.unembed.shape[0] - 1}")
        u = (r.unembed[tid] * r.weight).numpy()
    elif kind == "sae":
        u = _sae_row(rest)
    elif kind == "probe":
        from actstore.query.analyses.directions import probe_direction

        u = probe_direction(store, rest)
    else:
        spec = rest if kind == "npy" else spec
        path, _, row = (
            spec.rpartition(":") if spec.count(":") and not spec.endswith(".npy") else (spec, "", "")
        )
        u = _npy(path, row)
    u = np.asarray(u, dtype=np.float32)
    if u.shape != (g.d_model,):
        raise QueryError(
            f"direction {spec!r} has shape {tuple(u.shape)}; this store's residual width is {g.d_model}"
        )
    if not np.isfinite(u).all():
        raise QueryError(f"direction {spec!r} holds NaN or infinite values")
    return u


def _npy(path: str, row: str) -> np.ndarray:
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise QueryError(f"direction: cannot read {path} as a .npy array ({e})") from None
    if row:
        i = _int(row, "the row")
        if a.ndim != 2 or not 0 <= i < a.shape[0]:
            raise QueryError(f"direction: row {i} out of range for {path}'s array of shape {a.shape}")
        a = a[i]
    return a


def _sae_row(rest: str) -> np.ndarray:
    """Latent ``INDEX``'s decoder or encoder row of a SAELens folder, a dictionary_learning ``ae.pt``
    or a .npy matrix [d_sae, d_model]."""
    parts = rest.split(":")
    which = parts.pop() if parts and parts[-1] in ("dec", "enc") else "dec"
    if len(parts) < 2:
        raise QueryError("direction: sae:PATH:INDEX[:dec|enc]")
    index = _int(parts[-1], "the latent")
    path = Path(":".join(parts[:-1]))
    if path.suffix == ".npy":
        mat = _npy(str(path), "")
        if mat.ndim != 2:
            raise QueryError(f"direction: {path} is not a [d_sae, d_model] matrix (shape {mat.shape})")
    elif path.is_dir() and (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        from safetensors.numpy import load_file

        try:
            json.loads((path / "cfg.json").read_text())
            w = load_file(str(path / "sae_weights.safetensors"))
        except Exception as e:
            raise QueryError(f"direction: {path} is not a readable SAELens checkpoint ({e})") from None
        key = "W_dec" if which == "dec" else "W_enc"
        if key not in w:
            raise QueryError(f"direction: {path} has no {key} (not an SAELens checkpoint)")
        mat = w[key] if which == "dec" else w[key].T  # W_dec [d_sae, d_in], W_enc [d_in, d_sae]
    elif path.is_file() and path.suffix in (".pt", ".pth"):
        try:
            sd: Any = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:
            raise QueryError(f"direction: {path} is not a readable checkpoint ({e})") from None
        key = "decoder.weight" if which == "dec" else "encoder.weight"
        if not isinstance(sd, dict) or key not in sd:
            raise QueryError(f"direction: {path} is not a dictionary_learning checkpoint (no {key})")
        t = sd[key].float().numpy()
        mat = t.T if which == "dec" else t  # decoder.weight [d_in, d_sae], encoder.weight [d_sae, d_in]
        # as dictionary_learning's AutoEncoder.from_pretrained loads it (normalize_decoder=True): unit
        # decoder columns, the encoder rows scaled by the norms (the same function)
        dn = np.linalg.norm(sd["decoder.weight"].float().numpy(), axis=0) if "decoder.weight" in sd else None
        if dn is not None and dn.shape == (mat.shape[0],) and not np.allclose(dn, 1.0):
            mat = mat / dn[:, None] if which == "dec" else mat * dn[:, None]
    else:
        raise QueryError(
            f"direction: {path} is not an SAE checkpoint (a SAELens folder with cfg.json and "
            "sae_weights.safetensors, a dictionary_learning ae.pt, or a .npy matrix)"
        )
    if not 0 <= index < mat.shape[0]:
        raise QueryError(f"direction: latent {index} out of range 0..{mat.shape[0] - 1}")
    return mat[index]


@dataclass(frozen=True)
class RowScores:
    """The decomposition of ``u`` at ``n`` rows: ``source`` [n, l, h, K] (0 in an empty slot),
    ``source_row`` [n, l, h, K] (-1 there), ``remainder`` [n, l, h], ``mlp`` [n, l] (NaN at a layer
    whose MLP the store did not keep)."""

    rows: np.ndarray
    layers: tuple[int, ...]
    source: np.ndarray
    source_row: np.ndarray
    remainder: np.ndarray
    mlp: np.ndarray


def dfa_rows(
    store: StoreReader, rows: Sequence[int] | np.ndarray, u: np.ndarray, layers: Sequence[int] | None = None
) -> RowScores:
    """``u``'s share of every kept source, remainder and MLP at ``rows`` (global store rows)."""
    g = store.geometry
    kept = store.manifest.ingest.get("kept") or {}
    L = list(kept.get("z") or []) if layers is None else [int(x) for x in layers]
    K = require_sources(store, L)
    rows = np.array(rows, dtype=np.int64).reshape(-1)  # a copy: from_numpy warns on read-only (Arrow) arrays
    uu = torch.from_numpy(np.asarray(u, dtype=np.float32))
    W = weights(store)
    p = torch.einsum("lhde,e->lhd", W.layers("W_O", L), uu).numpy()  # [l, H, dh]
    # everything in the stored layout [n, K, l, H] (contiguous), turned to [n, l, H, K] once at the end
    a = torch.from_numpy(read_rows(store, "attn", rows, L, per=2 * K))  # [n, 2K, l, H]
    weight = a[:, :K]
    valid = weight > 0
    offset = a[:, K:].to(torch.int64)  # (exact integers in the storage dtype; 0 in an empty slot)
    z = torch.from_numpy(read_rows(store, "z", rows, L)[:, 0])  # [n, l, H, dh]
    pt = torch.from_numpy(p)
    zp = torch.einsum("nlhd,lhd->nlh", z, pt)  # [n, l, H]
    score = torch.zeros(weight.shape, dtype=torch.float32)
    rows_t = torch.from_numpy(rows)[:, None, None, None]
    if bool(valid.any()):
        used, at = _source_rows(rows_t - offset, valid, rows, int(offset.max()))
        V = torch.from_numpy(read_rows(store, "v", used, L)[:, 0])  # [u, l, Hkv, dh]
        # V . p per (source row, layer, head), each kv head against its group of query heads
        pg = pt.view(len(L), g.n_kv_heads, g.kv_group, g.d_head)
        vp = torch.einsum("ulkd,lkgd->ulkg", V, pg).reshape(-1)  # [u * l * H]
        lh = torch.arange(len(L) * g.n_heads).view(1, 1, len(L), g.n_heads)
        got = vp[at.mul_(len(L) * g.n_heads).add_(lh)]  # [n, K, l, H]
        score = torch.where(valid, weight * got, 0.0)
    src = torch.where(valid, rows_t - offset, -1)
    score, src = score.permute(0, 2, 3, 1).contiguous(), src.permute(0, 2, 3, 1).contiguous()
    rem = (zp - score.sum(-1)).numpy()
    mlp = np.full((rows.size, len(L)), np.nan, dtype=np.float32)
    have = [i for i, x in enumerate(L) if x in (kept.get("mlp") or [])]
    if have:
        ml = [L[i] for i in have]
        act = torch.from_numpy(read_rows(store, "mlp", rows, ml)[:, 0])  # [n, m, d_mlp]
        q = torch.einsum("lme,e->lm", W.layers("W_down", ml), uu)
        b = W.layers("b_down", ml) @ uu
        mlp[:, have] = ((act * q).sum(-1) + b).numpy()
    return RowScores(rows, tuple(L), score.numpy(), src.numpy(), rem.astype(np.float32), mlp)


def _source_rows(
    src: torch.Tensor, valid: torch.Tensor, rows: np.ndarray, max_offset: int
) -> tuple[np.ndarray, torch.Tensor]:
    """The store rows whose ``V`` the kept sources ``src`` (``valid`` marks them) need, and each
    slot's index among them (0 in an empty slot).  A source lies at most ``max_offset`` rows before
    its target, so for a block of consecutive rows the sources span the block and at most one window
    before it: that range is read whole (no sort of every source); a scattered selection reads its
    distinct sources only."""
    lo, hi = max(0, int(rows.min()) - max_offset), int(rows.max())
    if hi - lo + 1 <= 2 * rows.size + max_offset:
        return np.arange(lo, hi + 1, dtype=np.int64), torch.where(valid, src - lo, 0)
    used = np.unique(src[valid].numpy())
    at = torch.from_numpy(np.searchsorted(used, np.maximum(src.numpy(), 0)))
    return used, torch.where(valid, at, 0)


@dataclass(frozen=True)
class DfaResult:
    """The top ``k`` (row, layer, head, source) terms by absolute score, and the totals per head
    (sources, remainder) and per MLP layer over the selection."""

    terms: pa.Table
    totals: pa.Table


def dfa_top(
    store: StoreReader,
    rows: np.ndarray,
    u: np.ndarray,
    k: int = 20,
    layers: Sequence[int] | None = None,
    batch_rows: int = 1024,
) -> DfaResult:
    """Stream ``rows`` in blocks of ``batch_rows``: keep the ``k`` terms of largest ``|score|``
    (memory: ``k`` plus one block) and sum each head's source and remainder shares and each MLP's."""
    if k < 1:
        raise QueryError("dfa: k must be 1 or more")
    best_s = np.zeros(0, np.float32)
    best = np.zeros((0, 5), np.int64)  # row, layer, head, slot, source row
    head_src: np.ndarray | None = None
    head_rem = mlp_tot = np.zeros(0)
    Ls: tuple[int, ...] = ()
    for i in range(0, len(rows), batch_rows):
        r = dfa_rows(store, rows[i : i + batch_rows], u, layers)
        Ls = r.layers
        if head_src is None:
            head_src = np.zeros(r.remainder.shape[1:], np.float64)
            head_rem = np.zeros_like(head_src)
            mlp_tot = np.zeros(r.mlp.shape[1], np.float64)
        head_src += r.source.sum((0, 3))
        head_rem += r.remainder.sum(0)
        mlp_tot += r.mlp.sum(0)
        flat = r.source.reshape(-1)
        m = min(k, flat.size)
        pick = torch.topk(torch.from_numpy(flat).abs(), m, sorted=False).indices.numpy()
        n, nl, nh, nk = r.source.shape
        ri, li, hi, ki = np.unravel_index(pick, (n, nl, nh, nk))
        cand = np.stack([r.rows[ri], np.asarray(Ls)[li], hi, ki, r.source_row[ri, li, hi, ki]], 1)
        best_s = np.concatenate([best_s, flat[pick]])
        best = np.concatenate([best, cand])
        keep = np.argsort(-np.abs(best_s), kind="stable")[:k]
        best_s, best = best_s[keep], best[keep]
    terms = pa.table(
        {
            "rank": pa.array(np.arange(best_s.size), pa.int32()),
            "row": pa.array(best[:, 0]),
            "layer": pa.array(best[:, 1].astype(np.int32)),
            "head": pa.array(best[:, 2].astype(np.int32)),
            "source_row": pa.array(best[:, 4]),
            "score": pa.array(best_s.astype(np.float32)),
        }
    )
    parts: list[str] = []
    lay: list[int] = []
    head: list[int] = []
    val: list[float] = []
    if head_src is not None:
        for at, layer in enumerate(Ls):
            for h in range(head_src.shape[1]):
                parts += ["sources", "remainder"]
                lay += [layer, layer]
                head += [h, h]
                val += [float(head_src[at, h]), float(head_rem[at, h])]
            parts.append("mlp")
            lay.append(layer)
            head.append(-1)
            val.append(float(mlp_tot[at]))
    totals = pa.table(
        {
            "part": pa.array(parts, pa.string()),
            "layer": pa.array(lay, pa.int32()),
            "head": pa.array(head, pa.int32()),
            "total": pa.array(val, pa.float64()),
        }
    )
    return DfaResult(terms, totals)
