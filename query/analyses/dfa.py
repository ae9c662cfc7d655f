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
[m, d_model] array), ``neuron:LAYER:INDEX`` (the neuron's output weights, its row of ``W_down``; its input weights,
``neuron:LAYER:INDEX:in|up``, come from the store's model: :func:`actstore.jobs.model.direction_for`),
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


def neuron_spec(store: StoreReader, rest: str) -> tuple[int, int, str]:
    """(layer, neuron, side) of ``neuron:LAYER:INDEX[:out|in|up]`` (``rest`` is what follows
    ``neuron:``), each checked against the store's geometry; one QueryError otherwise."""
    g = store.geometry
    parts = rest.split(":")
    if len(parts) not in (2, 3) or len(parts) == 3 and parts[2] not in ("out", "in", "up"):
        raise QueryError("direction: neuron:LAYER:INDEX[:out|in|up] (out: the row of W_down)")
    layer, index = _int(parts[0], "the layer"), _int(parts[1], "the neuron")
    if not 0 <= layer < g.n_layers:
        raise QueryError(f"direction: layer {layer} out of range 0..{g.n_layers - 1}")
    if not 0 <= index < g.d_mlp:
        raise QueryError(f"direction: neuron {index} out of range 0..{g.d_mlp - 1}")
    return layer, index, parts[2] if len(parts) == 3 else "out"


def load_direction(store: StoreReader, spec: str) -> np.ndarray:
    """The direction ``spec`` names (see the module docstring), as float32 [d_model], its width checked."""
    g = store.geometry
    kind, _, rest = spec.partition(":")
    if kind == "neuron":
        layer, index, side = neuron_spec(store, rest)
        if side != "out":
            raise QueryError(
                "direction: a neuron's input weights are not stored (the store keeps W_down): the dfa and topk "
                "commands (actstore.jobs.model.direction_for) read neuron:LAYER:INDEX:in|up from the store's model"
            )
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


@dataclass(frozen=True)
class _Projections:
    """``u`` through the weights the scores need, for layers ``L``: ``pg`` [l, H_kv, G, dh] (``W_O,h u``
    by key/value head and its group), ``q`` [m, d_mlp] (``W_down u``) and ``b`` [m] (``b_down . u``)
    at the layers ``mlp_at`` (indices into ``L``) whose MLP the store kept."""

    layers: tuple[int, ...]
    K: int
    pg: torch.Tensor
    mlp_at: tuple[int, ...]
    q: torch.Tensor
    b: torch.Tensor


_PROJECTIONS: dict[tuple[int, bytes, tuple[int, ...]], tuple[Any, _Projections]] = {}


def _projections(store: StoreReader, u: np.ndarray, layers: Sequence[int] | None) -> _Projections:
    """The projections of ``u`` (see :class:`_Projections`), kept for the last few (store, ``u``,
    layers): a page asking one position after another projects ``W_O`` and ``W_down`` once."""
    g = store.geometry
    kept = store.manifest.ingest.get("kept") or {}
    L = tuple(kept.get("z") or []) if layers is None else tuple(int(x) for x in layers)
    K = require_sources(store, list(L))
    uu = np.ascontiguousarray(u, dtype=np.float32)
    W = weights(store)
    key = (id(W), uu.tobytes(), L)
    hit = _PROJECTIONS.get(key)
    if hit is not None and hit[0] is W:
        return hit[1]
    ut = torch.from_numpy(uu)
    p = torch.einsum("lhde,e->lhd", W.layers("W_O", list(L)), ut)  # [l, H, dh]
    have = tuple(i for i, x in enumerate(L) if x in (kept.get("mlp") or []))
    ml = [L[i] for i in have]
    q = torch.einsum("lme,e->lm", W.layers("W_down", ml), ut) if ml else torch.zeros((0, g.d_mlp))
    bias = W.layers("b_down", ml) @ ut if ml else torch.zeros(0)
    proj = _Projections(L, K, p.reshape(len(L), g.n_kv_heads, g.kv_group, g.d_head), have, q, bias)
    while len(_PROJECTIONS) >= 8:
        _PROJECTIONS.pop(next(iter(_PROJECTIONS)))
    _PROJECTIONS[key] = (W, proj)  # (the cache is held, so its id is not reused while here)
    return proj


def _block_scores(
    store: StoreReader, rows: np.ndarray, proj: _Projections
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """The scores of ``rows`` in the stored layout: ``score`` [n, K, l, H] (0 in an empty slot),
    ``a`` the stored ``attn`` entries [n, 2K, l, H] (weights, then row offsets), ``rem`` [n, l, H]
    and ``mlp`` [n, l] (NaN where the MLP is not kept).  One flat gather of ``V . p`` per term."""
    g = store.geometry
    L, K = list(proj.layers), proj.K
    nl, H = len(L), g.n_heads
    a = torch.from_numpy(read_rows(store, "attn", rows, L, per=2 * K))  # [n, 2K, l, H]
    weight = a[:, :K]
    z = torch.from_numpy(read_rows(store, "z", rows, L)[:, 0])  # [n, l, H, dh]
    p = proj.pg.reshape(nl, H, g.d_head)
    zp = (z * p).sum(-1)  # [n, l, H] (einsum would copy z into a batched matmul's layout first)
    offset = a[:, K:]  # exact integers in the storage dtype, 0 in an empty slot
    max_offset = int(offset.max()) if offset.numel() else 0
    used, idx = _source_index(rows, max_offset, weight, offset, nl * H)
    V = torch.from_numpy(read_rows(store, "v", used, L)[:, 0])  # [u, l, Hkv, dh]
    # V . p per (source row, layer, head), each kv head against its group of query heads
    vp = torch.einsum("ulkd,lkgd->ulkg", V, proj.pg).reshape(-1)  # [u * l * H]
    score = weight * vp[idx]  # (weight 0 in an empty slot: score 0)
    rem = zp - score.sum(1)
    mlp = np.full((rows.size, nl), np.nan, dtype=np.float32)
    if proj.mlp_at:
        ml = [L[i] for i in proj.mlp_at]
        act = torch.from_numpy(read_rows(store, "mlp", rows, ml)[:, 0])  # [n, m, d_mlp]
        dot = torch.empty((len(ml), rows.size), dtype=torch.float32)
        for i in range(len(ml)):  # one matrix-vector product a layer, on the strided rows (no copy)
            torch.mv(act[:, i], proj.q[i], out=dot[i])
        mlp[:, list(proj.mlp_at)] = (dot.T + proj.b).numpy()
    return score, a, rem, mlp


def dfa_rows(
    store: StoreReader, rows: Sequence[int] | np.ndarray, u: np.ndarray, layers: Sequence[int] | None = None
) -> RowScores:
    """``u``'s share of every kept source, remainder and MLP at ``rows`` (global store rows)."""
    proj = _projections(store, u, layers)
    rows = np.array(rows, dtype=np.int64).reshape(-1)  # (writable: torch views it)
    score, a, rem, mlp = _block_scores(store, rows, proj)
    K = proj.K
    weight = a[:, :K]
    src = torch.where(weight > 0, torch.from_numpy(rows)[:, None, None, None] - a[:, K:].to(torch.int64), -1)
    return RowScores(
        rows,
        proj.layers,
        score.permute(0, 2, 3, 1).contiguous().numpy(),
        src.permute(0, 2, 3, 1).contiguous().numpy(),
        rem.numpy().astype(np.float32, copy=False),
        mlp,
    )


def _source_index(
    rows: np.ndarray, max_offset: int, weight: torch.Tensor, offset: torch.Tensor, per_row: int
) -> tuple[np.ndarray, torch.Tensor]:
    """The store rows whose ``V`` the kept sources need, and each slot's flat index into their
    ``V . p`` [u, l, H] (``per_row = l * H``; an empty slot's points at some row read anyway, its
    weight is 0).  A source lies at most ``max_offset`` rows before its target, so for a block of
    consecutive rows the sources span the block and at most one window before it: that range is read
    whole, and the index is one float32 multiply-add of the stored offsets (exact below 2^24); a
    scattered selection reads its distinct sources only."""
    lo, hi = max(0, int(rows.min()) - max_offset), int(rows.max())
    n, K, nl, H = offset.shape
    lh = torch.arange(per_row, dtype=torch.float32).view(1, 1, nl, H)
    if hi - lo + 1 <= 2 * rows.size + max_offset and (hi - lo + 1) * per_row < 2**24:
        base = torch.from_numpy((rows - lo).astype(np.float32) * per_row)[:, None, None, None] + lh
        idx = torch.add(base, offset, alpha=-per_row).to(torch.int32)  # [n, K, l, H]
        return np.arange(lo, hi + 1, dtype=np.int64), idx
    src = torch.from_numpy(rows)[:, None, None, None] - offset.to(torch.int64)
    used = np.unique(src[weight > 0].numpy())
    if not used.size:
        used = rows[:1]
    at = torch.from_numpy(np.searchsorted(used, src.numpy()).clip(max=used.size - 1))
    return used, at.mul_(per_row).add_(lh.to(torch.int64))


BLOCK_BYTES = 1 << 26  # float32 bytes of the arrays one block of dfa_top reads, about 64 MB


def block_rows(store: StoreReader, batch_rows: int, layers: Sequence[int] | None = None) -> int:
    """Rows per block of :func:`dfa_top`: at most ``batch_rows``, and few enough (at least 64) that the
    block's ``attn``, ``z``, ``v`` and ``mlp`` rows, widened to float32, stay within ``BLOCK_BYTES``
    (a SmolLM2-135M row of every layer is 311 KB: 215 rows; a tiny-llama row 2.8 KB)."""
    g = store.geometry
    kept = store.manifest.ingest.get("kept") or {}
    nl = len(kept.get("z") or []) if layers is None else len(layers)
    K = max(1, int(store.manifest.ingest.get("sources") or 1))
    per = 4 * nl * (2 * K * g.n_heads + g.n_heads * g.d_head + g.n_kv_heads * g.d_head + g.d_mlp)
    return max(64, min(int(batch_rows), BLOCK_BYTES // max(1, per)))


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
    """Stream ``rows`` in blocks of ``batch_rows`` (fewer where a block's arrays would pass
    ``BLOCK_BYTES``: :func:`block_rows`): keep the ``k`` terms of largest ``|score|`` (memory: ``k``
    plus one block) and sum each head's source and remainder shares and each MLP's."""
    if k < 1:
        raise QueryError("dfa: k must be 1 or more")
    best_s = np.zeros(0, np.float32)
    best = np.zeros((0, 5), np.int64)  # row, layer, head, slot, source row
    rows = np.array(rows, dtype=np.int64).reshape(-1)  # (writable: torch views it)
    proj = _projections(store, u, layers)  # once for the whole selection
    Ls = proj.layers
    K = proj.K
    head_src = np.zeros((len(Ls), store.geometry.n_heads), np.float64)
    head_rem = np.zeros_like(head_src)
    mlp_tot = np.zeros(len(Ls), np.float64)
    step = block_rows(store, batch_rows, Ls)
    for i in range(0, len(rows), step):
        block = rows[i : i + step]
        score, a, rem, mlp = _block_scores(store, block, proj)  # score [n, K, l, H]
        head_src += score.sum((0, 1)).numpy()
        head_rem += rem.sum(0).numpy()
        mlp_tot += mlp.sum(0)
        flat = score.reshape(-1)
        m = min(k, flat.numel())
        pick = torch.topk(flat.abs(), m, sorted=False).indices.numpy()
        ri, ki, li, hi = np.unravel_index(pick, tuple(score.shape))
        w = a[ri, ki, li, hi].numpy()
        src = np.where(w > 0, block[ri] - a[ri, K + ki, li, hi].numpy().astype(np.int64), -1)
        cand = np.stack([block[ri], np.asarray(Ls)[li], hi, ki, src], 1)
        best_s = np.concatenate([best_s, flat.numpy()[pick]])
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
    if len(rows):
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
