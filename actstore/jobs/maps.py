"""Run MAPS static scores over a store (``actstore maps``; ``maps-dynamic`` is :mod:`actstore.jobs.maps_dynamic`): scores, result tables,
the ``runs`` row, heatmaps, and a JSON-ready summary.

    out = run_maps(store, MapsRunConfig(pairs=("maps/",), first_mlp=False), tokenizer=load_tokenizer)
    out.summaries                             # per relation: k, pairs used, heads implementing it

The first-MLP source transform loads the model, which the query layer does not do: the caller
passes a loader of it (e.g. ``lambda: actstore.jobs.model.first_mlp_for_store(store, None)``),
called only when the run reads through the first MLP (:func:`first_mlp_wanted`).  The tokenizer
comes the same way (``tokenizer``: a loader, e.g. ``lambda: actstore.api.tokenizer_for_store(store)``).

Tables (one file per run, unless ``save`` is False):

    maps_scores       relation, layer, head, kv_head, score, suppression, implements, suppresses, k, ...
    maps_relations    per relation: k, pairs used, multi-token and unknown counts, heads implementing R
    maps_excluded     relations left out for having fewer usable pairs than min_pairs, with their counts
    maps_salient      layer, head, rank, token, sigma, mapped_tokens
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import InvalidSetting, MapsError
from actstore.core.progress import progress_bar, progress_callback
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.jobs.settings import MapsRunConfig
from actstore.query.maps.defaults import paper_first_mlp, relation_ks
from actstore.query.maps.pairs import excluded_line, load_pair_files, split_by_min_pairs, tokenize_pairs
from actstore.query.maps.projection import VocabProjection, parse_heads
from actstore.query.maps.static import (
    relation_summary,
    salient_operations,
    salient_table,
    scores_table,
    static_scores,
    token_decoder,
)

Log = Callable[[str], None]


FirstMlp = Callable[[], Any]


def load_first_mlp(loader: FirstMlp | None) -> Any:
    if loader is None:
        raise InvalidSetting(
            "first_mlp",
            "scores through the first MLP need the model: pass a loader of its "
            "transform, or score from the embeddings",
        )
    return loader()


def first_mlp_wanted(store: StoreReader, first_mlp: bool | None, compare: bool = False) -> bool:
    """Whether a run needs the first-MLP transform: as asked, else the authors' default for the
    store's model (on, except for Llama-3.1-70B)."""

    if compare:
        return True
    return paper_first_mlp(str(store.manifest.model.get("name") or "")) if first_mlp is None else first_mlp


# ----------------------------------------------------------------------------------- static


