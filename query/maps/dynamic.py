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

Which prompts and relations: the command line applies the authors' pair policy through
:func:`usable_prompts` (only prompts whose subject and object are one token each, relations with at
least 30 usable pairs, each relation at its own k); :func:`dynamic_ranks` itself ranks the prompts
it is given.

The static score used for the correlation is computed on exactly the same pairs: the
source is the prompt's token at the subject's first position (``source_token="last"`` for
its last) and the target the first token of " " + object (``targets.object_token_id``).
Per relation, the Pearson correlation is taken over (head, template) points, the static
score repeated for each template, as in the paper's code; the suppression scores (top-k of
the negated rows) are correlated the same way.

Many prompts, on a Dask cluster: ``dynamic_ranks(..., client=client)`` splits the prompts into
tasks of whole projection chunks (``rows_per_chunk`` rows, the unit in which rows are projected
to the vocabulary); each task opens the store by URL, reads its prompts' z and V (whole zarr
chunks) and ranks them for every head, and the driver concatenates the tasks' ranks in prompt
order.  Every row is projected in the same chunk, through the same per-head map, as in one
process, so the ranks are the same; ``client=None`` runs the same tasks here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import MapsError
from actstore.core.store import StoreReader
from actstore.query.analyses.dask_tasks import client_threads, run_tasks, store_of
from actstore.query.analyses.stats import pearson
from actstore.query.maps.defaults import DEFAULT_K, IMPLEMENTS_THRESHOLD, ROW_CHUNK, check_k
from actstore.query.maps.pairs import store_pairs, stored_relations
from actstore.query.maps.projection import VocabProjection, projected_ranks
from actstore.query.maps.static import pair_ranks
from actstore.query.select.rows import Rows
from actstore.query.select.selection import Selection


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
    first_mlp: bool = False  # the static side read its sources through the first MLP
    alt: DynamicRanks | None = None  # the same prompts with the other static variant (``alt_proj``)

    def per_template(self, ranks: np.ndarray, k: int) -> np.ndarray:
        """Share of each template's prompts with rank < k: [n_templates, L, H]."""
        check_k(k, self.k_max)
        return np.stack([(ranks[self.group == t] < k).mean(axis=0) for t in range(len(self.templates))])


