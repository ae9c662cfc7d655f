"""MAPS dynamic scores over a store (``actstore maps-dynamic``): what the heads wrote on the stored
prompts, its correlation with the static scores, the result tables and the ``runs`` row.

Tables (one file per run, unless ``save`` is False):

    maps_dynamic      relation, template, layer, head, static_score, dyn_w_context, dyn_wo_context, ...
    maps_correlation  per relation: Pearson r (and p) static vs dynamic, with and without context
    maps_excluded     relations left out for having fewer usable pairs than min_pairs, with their counts
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from actstore.core.errors import InvalidSetting, MapsError
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.jobs.maps import FirstMlp, Log, first_mlp_wanted, load_first_mlp
from actstore.jobs.record import record_run
from actstore.jobs.settings import MapsDynamicConfig
from actstore.query.maps.defaults import relation_ks
from actstore.query.maps.dynamic import correlation_summary, correlation_table, dynamic_ranks, head_table
from actstore.query.maps.pairs import load_pair_files, tokenize_pairs
from actstore.query.maps.projection import VocabProjection
from actstore.query.maps.prompt_policy import usable_prompts
from actstore.query.select.selection import Selection


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
    store: StoreReader,
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
    mlp = load_first_mlp(first_mlp) if use_mlp or cfg.compare_first_mlp else None
    chosen = usable_prompts(
        store,
        tokenizer=tok,
        rows=Selection.from_sql(store, cfg.where),
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
        rows=Selection.from_ids(store, chosen.example_ids.tolist()),
        relations=chosen.relations,
        source_token=cfg.source_token,  # type: ignore[arg-type]
        final_norm=cfg.final_norm,
        k_max=max(ks.values()),
        proj=proj,
        log=log,
        client=client,
        prompts_per_task=cfg.prompts_per_task,
        alt_proj=alt,
    )
    variants = [
        v for d in ranks.values() for v in (d, d.alt) if v is not None
    ]  # per relation: plain, first MLP
    summaries = [correlation_summary(d, ks[d.relation], cfg.threshold) for d in variants]
    run_id = new_run_id("maps-dynamic")
    k_policy = "given" if cfg.k is not None else "paper"
    out = MapsDynamicOutcome(run_id, summaries, chosen.excluded, use_mlp, {})
    if cfg.save:
        tables = {
            "maps_dynamic": pa.concat_tables([head_table(d, ks[d.relation]) for d in variants]),
            "maps_correlation": correlation_table(summaries),
        }
        if chosen.excluded:
            tables["maps_excluded"] = pa.Table.from_pylist(chosen.excluded)
        settings = ("where", "k", "multi_token", "min_pairs", "pairs", "source_token", "final_norm")
        config = {k: getattr(cfg, k) for k in (*settings, "compare_first_mlp")} | {
            "relations": wanted,
            "k_policy": k_policy,
            "k_per_relation": ks,
            "excluded": [e["relation"] for e in chosen.excluded],
            "first_mlp": use_mlp,
        }
        out.tables += record_run(store, "maps-dynamic", config, tables, started=started, run_id=run_id).tables
    if cfg.figures:
        from actstore.query.maps.figures import head_heatmap, safe_name

        for name, d in ranks.items():
            kr = ks[name]
            maps_: list[tuple[str, Any]] = [("static_first_mlp" if d.first_mlp else "static", d.static_up)]
            if d.alt is not None:
                maps_.append(("static_first_mlp", d.alt.static_up))
            for key, arr in (*maps_, ("dynamic_w_context", d.w_up), ("dynamic_wo_context", d.wo_up)):
                grid = d.per_template(arr, kr).mean(0)
                path = f"{cfg.figures}/maps_{key}_{safe_name(name)}.png"
                title = f"{key.replace('_', ' ')}, {name} (k={kr})"
                out.figures.append(str(head_heatmap(grid, path, title, vmax=1.0, threshold=cfg.threshold)))
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
