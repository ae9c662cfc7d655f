"""Run MAPS over a store (``actstore maps`` and ``actstore maps-dynamic``): scores, result tables,
the ``runs`` row, heatmaps, and a JSON-ready summary.

    out = run_maps(store, MapsRunConfig(pairs=("maps/",), first_mlp=False), tokenizer=load_tokenizer)
    out.summaries                             # per relation: k, pairs used, heads implementing it

The first-MLP source transform loads the model, which the query layer does not do: the caller
passes a loader of it (e.g. ``lambda: actstore.jobs.interventions.first_mlp_for_store(store, None)``),
called only when the run reads through the first MLP (:func:`first_mlp_wanted`).  The tokenizer
comes the same way (``tokenizer``: a loader, e.g. ``lambda: actstore.api.tokenizer_for_store(store)``).

Tables (one file per run, unless ``save`` is False):

    maps_scores       relation, layer, head, kv_head, score, suppression, implements, suppresses, k, ...
    maps_relations    per relation: k, pairs used, multi-token and unknown counts, heads implementing R
    maps_excluded     relations left out for having fewer usable pairs than min_pairs, with their counts
    maps_salient      layer, head, rank, token, sigma, mapped_tokens
    maps_dynamic      relation, template, layer, head, static_score, dyn_w_context, dyn_wo_context, ...
    maps_correlation  per relation: Pearson r (and p) static vs dynamic, with and without context
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.invalid import InvalidSetting
from actstore.core.runs import new_run_id, with_run_id, write_run
from actstore.core.store import Store

Log = Callable[[str], None]


def _check(k: int | None, threshold: float, min_pairs: int, multi_token: str) -> None:
    if k is not None and k < 1:
        raise InvalidSetting("k", f"must be at least 1, not {k}")
    if not 0.0 <= threshold <= 1.0:
        raise InvalidSetting("threshold", f"must be between 0 and 1, not {threshold}")
    if min_pairs < 0:
        raise InvalidSetting("min_pairs", f"must not be negative, not {min_pairs}")
    if multi_token not in ("skip", "first"):
        raise InvalidSetting("multi_token", f"must be 'skip' or 'first', not {multi_token!r}")


FirstMlp = Callable[[], Any]


def _load_first_mlp(loader: FirstMlp | None) -> Any:
    if loader is None:
        raise InvalidSetting(
            "first_mlp",
            "scores through the first MLP need the model: pass a loader of its "
            "transform, or score from the embeddings",
        )
    return loader()


def first_mlp_wanted(store: Store, first_mlp: bool | None, compare: bool = False) -> bool:
    """Whether a run needs the first-MLP transform: as asked, else the authors' default for the
    store's model (on, except for Llama-3.1-70B)."""
    from actstore.query.maps.defaults import paper_first_mlp

    if compare:
        return True
    return paper_first_mlp(str(store.manifest.model.get("name") or "")) if first_mlp is None else first_mlp


# ----------------------------------------------------------------------------------- static