def dynamic_ranks(
    store: StoreReader,
    *,
    rows: Rows | None = None,
    relations: Sequence[str] | None = None,
    source_token: Literal["first", "last"] = "first",
    final_norm: bool = True,
    k_max: int = DEFAULT_K,
    proj: VocabProjection | None = None,
    log: Callable[[str], None] | None = None,
    client: Any = None,
    prompts_per_task: int | None = None,
    rows_per_chunk: int = ROW_CHUNK,
    alt_proj: VocabProjection | None = None,
) -> dict[str, DynamicRanks]:
    """Ranks for every relation in the store, over ``rows`` (every prompt when None); see the module
    docstring.

    ``rows``: e.g. the prompts of :func:`usable_prompts` (single-token pairs of the relations not
    excluded).  The functions here apply no pair policy of their own; the command line does.

    ``alt_proj``: a second static variant (the same store's weights, usually with the other
    ``first_mlp`` setting) ranked on the same distinct pairs; each result's ``alt`` then holds
    the same dynamic ranks with these static ranks.  The dynamic side is computed once (it only
    reads W_O and U', so ``alt_proj`` must share ``proj``'s ``final_norm``).

    ``client``: a ``dask.distributed.Client`` to run the tasks on (its workers open the store
    by URL and build their own projection with ``proj``'s ``final_norm``; the source vectors,
    first MLP included, come from ``proj`` here).  ``prompts_per_task``: prompts per task,
    rounded up to whole ``rows_per_chunk`` chunks; by default all prompts in one task without a
    client, and about one task per worker thread with one.
    """
    pairs = store_pairs(store, rows, source_token=source_token)
    if pairs.num_rows == 0:
        raise MapsError(
            f"{store.url}: no prompts with a subject and an object token"
            + (" among the selected ones" if rows is not None else "")
        )
    names = stored_relations(sorted(set(pairs.column("relation_id").to_pylist())), relations, store.url)
    if rows_per_chunk < 1:
        raise MapsError(f"rows_per_chunk must be at least 1, not {rows_per_chunk}")
    if prompts_per_task is not None and prompts_per_task < 1:
        raise MapsError(f"prompts_per_task must be at least 1, not {prompts_per_task}")
    proj = proj or VocabProjection(store, final_norm=final_norm)
    if alt_proj is not None and alt_proj.final_norm != proj.final_norm:
        raise MapsError("alt_proj must have the same final_norm setting as proj")
    rel_col = np.asarray(pairs.column("relation_id").to_pylist())
    keep = np.isin(rel_col, names)
    pairs, rel_col = pairs.filter(pa.array(keep)), rel_col[keep]
    ranks = _ranks(
        store, proj, pairs, k_max, log, client, prompts_per_task, rows_per_chunk
    )  # all relations at once
    if alt_proj is not None:
        # The alternative static side needs only the distinct (source, object) pairs.
        both = np.stack(
            [pairs.column("src_id").to_numpy(), pairs.column("dst_id").to_numpy()], axis=1
        ).astype(np.int64)
        uniq, inverse = np.unique(both, axis=0, return_inverse=True)
        a_up, a_down = pair_ranks(
            alt_proj, uniq[:, 0].copy(), uniq[:, 1].copy(), k_max=k_max, rows_per_chunk=rows_per_chunk
        )
        alt_up, alt_down = a_up[inverse.reshape(-1)], a_down[inverse.reshape(-1)]
    ids = pairs.column("example_id").to_numpy()
    templates_col = np.asarray(pairs.column("template").to_pylist(), dtype=object)
    out: dict[str, DynamicRanks] = {}
    for name in names:
        m = rel_col == name
        templates = sorted(set(templates_col[m].tolist()))
        group = np.asarray([templates.index(t) for t in templates_col[m]])
        r = {key: arr[m] for key, arr in ranks.items()}
        d = DynamicRanks(
            name, templates, group, ids[m], r["su"], r["sd"], r["wu"], r["wd"], r["ou"], r["od"], k_max
        )
        alt = None
        if alt_proj is not None:  # the same prompts, the other static side
            alt = replace(
                d, static_up=alt_up[m], static_down=alt_down[m], first_mlp=alt_proj.first_mlp is not None
            )
        out[name] = replace(d, first_mlp=proj.first_mlp is not None, alt=alt)
    return out


