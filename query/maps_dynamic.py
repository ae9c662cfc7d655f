"""MAPS, dynamic part: what each head actually wrote on the stored prompts, and how well the
static (weight-only) scores predict it.  Everything comes from the store; no model runs.

For a relation's prompts (a template per MAPS relation, or several: the paper used four
neutral contexts such as "This is a document about {}") and each head (l, h):

* **with context**: the head's output at the target (the last prompt token),
  Delta_att,h = z_h W_O[l, h], read through the unembedding U' (the same U' as the static
  scores: final norm weight folded in unless ``final_norm=False``), and
  phi*_R(h) = share of prompts whose object token is in its top-k.
* **without context**: the same, but with the head's attention at the last position put
  entirely on the source (subject) token, i.e. z_h = V_kv(h)(source position) taken from the
  same forward pass; that is what the paper's code does (a one-hot attention pattern at the
  last position, downstream activations left clean), and the store holds V of every token,
  so it needs no new run.

The static score used for the correlation is computed on exactly the same pairs: the
source is the prompt's token at the subject's first position (``source_token="last"`` for
its last) and the target the first token of " " + object (``targets.object_token_id``).
Per relation, the Pearson correlation is taken over (head, template) points, the static
score repeated for each template, as in the paper's code; the suppression scores (top-k of
the negated rows) are correlated the same way.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from actstore.store import Store
from query.maps import (
    DEFAULT_K,
    IMPLEMENTS_THRESHOLD,
    MapsError,
    VocabProjection,
    check_k,
    projected_ranks,
    store_pairs,
)
from query.selection import Selection


@dataclass(frozen=True)
class DynamicRanks:
    """Per prompt and head, the object token's rank (entries strictly above; and below) in
    the static row, and in the head's output with and without context, censored at k_max."""

    relation: str
    templates: list[str]
    group: np.ndarray  # [n] index into templates
    example_ids: np.ndarray  # [n]
    static_up: np.ndarray  # [n, L, H] int32
    static_down: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    wo_up: np.ndarray
    wo_down: np.ndarray
    k_max: int = DEFAULT_K  # ranks are censored there

    def per_template(self, ranks: np.ndarray, k: int) -> np.ndarray:
        """Share of each template's prompts with rank < k: [n_templates, L, H]."""
        check_k(k, self.k_max)
        return np.stack([(ranks[self.group == t] < k).mean(axis=0) for t in range(len(self.templates))])


def dynamic_ranks(store: Store, *, where: str | None = None, relations: Sequence[str] | None = None,
                  source_token: Literal["first", "last"] = "first", final_norm: bool = True,
                  k_max: int = DEFAULT_K, proj: VocabProjection | None = None,
                  log: Callable[[str], None] | None = None) -> dict[str, DynamicRanks]:
    """Ranks for every relation in the (filtered) store; see the module docstring."""
    pairs = store_pairs(store, where, source_token=source_token)
    if pairs.num_rows == 0:
        raise MapsError(f"{store.url}: no prompts with a subject and an object token"
                        + (f" match {where!r}" if where else ""))
    names = sorted(set(pairs.column("relation_id").to_pylist()))
    if relations is not None:
        missing = sorted(set(relations) - set(names))
        if missing:
            raise MapsError(f"relation(s) {', '.join(missing)} have no prompts in {store.url}; it holds {', '.join(names)}")
        names = [n for n in names if n in set(relations)]
    proj = proj or VocabProjection(store, final_norm=final_norm)
    rel_col = np.asarray(pairs.column("relation_id").to_pylist())
    keep = np.isin(rel_col, names)
    pairs, rel_col = pairs.filter(pa.array(keep)), rel_col[keep]
    ranks = _ranks(store, proj, pairs, k_max, log)  # every relation in one pass over the heads
    ids = pairs.column("example_id").to_numpy()
    templates_col = np.asarray(pairs.column("template").to_pylist(), dtype=object)
    out: dict[str, DynamicRanks] = {}
    for name in names:
        m = rel_col == name
        templates = sorted(set(templates_col[m].tolist()))
        group = np.asarray([templates.index(t) for t in templates_col[m]])
        r = {key: arr[m] for key, arr in ranks.items()}
        out[name] = DynamicRanks(name, templates, group, ids[m], r["su"], r["sd"], r["wu"], r["wd"], r["ou"], r["od"],
                                 k_max)
    return out