@dataclass(frozen=True)
class MapsRunConfig:
    pairs: tuple[str, ...]  # MAPS pair files ([[source, target], ...]) or folders of them
    relations: tuple[str, ...] | None = None  # relation names (file stems) to keep
    k: int | None = None  # None: the authors' k per relation
    threshold: float = 0.15
    multi_token: str = "skip"
    min_pairs: int = 30
    final_norm: bool = True
    tokenizer: str | None = None  # the tokenizer's folder or name as given (recorded in the run)
    first_mlp: bool | None = None  # None: the authors' default
    salient_heads: str = "all"  # all, none, or LAYER.HEAD list
    salient_tokens: int = 10
    mappings: int = 5
    save: bool = True
    figures: str | None = None  # folder for one layer x head heatmap per relation


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
    store: Store, cfg: MapsRunConfig, tokenizer: Callable[[], Any], first_mlp: FirstMlp | None = None
) -> MapsOutcome:
    """Static MAPS scores of every head for each relation in the pair files, from the store's
    weights (``first_mlp``: loads the first-MLP transform when the run needs it)."""
    from actstore.core.writer import write_result_table
    from actstore.query.maps.defaults import MapsError, relation_ks
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

    _check(cfg.k, cfg.threshold, cfg.min_pairs, cfg.multi_token)
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
    mlp = _load_first_mlp(first_mlp) if use_mlp else None
    kept, excluded = split_by_min_pairs(tokenized, cfg.min_pairs)
    if not kept:
        raise MapsError(
            f"no relation has the {cfg.min_pairs} usable pairs needed (usable/pairs: "
            f"{excluded_line(excluded)}); lower the minimum, or score multi-token words by their first token"
        )
    ks = relation_ks([p.relation for p in kept], cfg.k, stored_name)
    proj = VocabProjection(store, final_norm=cfg.final_norm, first_mlp=mlp)
    scores = static_scores(proj, kept, k_max=max(ks.values()))
    summaries = [relation_summary(name, sc, ks[name], cfg.threshold) for name, sc in scores.items()]
    run_id = new_run_id("maps")
    ops = (
        salient_operations(
            proj, sal_heads, n_tokens=cfg.salient_tokens, n_mappings=cfg.mappings, vocab_limit=len(tok)
        )
        if want_salient
        else []
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
        for name, table in tables.items():
            out.tables.append(write_result_table(store, name, run_id, with_run_id(table, run_id)))
        write_run(
            store,
            run_id,
            "maps",
            started,
            {
                "pairs": list(cfg.pairs),
                "relations": wanted,
                "k": cfg.k,
                "k_policy": k_policy,
                "k_per_relation": ks,
                "threshold": cfg.threshold,
                "multi_token": cfg.multi_token,
                "min_pairs": cfg.min_pairs,
                "excluded": [e["relation"] for e in excluded],
                "final_norm": cfg.final_norm,
                "tokenizer": cfg.tokenizer,
                "first_mlp": use_mlp,
            },
        )
    if cfg.figures:
        from actstore.query.maps_figures import head_heatmap, safe_name

        for name, sc in scores.items():
            kr = ks[name]
            out.figures.append(
                str(
                    head_heatmap(
                        sc.score(kr),
                        f"{cfg.figures}/maps_{safe_name(name)}.png",
                        f"MAPS static score, {name} (k={kr})",
                        vmax=1.0,
                        threshold=cfg.threshold,
                    )
                )
            )
            out.figures.append(
                str(
                    head_heatmap(
                        sc.suppression(kr),
                        f"{cfg.figures}/maps_{safe_name(name)}_suppression.png",
                        f"MAPS suppression score, {name} (k={kr})",
                        vmax=1.0,
                        threshold=cfg.threshold,
                    )
                )
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


# ----------------------------------------------------------------------------------- dynamic


@dataclass(frozen=True)
class MapsDynamicConfig:
    where: str | None = None  # SQL predicate over the examples table
    relations: tuple[str, ...] | None = None
    k: int | None = None
    threshold: float = 0.15
    multi_token: str = "skip"
    min_pairs: int = 30
    pairs: tuple[str, ...] = ()  # pair files: count usable pairs in them rather than among the prompts
    tokenizer: str | None = None
    source_token: str = "first"
    final_norm: bool = True
    first_mlp: bool | None = None
    compare_first_mlp: bool = False
    save: bool = True
    figures: str | None = None
    prompts_per_task: int | None = None


@dataclass
class MapsDynamicOutcome:
    run_id: str
    summaries: list[dict[str, Any]]
    excluded: list[dict[str, Any]]
    first_mlp: bool
    result: dict[str, Any]
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def _nan_to_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}


def run_maps_dynamic(
    store: Store,
    cfg: MapsDynamicConfig,
    tokenizer: Callable[[], Any] | None = None,
    first_mlp: FirstMlp | None = None,
    *,
    client: Any = None,
    log: Log | None = None,
) -> MapsDynamicOutcome:
    """Dynamic MAPS scores from the store's head outputs and their correlation with the static
    scores; ``tokenizer`` is loaded for single-token prompts and pair files; ``client``: a Dask
    client for the projections (None: in this process)."""
    from actstore.core.writer import write_result_table
    from actstore.query.maps.defaults import MapsError, relation_ks
    from actstore.query.maps.dynamic import (
        correlation_summary,
        correlation_table,
        dynamic_ranks,
        head_table,
        usable_prompts,
    )
    from actstore.query.maps.pairs import load_pair_files, tokenize_pairs
    from actstore.query.maps.projection import VocabProjection

    _check(cfg.k, cfg.threshold, cfg.min_pairs, cfg.multi_token)
    started = time.time()
    wanted = list(cfg.relations) if cfg.relations else None
    stored_name = str(store.manifest.model.get("name") or "")
    tok = None
    if cfg.multi_token == "skip" or cfg.pairs:
        if tokenizer is None:
            raise InvalidSetting("tokenizer", "single-token prompts and pair files need the tokenizer")
        tok = tokenizer()
    pair_counts = None
    if cfg.pairs:
        pair_counts = {}
        for rp in load_pair_files(list(cfg.pairs)):
            mode: Any = cfg.multi_token  # checked by _check above
            tp = tokenize_pairs(
                rp, tok, vocab_size=store.geometry.vocab_size, multi_token=mode, allow_empty=True
            )
            pair_counts[rp.relation] = (tp.n_used, tp.n_pairs)
    use_mlp = first_mlp_wanted(store, cfg.first_mlp)
    mlp = _load_first_mlp(first_mlp) if use_mlp or cfg.compare_first_mlp else None
    chosen = usable_prompts(
        store,
        tokenizer=tok,
        where=cfg.where,
        relations=wanted,
        multi_token=cfg.multi_token,
        min_pairs=cfg.min_pairs,
        pair_counts=pair_counts,
    )
    if not chosen.relations:
        raise MapsError(
            "no relation has the usable prompts and pairs needed (usable pairs/pairs: "
            + ", ".join(
                f"{e['relation']} {e['n_used']}/{e['n_pairs']} ({e['counted_from']})" for e in chosen.excluded
            )
            + f"; minimum {cfg.min_pairs}); lower the minimum, or score multi-token words by their "
            "first token"
        )
    ks = relation_ks(chosen.relations, cfg.k, stored_name)
    proj = VocabProjection(store, final_norm=cfg.final_norm, first_mlp=None if cfg.compare_first_mlp else mlp)
    alt = VocabProjection(store, final_norm=cfg.final_norm, first_mlp=mlp) if cfg.compare_first_mlp else None
    ranks = dynamic_ranks(
        store,
        where=cfg.where,
        relations=chosen.relations,
        source_token=cfg.source_token,  # type: ignore[arg-type]
        final_norm=cfg.final_norm,
        k_max=max(ks.values()),
        proj=proj,
        log=log,
        client=client,
        prompts_per_task=cfg.prompts_per_task,
        alt_proj=alt,
        example_ids=chosen.example_ids.tolist(),
    )
    variants = [
        v for d in ranks.values() for v in (d, d.alt) if v is not None
    ]  # per relation: plain, first MLP
    summaries = [correlation_summary(d, ks[d.relation], cfg.threshold) for d in variants]
    run_id = new_run_id("maps-dynamic")
    k_policy = "given" if cfg.k is not None else "paper"
    out = MapsDynamicOutcome(run_id, summaries, chosen.excluded, use_mlp, {})
    if cfg.save:
        heads_t = pa.concat_tables([head_table(d, ks[d.relation]) for d in variants])
        out.tables.append(write_result_table(store, "maps_dynamic", run_id, with_run_id(heads_t, run_id)))
        out.tables.append(
            write_result_table(
                store, "maps_correlation", run_id, with_run_id(correlation_table(summaries), run_id)
            )
        )
        if chosen.excluded:
            out.tables.append(
                write_result_table(
                    store, "maps_excluded", run_id, with_run_id(pa.Table.from_pylist(chosen.excluded), run_id)
                )
            )
        write_run(
            store,
            run_id,
            "maps-dynamic",
            started,
            {
                "where": cfg.where,
                "relations": wanted,
                "k": cfg.k,
                "k_policy": k_policy,
                "k_per_relation": ks,
                "multi_token": cfg.multi_token,
                "min_pairs": cfg.min_pairs,
                "pairs": list(cfg.pairs),
                "excluded": [e["relation"] for e in chosen.excluded],
                "source_token": cfg.source_token,
                "final_norm": cfg.final_norm,
                "first_mlp": use_mlp,
                "compare_first_mlp": cfg.compare_first_mlp,
            },
        )
    if cfg.figures:
        from actstore.query.maps_figures import head_heatmap, safe_name

        for name, d in ranks.items():
            kr = ks[name]
            maps_: list[tuple[str, Any]] = [("static_first_mlp" if d.first_mlp else "static", d.static_up)]
            if d.alt is not None:
                maps_.append(("static_first_mlp", d.alt.static_up))
            for key, arr in (*maps_, ("dynamic_w_context", d.w_up), ("dynamic_wo_context", d.wo_up)):
                out.figures.append(
                    str(
                        head_heatmap(
                            d.per_template(arr, kr).mean(0),
                            f"{cfg.figures}/maps_{key}_{safe_name(name)}.png",
                            f"{key.replace('_', ' ')}, {name} (k={kr})",
                            vmax=1.0,
                            threshold=cfg.threshold,
                        )
                    )
                )
    rel_out = []
    for summ, d in zip(summaries, variants):
        kr = ks[d.relation]
        st, w, o = (d.per_template(a, kr).mean(0) for a in (d.static_up, d.w_up, d.wo_up))
        L, H = st.shape
        heads = [
            {
                "relation": d.relation,
                "layer": layer,
                "head": h,
                "static": float(st[layer, h]),
                "dyn_w_context": float(w[layer, h]),
                "dyn_wo_context": float(o[layer, h]),
            }
            for layer in range(L)
            for h in range(H)
        ]
        rel_out.append(
            {
                **_nan_to_none(summ),
                "templates": d.templates,
                "heads": heads,
                "n_prompts_store": chosen.counts[d.relation]["n_prompts"],
            }
        )
    out.result = {
        "store": store.url,
        "run_id": run_id,
        "k": cfg.k,
        "k_policy": k_policy,
        "final_norm": cfg.final_norm,
        "first_mlp": use_mlp,
        "compare_first_mlp": cfg.compare_first_mlp,
        "multi_token": cfg.multi_token,
        "min_pairs": cfg.min_pairs,
        "source_token": cfg.source_token,
        "relations": rel_out,
        "excluded": chosen.excluded,
        "tables": out.tables,
        "heatmaps": out.figures,
    }
    return out


def top_heads(scores: np.ndarray, n: int = 3) -> str:
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