def _ranks(
    store: StoreReader,
    proj: VocabProjection,
    pairs: pa.Table,
    k_max: int,
    log: Callable[[str], None] | None,
    client: Any = None,
    prompts_per_task: int | None = None,
    rows_per_chunk: int = ROW_CHUNK,
) -> dict[str, np.ndarray]:
    """Static (su/sd), with-context (wu/wd) and without-context (ou/od) ranks: [n, L, H] int32 each.

    Task j ranks prompts [j P, (j + 1) P) with and without context, and the distinct (source,
    object) pairs [j P, (j + 1) P) statically (P a whole number of ``rows_per_chunk`` chunks).
    """
    g = store.geometry
    t0 = time.perf_counter()
    ids = pairs.column("example_id").to_numpy()
    src = pairs.column("src_id").to_numpy().astype(np.int64)
    dst = pairs.column("dst_id").to_numpy().astype(np.int64)
    src_pos = pairs.column("src_position").to_numpy().astype(np.int64)
    n = int(ids.size)
    # The static row depends only on the (source, object) pair: rank each distinct pair once.
    uniq, inverse = np.unique(np.stack([src, dst], axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    u_src = torch.from_numpy(uniq[:, 0].copy())
    n_rows = 2 * n + uniq.shape[0]  # decides how each head's map is applied (HeadMap): the same in every task
    with torch.inference_mode():
        # Source vectors here (the first MLP, when given, lives only in this process): layer 0
        # reads the embeddings, layers >= 1 the same or the first MLP's output on them.
        s0 = proj.sources(0, u_src)
        s1 = proj.sources(1, u_src) if proj.first_mlp is not None and g.n_layers > 1 else None
    if prompts_per_task is None:
        prompts_per_task = n if client is None else -(-n // client_threads(client))
    step = max(1, -(-prompts_per_task // rows_per_chunk)) * rows_per_chunk
    tasks = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        ulo, uhi = min(lo, uniq.shape[0]), min(hi, uniq.shape[0])
        tasks.append(
            (
                ids[lo:hi],
                src_pos[lo:hi],
                dst[lo:hi],
                s0[ulo:uhi],
                None if s1 is None else s1[ulo:uhi],
                uniq[ulo:uhi, 1].copy(),
            )
        )
    one_here = client is None and len(tasks) == 1
    on_layer = None
    if log is not None and one_here:

        def on_layer(layer: int) -> None:
            log(
                f"layer {layer + 1}/{g.n_layers}: {n} prompts, {uniq.shape[0]} distinct pairs, "
                f"{time.perf_counter() - t0:.0f}s"
            )

    def on_done(done: int, total: int) -> None:
        if log is not None and not one_here:
            log(
                f"task {done}/{total} done: {n} prompts in tasks of {step}, {uniq.shape[0]} distinct pairs, "
                f"{time.perf_counter() - t0:.0f}s"
            )

    target: Any = (store, proj) if client is None else (store.url, proj.final_norm)
    parts = run_tasks(
        client,
        rank_block,
        [(*target, *t) for t in tasks],
        shared={
            "k_max": k_max,
            "n_rows": n_rows,
            "rows_per_chunk": rows_per_chunk,
            **({"on_layer": on_layer} if on_layer is not None else {}),
        },
        on_done=on_done,
    )
    out = {key: np.concatenate([p[key] for p in parts]) for key in ("wu", "wd", "ou", "od")}
    for key in ("su", "sd"):
        out[key] = np.concatenate([p[key] for p in parts])[inverse]
    assert all(a.shape == (n, g.n_layers, g.n_heads) for a in out.values())
    return out


# Projections built by this process from a store URL (a Dask worker keeps them between tasks).
_PROJ: dict[tuple[str, bool], VocabProjection] = {}


def rank_block(
    store: str | StoreReader,
    proj: VocabProjection | bool,
    ids: np.ndarray,
    src_pos: np.ndarray,
    dst: np.ndarray,
    s0: torch.Tensor,
    s1: torch.Tensor | None,
    u_dst: np.ndarray,
    *,
    k_max: int,
    n_rows: int,
    rows_per_chunk: int = ROW_CHUNK,
    on_layer: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """One task: ranks of the prompts ``ids`` with and without context (``wu/wd/ou/od``
    [n, L, H]) and the static ranks of the distinct pairs whose source vectors are ``s0``
    (layer 0) and ``s1`` (layers >= 1; None: ``s0``) and targets ``u_dst`` (``su/sd``).

    ``proj``: the projection (in this process), or on a worker the ``final_norm`` flag of the
    one to build from the store's weights.  ``n_rows`` fixes how heads' maps are applied.
    """
    st = store_of(store)
    if isinstance(proj, VocabProjection):
        vp = proj
    else:
        key = (st.url, bool(proj))
        if key not in _PROJ:
            _PROJ[key] = VocabProjection(st, final_norm=bool(proj))
        vp = _PROJ[key]
    g = st.geometry
    n, nu = int(ids.size), int(u_dst.size)
    out = {key: np.empty((n, g.n_layers, g.n_heads), np.int32) for key in ("wu", "wd", "ou", "od")}
    out.update({key: np.empty((nu, g.n_layers, g.n_heads), np.int32) for key in ("su", "sd")})
    z, v = _read_factors(st, ids, dict(zip(ids.tolist(), src_pos.tolist()))) if n else (None, None)
    dst_t = torch.from_numpy(dst)
    u_dst_t = torch.from_numpy(u_dst)
    with torch.inference_mode():
        for layer in range(g.n_layers):
            s = s0 if layer == 0 or s1 is None else s1
            xs = {kv: s @ vp.W_V[layer, kv] for kv in range(g.n_kv_heads)} if nu else {}
            zl = z[:, layer].contiguous() if z is not None else None
            vl = v[:, layer].contiguous() if v is not None else None
            for head in range(g.n_heads):
                B = vp.readout(layer, head, n_rows)
                kv = vp.kv(head)
                if nu:
                    out["su"][:, layer, head], out["sd"][:, layer, head] = projected_ranks(
                        xs[kv], B, u_dst_t, k_max, rows_per_chunk
                    )
                if zl is not None and vl is not None:
                    out["wu"][:, layer, head], out["wd"][:, layer, head] = projected_ranks(
                        zl[:, head], B, dst_t, k_max, rows_per_chunk
                    )
                    out["ou"][:, layer, head], out["od"][:, layer, head] = projected_ranks(
                        vl[:, kv], B, dst_t, k_max, rows_per_chunk
                    )
            if on_layer is not None:
                on_layer(layer)
    return out


def _read_factors(
    store: StoreReader, ids: np.ndarray, src_pos: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
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


def correlation_summary(
    d: DynamicRanks, k: int = DEFAULT_K, threshold: float = IMPLEMENTS_THRESHOLD
) -> dict[str, Any]:
    """Static vs dynamic Pearson correlations of one relation, over (head, template) points
    (:func:`actstore.query.analyses.stats.pearson`: NaN for a constant side)."""
    s, sd = d.per_template(d.static_up, k), d.per_template(d.static_down, k)
    w, wd = d.per_template(d.w_up, k), d.per_template(d.w_down, k)
    o, od = d.per_template(d.wo_up, k), d.per_template(d.wo_down, k)
    r_wo, p_wo = pearson(s, o)
    r_w, p_w = pearson(s, w)
    rs_wo, ps_wo = pearson(sd, od)
    rs_w, ps_w = pearson(sd, wd)
    return {
        "relation": d.relation,
        "first_mlp": d.first_mlp,
        "n_prompts": int(d.group.size),
        "n_templates": len(d.templates),
        "k": k,
        "corr_wo_context": r_wo,
        "pval_wo_context": p_wo,
        "corr_w_context": r_w,
        "pval_w_context": p_w,
        "supp_corr_wo_context": rs_wo,
        "supp_pval_wo_context": ps_wo,
        "supp_corr_w_context": rs_w,
        "supp_pval_w_context": ps_w,
        "n_implementing_static": int((s.mean(0) >= threshold).sum()),
        "n_implementing_wo_context": int((o.mean(0) >= threshold).sum()),
        "n_implementing_w_context": int((w.mean(0) >= threshold).sum()),
        "max_static": float(s.max()),
        "max_wo_context": float(o.max()),
        "max_w_context": float(w.max()),
    }


CORRELATION_SCHEMA = pa.schema(
    [
        ("relation", pa.string()),
        ("first_mlp", pa.bool_()),
        ("n_prompts", pa.int32()),
        ("n_templates", pa.int32()),
        ("k", pa.int32()),
        ("corr_wo_context", pa.float64()),
        ("pval_wo_context", pa.float64()),
        ("corr_w_context", pa.float64()),
        ("pval_w_context", pa.float64()),
        ("supp_corr_wo_context", pa.float64()),
        ("supp_pval_wo_context", pa.float64()),
        ("supp_corr_w_context", pa.float64()),
        ("supp_pval_w_context", pa.float64()),
        ("n_implementing_static", pa.int32()),
        ("n_implementing_wo_context", pa.int32()),
        ("n_implementing_w_context", pa.int32()),
        ("max_static", pa.float64()),
        ("max_wo_context", pa.float64()),
        ("max_w_context", pa.float64()),
    ]
)


def correlation_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=CORRELATION_SCHEMA)


def head_table(d: DynamicRanks, k: int = DEFAULT_K) -> pa.Table:
    """One row per (template, layer, head): static and dynamic scores and suppression scores."""
    parts = {
        "static_score": d.per_template(d.static_up, k),
        "static_suppression": d.per_template(d.static_down, k),
        "dyn_w_context": d.per_template(d.w_up, k),
        "dyn_wo_context": d.per_template(d.wo_up, k),
        "supp_w_context": d.per_template(d.w_down, k),
        "supp_wo_context": d.per_template(d.wo_down, k),
    }
    T, L, H = parts["static_score"].shape
    counts = np.bincount(d.group, minlength=T)
    t_idx, l_idx, h_idx = np.meshgrid(np.arange(T), np.arange(L), np.arange(H), indexing="ij")
    cols: dict[str, Any] = {
        "relation": [d.relation] * (T * L * H),
        "first_mlp": [d.first_mlp] * (T * L * H),
        "template": [d.templates[t] for t in t_idx.ravel()],
        "layer": l_idx.ravel().astype(np.int32),
        "head": h_idx.ravel().astype(np.int32),
        "n_prompts": counts[t_idx.ravel()].astype(np.int32),
        "k": np.full(T * L * H, k, np.int32),
    }
    for key, arr in parts.items():
        cols[key] = arr.ravel().astype(np.float64)
    return pa.table(cols)
