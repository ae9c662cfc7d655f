"""MAPS, static part: what each attention head does, from the store's weights alone.

For head h of layer l (Elhelo & Geva, 2025) the vocabulary map is

    M = E W_VO U,    W_VO = W_V[l, kv(h)] W_O[l, h]       (kv(h) = h // (H / H_kv))

and its row for source token s scores every vocabulary token as a target.  We never build
the |V| x |V| matrix: W_VO has rank d_head, so a row is ``x_s B_h`` with
``x_s = e_s W_V[l, kv(h)]`` (d_head numbers) and ``B_h = W_O[l, h] U`` ([d_head, |V|], made
once per head; for few rows ``(x_s W_O[l, h]) U`` is cheaper, see
:class:`~actstore.query.maps.projection.HeadMap`).  Rows are computed only for the source tokens a relation
needs, in chunks, so peak memory is a few chunks of ``[rows, |V|]`` whatever the vocabulary.

Scores, per relation R with token pairs (s, t):

* ``rank_up(s, t)``   = number of vocabulary entries of row m_s strictly greater than m_s[t]
  (0 = t is the row's maximum); ``rank_down`` the same for ``-m_s``.  Ranks are kept up to
  ``k_max`` (only each row's k_max largest and smallest entries are needed: a top-k, not a
  sort), so any k <= k_max can be scored afterwards.
* relation score  phi_R(h)  = share of pairs with ``rank_up < k``  (t in the top-k of m_s);
* suppression score         = share of pairs with ``rank_down < k`` (t in the top-k of -m_s);
* head h *implements* R when phi_R(h) >= 0.15 (:data:`~actstore.query.maps.defaults.IMPLEMENTS_THRESHOLD`), and
  *suppresses* R when its suppression score is.

``k`` follows the authors' released code by default (:mod:`actstore.query.maps.defaults`), and so do the
pairs (:mod:`actstore.query.maps.pairs`: single-token pairs, relations with too few pairs excluded).

Ties are broken in the target's favour (strictly greater entries are counted), which
``torch.topk`` leaves unspecified.

Choices where the paper leaves room (documented, and parameters where it matters):

* Embedding scale (Gemma multiplies embeddings by sqrt(d_model)): applied, but it is one
  positive number per row, so neither phi nor sigma changes.
* Final norm: by default (``final_norm=True``) the unembedding is read through the final
  norm's elementwise weight, U' = diag(w) U^T, which is how a head's output reaches the
  logits (the norm's 1/rms is one positive number per position and cannot change a rank).
  The paper's code (TransformerLens without weight processing) uses the raw W_U;
  ``final_norm=False`` reproduces that.  Dynamic scores use the same U'.
* First MLP: the paper's code (``apply_first_mlp``, on for every model but Llama-3.1-70B:
  :func:`~actstore.query.maps.defaults.paper_first_mlp`) replaces the source embeddings by the first MLP's output on them,
  MLP0(norm(e_s)), for layers >= 1.  The store does not hold that MLP's input weights, so this
  needs the model: pass ``first_mlp`` (:func:`actstore.ingest.capture.first_mlp.first_mlp_transform`).  The
  command line turns it on by default as the authors do (``--no-first-mlp``: from the store's
  weights alone).  On SmolLM2 it matters a great deal: it lifts the static-dynamic correlation
  from 0.0-0.6 to 0.7-1.0.
* Not applied, because the store does not hold them: the attention block's input norm
  weight (before W_V) and Gemma's post-attention norm.  Biases b_V, b_O are left out, as in
  the paper.

Salient operations (:func:`salient_operations`): sigma_t = |e_t W_VO| / |e_t| for every
vocabulary token t (through the Gram matrix W_O W_O^T, so again no [|V|, d_model] product
per head), the top tokens by sigma and, for each, its top mapped tokens in m_t.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import MapsError
from actstore.core.store import StoreReader
from actstore.core.tables import rows_table
from actstore.query.maps.defaults import DEFAULT_K, IMPLEMENTS_THRESHOLD, ROW_CHUNK, check_k, k_of
from actstore.query.maps.pairs import TokenPairs
from actstore.query.maps.projection import VocabProjection, head_list, target_ranks

# ----------------------------------------------------------------------------------- static scores


@dataclass(frozen=True)
class StaticScores:
    """Per pair and head: the target's rank in m_s and in -m_s (censored at ``k_max``).
    Scores follow for any k <= k_max."""

    pairs: TokenPairs
    rank_up: np.ndarray  # [n_pairs, L, H] int32
    rank_down: np.ndarray  # [n_pairs, L, H] int32
    k_max: int = DEFAULT_K

    def score(self, k: int = DEFAULT_K) -> np.ndarray:
        """phi_R per head: [L, H]."""
        check_k(k, self.k_max)
        return (self.rank_up < k).mean(axis=0)

    def suppression(self, k: int = DEFAULT_K) -> np.ndarray:
        check_k(k, self.k_max)
        return (self.rank_down < k).mean(axis=0)


def pair_ranks(
    proj: VocabProjection,
    src: np.ndarray,
    dst: np.ndarray,
    *,
    k_max: int = DEFAULT_K,
    heads: Iterable[tuple[int, int]] | None = None,
    rows_per_chunk: int = ROW_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Ranks (censored at ``k_max``) of ``dst[i]`` in row ``src[i]`` of every head's M:
    ([n, L, H], [n, L, H]) int32.

    Each distinct source token's row is computed once per head, in chunks of distinct sources;
    only its ``k_max`` extreme values and the pairs' target entries are kept.  Heads not in
    ``heads`` get rank -1.  ``progress(1)`` is called after each head.
    """
    g = proj.geometry
    n = int(src.size)
    up = np.full((n, g.n_layers, g.n_heads), -1, np.int32)
    down = np.full_like(up, -1)
    if n == 0:
        return up, down
    uniq, inverse = np.unique(src, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")  # pairs grouped by distinct source
    inv_sorted = inverse[order]
    bounds = np.searchsorted(inv_sorted, np.arange(0, uniq.size + rows_per_chunk, rows_per_chunk))
    uniq_t = torch.from_numpy(uniq)
    dst_sorted = torch.from_numpy(dst[order])
    wanted = head_list(proj, heads)
    by_layer: dict[int, list[int]] = {}
    for layer, head in wanted:
        by_layer.setdefault(layer, []).append(head)
    with torch.inference_mode():
        for layer, hs in by_layer.items():
            xs = {kv: proj.values(layer, kv, uniq_t) for kv in sorted({proj.kv(h) for h in hs})}
            for head in hs:
                B = proj.readout(layer, head, int(uniq.size))
                x = xs[proj.kv(head)]
                for c in range(len(bounds) - 1):
                    lo, hi = int(bounds[c]), int(bounds[c + 1])
                    if lo == hi:
                        continue
                    u0 = c * rows_per_chunk
                    rows = B(x[u0 : u0 + rows_per_chunk])  # [chunk, V]
                    local = torch.from_numpy(inv_sorted[lo:hi] - u0)
                    r_up, r_down = target_ranks(rows, dst_sorted[lo:hi], k_max, local)
                    up[order[lo:hi], layer, head] = r_up.numpy()
                    down[order[lo:hi], layer, head] = r_down.numpy()
                if progress is not None:
                    progress(1)
    return up, down


def static_scores(
    proj: VocabProjection,
    relations: Sequence[TokenPairs],
    *,
    k_max: int = DEFAULT_K,
    heads: Iterable[tuple[int, int]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, StaticScores]:
    """Ranks for every relation's pairs, all relations in one pass (shared source rows computed once;
    ``progress(1)`` after each head)."""
    if not relations:
        return {}
    if k_max < 1:
        raise MapsError(f"k must be at least 1, not {k_max}")
    src = np.concatenate([r.src for r in relations])
    dst = np.concatenate([r.dst for r in relations])
    if int(max(src.max(), dst.max())) >= proj.vocab_size or int(src.max()) >= proj.embed.shape[0]:
        raise MapsError(f"token ids exceed the store's vocabulary of {proj.vocab_size}: wrong tokenizer?")
    up, down = pair_ranks(proj, src, dst, k_max=k_max, heads=heads, progress=progress)
    out: dict[str, StaticScores] = {}
    start = 0
    for r in relations:
        stop = start + r.n_used
        out[r.relation] = StaticScores(r, up[start:stop], down[start:stop], k_max)
        start = stop
    return out


def implementing_heads(score: np.ndarray, threshold: float = IMPLEMENTS_THRESHOLD) -> list[tuple[int, int]]:
    """Heads with score >= threshold, best first."""
    layers, heads = np.nonzero(score >= threshold)
    order = np.argsort(-score[layers, heads], kind="stable")
    return [(int(layers[i]), int(heads[i])) for i in order]


def top_heads(score: np.ndarray, m: int) -> list[tuple[int, int]]:
    """The m best heads with a non-zero score (the paper's ablation set), best first."""
    flat = np.argsort(-score.ravel(), kind="stable")[:m]
    H = score.shape[1]
    return [(int(i // H), int(i % H)) for i in flat if score.ravel()[i] > 0]


# ----------------------------------------------------------------------------------- salient operations


@dataclass(frozen=True)
class SalientOps:
    layer: int
    head: int
    token_ids: np.ndarray  # [n] the most amplified tokens, by sigma
    sigma: np.ndarray  # [n]
    mapped_ids: np.ndarray  # [n, m] top mapped tokens of each


def salient_operations(
    proj: VocabProjection,
    heads: Iterable[tuple[int, int]] | None = None,
    *,
    n_tokens: int = 10,
    n_mappings: int = 5,
    vocab_limit: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[SalientOps]:
    """Per head: the ``n_tokens`` tokens with the largest sigma_t and each one's top ``n_mappings`` targets.

    ``vocab_limit`` restricts the candidate source tokens to ids below it (the tokenizer's size,
    so padding rows of the embedding never count); ``progress(1)`` is called after each head.
    """
    if n_tokens < 1 or n_mappings < 1:
        raise MapsError("the numbers of salient tokens and of mappings per token must be positive")
    V_in = (
        int(proj.embed.shape[0]) if vocab_limit is None else min(int(vocab_limit), int(proj.embed.shape[0]))
    )
    all_ids = torch.arange(V_in)
    wanted = head_list(proj, heads)
    out: list[SalientOps] = []
    with torch.inference_mode():
        cache: dict[tuple[int, int], torch.Tensor] = {}
        for layer, head in wanted:
            key = (layer, proj.kv(head))
            if key not in cache:
                cache.clear()  # heads come layer by layer: keep one layer's values
                E = proj.sources(layer, all_ids)
                e_norm = E.norm(dim=1)
                cache[key] = E @ proj.W_V[layer, key[1]]  # [V, dh]
            x = cache[key]
            WO = proj.W_O[layer, head]
            gram = WO @ WO.T  # [dh, dh]: |x W_O|^2 = x G x^T
            sq = ((x @ gram) * x).sum(1).clamp(min=0)
            sigma = torch.where(e_norm > 0, sq.sqrt() / e_norm.clamp(min=1e-30), torch.zeros_like(sq))
            top = torch.topk(sigma, min(n_tokens, V_in)).indices
            rows = (x[top] @ WO) @ proj.U_T
            mapped = torch.topk(rows, min(n_mappings, rows.shape[1]), dim=1).indices
            out.append(SalientOps(layer, head, top.numpy(), sigma[top].numpy(), mapped.numpy()))
            if progress is not None:
                progress(1)
    return out


# ----------------------------------------------------------------------------------- tables


def scores_table(
    scores: dict[str, StaticScores], k: int | Mapping[str, int], threshold: float, kv_group: int
) -> pa.Table:
    """One row per (relation, layer, head); ``k`` for all relations or per relation."""
    rows = []
    for name, s in scores.items():
        kr, p = k_of(k, name), s.pairs
        phi, sup = s.score(kr), s.suppression(kr)
        rows += [
            (name, layer, h, h // kv_group, float(phi[layer, h]), float(sup[layer, h]))
            + (bool(phi[layer, h] >= threshold), bool(sup[layer, h] >= threshold), kr)
            + (p.n_pairs, p.n_used, p.n_multi_token)
            for layer, h in np.ndindex(phi.shape)
        ]
    return rows_table(
        rows,
        pa.schema(
            [
                ("relation", pa.string()),
                ("layer", pa.int32()),
                ("head", pa.int32()),
                ("kv_head", pa.int32()),
                ("score", pa.float64()),
                ("suppression", pa.float64()),
                ("implements", pa.bool_()),
                ("suppresses", pa.bool_()),
                ("k", pa.int32()),
                ("n_pairs", pa.int32()),
                ("n_used", pa.int32()),
                ("n_multi_token", pa.int32()),
            ]
        ),
    )


def relation_summary(name: str, s: StaticScores, k: int, threshold: float) -> dict[str, Any]:
    phi, sup = s.score(k), s.suppression(k)
    best = np.unravel_index(int(np.argmax(phi)), phi.shape)
    p = s.pairs
    return {
        "relation": name,
        "k": int(k),
        "n_pairs": p.n_pairs,
        "n_used": p.n_used,
        "n_multi_token": p.n_multi_token,
        "n_unknown": p.n_unknown,
        "n_skipped_multi_token": p.n_skipped_multi_token,
        "n_implementing": int((phi >= threshold).sum()),
        "n_suppressing": int((sup >= threshold).sum()),
        "max_score": float(phi.max()),
        "best_layer": int(best[0]),
        "best_head": int(best[1]),
        "max_suppression": float(sup.max()),
    }


def salient_table(ops: Sequence[SalientOps], decode: Any) -> pa.Table:
    """One row per (head, salient token) with its mapped tokens as lists; ``decode(ids) -> list[str]``."""
    rows = []
    for op in ops:
        names = decode(op.token_ids.tolist())
        for r, (tid, name, sig, mapped) in enumerate(
            zip(op.token_ids.tolist(), names, op.sigma.tolist(), op.mapped_ids)
        ):
            ids = [int(i) for i in mapped]
            rows.append((op.layer, op.head, r, int(tid), name, float(sig), ids, decode(ids)))
    return rows_table(
        rows,
        pa.schema(
            [
                ("layer", pa.int32()),
                ("head", pa.int32()),
                ("rank", pa.int32()),
                ("token_id", pa.int32()),
                ("token", pa.string()),
                ("sigma", pa.float32()),
                ("mapped_ids", pa.list_(pa.int32())),
                ("mapped_tokens", pa.list_(pa.string())),
            ]
        ),
    )


def token_decoder(tokenizer: Any) -> Any:
    """ids -> the text of each token on its own (as the paper prints them)."""

    def decode(ids: list[int]) -> list[str]:
        return [str(tokenizer.decode([i])) for i in ids]

    return decode


# ----------------------------------------------------------------------------------- stored scores


@dataclass(frozen=True)
class StoredScores:
    """A relation's static scores as an ``actstore maps`` run wrote them (tables ``maps_scores``
    and ``maps_relations``), with the pair counts that run saw."""

    relation: str
    run_id: str
    score: np.ndarray  # [L, H] phi_R at the run's k
    n_pairs: int
    n_used: int
    n_multi_token: int
    n_unknown: int

    def same_pairs(self, pairs: TokenPairs) -> bool:
        """Whether ``pairs`` has the counts the stored run recorded (the check that it read the same pair file
        with the same tokenizer; the ids themselves are not stored)."""
        return (self.n_pairs, self.n_used, self.n_multi_token, self.n_unknown) == (
            pairs.n_pairs,
            pairs.n_used,
            pairs.n_multi_token,
            pairs.n_unknown,
        )


def stored_static_scores(
    store: StoreReader,
    relations: Sequence[str],
    *,
    k: int | Mapping[str, int],
    final_norm: bool,
    first_mlp: bool,
    multi_token: str = "skip",
) -> dict[str, StoredScores]:
    """Static scores already in ``store`` for ``relations``, from the latest ``maps`` run whose settings match
    (final norm, first MLP, multi-token policy) and that scored the relation at its ``k`` (one for all, or per
    relation); relations no matching run holds are left out.

    A run counts for a relation only when it wrote a score for every head of the store's geometry.  Runs
    written before the multi-token policy was recorded used ``"first"``.
    """
    files = store.table_files()
    if not all(files.get(t) for t in ("runs", "maps_scores", "maps_relations")) or not relations:
        return {}
    want_k = {r: k_of(k, r) for r in relations}
    runs = store.table("runs", ["run_id", "kind", "finished", "config"]).to_pylist()
    matching: list[tuple[float, str]] = []
    for r in runs:
        if r["kind"] != "maps":
            continue
        try:
            cfg = json.loads(r["config"] or "{}")
        except json.JSONDecodeError:
            continue
        if (
            bool(cfg.get("final_norm", True)) == final_norm
            and bool(cfg.get("first_mlp", False)) == first_mlp
            and cfg.get("multi_token", "first") == multi_token
        ):
            matching.append((float(r["finished"] or 0.0), str(r["run_id"])))
    if not matching:
        return {}
    g = store.geometry
    params = {"ids": [rid for _, rid in matching], "names": list(relations)}
    sc = store.sql(
        """SELECT run_id, relation, layer, head, score, k FROM maps_scores
                      WHERE list_contains($ids, run_id) AND list_contains($names, relation)""",
        params,
    )
    rel = store.sql(
        """SELECT run_id, relation, n_pairs, n_used, n_multi_token, n_unknown FROM maps_relations
                       WHERE list_contains($ids, run_id) AND list_contains($names, relation)""",
        params,
    ).to_pylist()
    counts = {(r["run_id"], r["relation"]): r for r in rel}
    grids: dict[tuple[str, str], np.ndarray] = {}
    cols = [sc.column(c).to_pylist() for c in ("run_id", "relation", "layer", "head", "score", "k")]
    for rid, name, layer, head, value, row_k in zip(*cols):
        if row_k != want_k[name]:
            continue
        key = (rid, name)
        if key not in grids:
            grids[key] = np.full((g.n_layers, g.n_heads), np.nan)
        if 0 <= layer < g.n_layers and 0 <= head < g.n_heads:
            grids[key][layer, head] = value
    out: dict[str, StoredScores] = {}
    for _, rid in sorted(matching, reverse=True):  # latest run first
        for name in relations:
            key = (rid, name)
            if name in out or key not in grids or key not in counts or np.isnan(grids[key]).any():
                continue
            c = counts[key]
            out[name] = StoredScores(
                name,
                rid,
                grids[key],
                int(c["n_pairs"]),
                int(c["n_used"]),
                int(c["n_multi_token"]),
                int(c["n_unknown"]),
            )
    return out