@dataclass
class MapsOutcome:
    run_id: str
    scores: dict[str, Any]  # relation -> StaticScores
    summaries: list[dict[str, Any]]
    excluded: list[dict[str, Any]]
    ks: dict[str, int]
    first_mlp: bool
    result: dict[str, Any]  # JSON-ready
    salient: list[Any] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def run_maps(
    store: StoreReader,
    cfg: MapsRunConfig,
    tokenizer: Callable[[], Any],
    first_mlp: FirstMlp | None = None,
    progress: bool = False,
) -> MapsOutcome:
    """Static MAPS scores of every head for each relation in the pair files, from the store's
    weights (``first_mlp``: loads the first-MLP transform when the run needs it; ``progress``: a bar
    of heads on stderr)."""

    started = time.time()
    g = store.geometry
    wanted = list(cfg.relations) if cfg.relations else None
    rels = load_pair_files(list(cfg.pairs), wanted)
    want_salient = cfg.salient_heads.strip().lower() != "none"
    sal_heads = parse_heads(cfg.salient_heads, g.n_layers, g.n_heads) if want_salient else None
    tok = tokenizer()
    tokenized = [
        tokenize_pairs(
            r,
            tok,
            vocab_size=g.vocab_size,
            multi_token=cfg.multi_token,  # type: ignore[arg-type]
            allow_empty=True,
        )
        for r in rels
    ]
    stored_name = str(store.manifest.model.get("name") or "")
    use_mlp = first_mlp_wanted(store, cfg.first_mlp)
    mlp = load_first_mlp(first_mlp) if use_mlp else None
    kept, excluded = split_by_min_pairs(tokenized, cfg.min_pairs)
    if not kept:
        raise MapsError(
            f"no relation has the {cfg.min_pairs} usable pairs needed (usable/pairs: "
            f"{excluded_line(excluded)}); lower the minimum, or score multi-token words by their first token"
        )
    ks = relation_ks([p.relation for p in kept], cfg.k, stored_name)
    proj = VocabProjection(store, final_norm=cfg.final_norm, first_mlp=mlp)
    with progress_bar(
        total=g.n_layers * g.n_heads, desc="maps: scores", unit="head", enabled=progress
    ) as bar:
        scores = static_scores(proj, kept, k_max=max(ks.values()), progress=progress_callback(bar))
    summaries = [relation_summary(name, sc, ks[name], cfg.threshold) for name, sc in scores.items()]
    run_id = new_run_id("maps")
    ops: list[Any] = []
    if want_salient:
        n_sal = g.n_layers * g.n_heads if sal_heads is None else len(sal_heads)
        with progress_bar(total=n_sal, desc="maps: salient operations", unit="head", enabled=progress) as bar:
            ops = salient_operations(
                proj,
                sal_heads,
                n_tokens=cfg.salient_tokens,
                n_mappings=cfg.mappings,
                vocab_limit=len(tok),
                progress=progress_callback(bar),
            )
    decode = token_decoder(tok)
    k_policy = "given" if cfg.k is not None else "paper"
    out = MapsOutcome(run_id, scores, summaries, excluded, ks, use_mlp, {}, ops)
    if cfg.save:
        tables = {
            "maps_scores": scores_table(scores, ks, cfg.threshold, g.kv_group),
            "maps_relations": pa.Table.from_pylist(summaries),
        }
        if excluded:
            tables["maps_excluded"] = pa.Table.from_pylist(excluded)
        if ops:
            tables["maps_salient"] = salient_table(ops, decode)
        settings = ("pairs", "k", "threshold", "multi_token", "min_pairs", "final_norm", "tokenizer")
        config = {k: getattr(cfg, k) for k in settings} | {
            "relations": wanted,
            "k_policy": k_policy,
            "k_per_relation": ks,
            "excluded": [e["relation"] for e in excluded],
            "first_mlp": use_mlp,
        }
        out.tables += record_run(store, "maps", config, tables, started=started, run_id=run_id).tables
    if cfg.figures:
        from actstore.query.maps.figures import head_heatmap, safe_name

        for name, sc in scores.items():
            kr = ks[name]
            for what, grid, suffix in (
                ("static score", sc.score, ""),
                ("suppression score", sc.suppression, "_suppression"),
            ):
                path = f"{cfg.figures}/maps_{safe_name(name)}{suffix}.png"
                title = f"MAPS {what}, {name} (k={kr})"
                out.figures.append(
                    str(head_heatmap(grid(kr), path, title, vmax=1.0, threshold=cfg.threshold))
                )
    out_rel = []
    for summ in summaries:
        sc = scores[summ["relation"]]
        phi, sup = sc.score(summ["k"]), sc.suppression(summ["k"])
        heads = [
            {
                "relation": summ["relation"],
                "layer": layer,
                "head": h,
                "score": float(phi[layer, h]),
                "suppression": float(sup[layer, h]),
            }
            for layer in range(g.n_layers)
            for h in range(g.n_heads)
        ]
        out_rel.append({**summ, "heads": heads})
    salient = [
        {
            "layer": op.layer,
            "head": op.head,
            "tokens": [
                {"token": t, "token_id": int(i), "sigma": float(sg), "mapped": decode([int(x) for x in m])}
                for i, t, sg, m in zip(
                    op.token_ids.tolist(), decode(op.token_ids.tolist()), op.sigma.tolist(), op.mapped_ids
                )
            ],
        }
        for op in ops
    ]
    out.result = {
        "store": store.url,
        "run_id": run_id,
        "k": cfg.k,
        "k_policy": k_policy,
        "threshold": cfg.threshold,
        "final_norm": cfg.final_norm,
        "first_mlp": use_mlp,
        "multi_token": cfg.multi_token,
        "min_pairs": cfg.min_pairs,
        "relations": out_rel,
        "excluded": excluded,
        "salient": salient,
        "tables": out.tables,
        "heatmaps": out.figures,
    }
    return out


def top_heads_text(scores: np.ndarray, n: int = 3) -> str:
    """The ``n`` best heads of a [L, H] score grid as ``"layer.head=score"`` words."""
    H = scores.shape[1]
    flat = np.argsort(-scores.ravel(), kind="stable")[:n]
    return " ".join(f"{i // H}.{i % H}={scores.ravel()[i]:.2f}" for i in flat)


def k_groups(ks: dict[str, int]) -> list[tuple[int, str]]:
    """[(1, "name_copying, general_copying_english_500"), (10, "the other 14")] for the text output."""
    by: dict[int, list[str]] = {}
    for name, v in ks.items():
        by.setdefault(v, []).append(name)
    if len(by) == 1:
        return [(next(iter(by)), "all")]
    big = max(by, key=lambda v: len(by[v]))
    return [(v, ", ".join(names)) for v, names in sorted(by.items()) if v != big] + [
        (big, f"the other {len(by[big])}")
    ]