def _ranks(store: Store, proj: VocabProjection, pairs: pa.Table, k_max: int,
           log: Callable[[str], None] | None) -> dict[str, np.ndarray]:
    """Static (su/sd), with-context (wu/wd) and without-context (ou/od) ranks: [n, L, H] int32 each."""
    g = store.geometry
    t0 = time.perf_counter()
    ids = pairs.column("example_id").to_numpy()
    src = torch.from_numpy(pairs.column("src_id").to_numpy().astype(np.int64))
    dst = torch.from_numpy(pairs.column("dst_id").to_numpy().astype(np.int64))
    src_pos = dict(zip(ids.tolist(), pairs.column("src_position").to_pylist()))
    z, v = _read_factors(store, ids, src_pos)  # [n, L, H, dh], [n, L, Hkv, dh] in example order
    shape = (ids.size, g.n_layers, g.n_heads)
    out = {key: np.empty(shape, np.int32) for key in ("su", "sd", "wu", "wd", "ou", "od")}
    # The static row depends only on the (source, object) pair: rank each distinct pair once.
    uniq, inverse = np.unique(np.stack([src.numpy(), dst.numpy()], axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    u_src, u_dst = torch.from_numpy(uniq[:, 0].copy()), torch.from_numpy(uniq[:, 1].copy())
    with torch.inference_mode():
        for layer in range(g.n_layers):
            xs = {kv: proj.values(layer, kv, u_src) for kv in range(g.n_kv_heads)}
            zl = z[:, layer].contiguous()
            vl = v[:, layer].contiguous()
            for head in range(g.n_heads):
                B = proj.readout(layer, head, 2 * ids.size + uniq.shape[0])  # once per head for all prompts
                kv = proj.kv(head)
                su, sd = projected_ranks(xs[kv], B, u_dst, k_max)
                out["su"][:, layer, head], out["sd"][:, layer, head] = su[inverse], sd[inverse]
                out["wu"][:, layer, head], out["wd"][:, layer, head] = projected_ranks(zl[:, head], B, dst, k_max)
                out["ou"][:, layer, head], out["od"][:, layer, head] = projected_ranks(vl[:, kv], B, dst, k_max)
            if log is not None:
                log(f"layer {layer + 1}/{g.n_layers}: {ids.size} prompts, {uniq.shape[0]} distinct pairs, "
                    f"{time.perf_counter() - t0:.0f}s")
    return out


def _read_factors(store: Store, ids: np.ndarray, src_pos: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """z at the target and V at the source token, for ``ids`` (in that order)."""
    sel = Selection.from_ids(store, ids.tolist())
    got_ids: list[np.ndarray] = []
    zs: list[np.ndarray] = []
    vs: list[np.ndarray] = []
    for block_ids, block in sel.blocks(batch_rows=256):
        zs.append(store.read_segment_rows(block.segment, "z", block.seg_rows))
        starts = block.src_start + np.asarray([src_pos[int(i)] for i in block_ids], np.int64)
        vs.append(store.read_segment_ranges(block.segment, "v", starts, np.ones_like(starts)))
        got_ids.append(block_ids)
    order = np.argsort(np.concatenate(got_ids))  # selection is in row order; ids are sorted too
    pos = np.searchsorted(np.concatenate(got_ids)[order], ids)
    take = order[pos]
    return torch.from_numpy(np.concatenate(zs)[take]), torch.from_numpy(np.concatenate(vs)[take])


# ----------------------------------------------------------------------------------- correlations


def _pearson(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    from scipy.stats import pearsonr

    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    if a.size < 3 or a.std() == 0 or b.std() == 0:
        return float("nan"), float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r, p = pearsonr(a, b)
    return float(r), float(p)


def correlation_summary(d: DynamicRanks, k: int = DEFAULT_K, threshold: float = IMPLEMENTS_THRESHOLD) -> dict[str, Any]:
    """Static vs dynamic Pearson correlations of one relation, over (head, template) points."""
    s, sd = d.per_template(d.static_up, k), d.per_template(d.static_down, k)
    w, wd = d.per_template(d.w_up, k), d.per_template(d.w_down, k)
    o, od = d.per_template(d.wo_up, k), d.per_template(d.wo_down, k)
    r_wo, p_wo = _pearson(s, o)
    r_w, p_w = _pearson(s, w)
    rs_wo, ps_wo = _pearson(sd, od)
    rs_w, ps_w = _pearson(sd, wd)
    return {
        "relation": d.relation, "n_prompts": int(d.group.size), "n_templates": len(d.templates), "k": k,
        "corr_wo_context": r_wo, "pval_wo_context": p_wo, "corr_w_context": r_w, "pval_w_context": p_w,
        "supp_corr_wo_context": rs_wo, "supp_pval_wo_context": ps_wo,
        "supp_corr_w_context": rs_w, "supp_pval_w_context": ps_w,
        "n_implementing_static": int((s.mean(0) >= threshold).sum()),
        "n_implementing_wo_context": int((o.mean(0) >= threshold).sum()),
        "n_implementing_w_context": int((w.mean(0) >= threshold).sum()),
        "max_static": float(s.max()), "max_wo_context": float(o.max()), "max_w_context": float(w.max()),
    }


CORRELATION_SCHEMA = pa.schema([
    ("relation", pa.string()), ("n_prompts", pa.int32()), ("n_templates", pa.int32()), ("k", pa.int32()),
    ("corr_wo_context", pa.float64()), ("pval_wo_context", pa.float64()),
    ("corr_w_context", pa.float64()), ("pval_w_context", pa.float64()),
    ("supp_corr_wo_context", pa.float64()), ("supp_pval_wo_context", pa.float64()),
    ("supp_corr_w_context", pa.float64()), ("supp_pval_w_context", pa.float64()),
    ("n_implementing_static", pa.int32()), ("n_implementing_wo_context", pa.int32()),
    ("n_implementing_w_context", pa.int32()), ("max_static", pa.float64()), ("max_wo_context", pa.float64()),
    ("max_w_context", pa.float64()),
])


def correlation_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=CORRELATION_SCHEMA)


def head_table(d: DynamicRanks, k: int = DEFAULT_K) -> pa.Table:
    """One row per (template, layer, head): static and dynamic scores and suppression scores."""
    parts = {
        "static_score": d.per_template(d.static_up, k), "static_suppression": d.per_template(d.static_down, k),
        "dyn_w_context": d.per_template(d.w_up, k), "dyn_wo_context": d.per_template(d.wo_up, k),
        "supp_w_context": d.per_template(d.w_down, k), "supp_wo_context": d.per_template(d.wo_down, k),
    }
    T, L, H = parts["static_score"].shape
    counts = np.bincount(d.group, minlength=T)
    t_idx, l_idx, h_idx = np.meshgrid(np.arange(T), np.arange(L), np.arange(H), indexing="ij")
    cols: dict[str, Any] = {
        "relation": [d.relation] * (T * L * H),
        "template": [d.templates[t] for t in t_idx.ravel()],
        "layer": l_idx.ravel().astype(np.int32), "head": h_idx.ravel().astype(np.int32),
        "n_prompts": counts[t_idx.ravel()].astype(np.int32), "k": np.full(T * L * H, k, np.int32),
    }
    for key, arr in parts.items():
        cols[key] = arr.ravel().astype(np.float64)
    return pa.table(cols)
