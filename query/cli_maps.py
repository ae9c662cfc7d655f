"""``actstore maps`` (static scores and salient operations, weights only) and ``actstore
maps-dynamic`` (scores from stored head outputs, and their correlation with the static ones).

Both write their results as store tables (one file per run) unless ``--no-write``:

    maps_scores       relation, layer, head, kv_head, score, suppression, implements, suppresses, k, ...
    maps_relations    per relation: k, pairs used, multi-token and unknown counts, heads implementing R
    maps_excluded     relations left out for having fewer usable pairs than --min-pairs, with their counts
    maps_salient      layer, head, rank, token, sigma, mapped_tokens
    maps_dynamic      relation, template, layer, head, static_score, dyn_w_context, dyn_wo_context, ...
    maps_correlation  per relation: Pearson r (and p) static vs dynamic, with and without context
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import click
import numpy as np
import pyarrow as pa

from actstore.cli import friendly, where_option
from query.maps import IMPLEMENTS_THRESHOLD, MIN_PAIRS


def new_run_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def write_run(store: Any, run_id: str, kind: str, started: float, config: dict[str, Any]) -> None:
    """A row in the store's ``runs`` table describing this analysis run."""
    import actstore
    from actstore.writer import write_result_table

    write_result_table(store, "runs", run_id, pa.table({
        "run_id": [run_id], "kind": [kind], "started": [started], "finished": [time.time()],
        "segments_written": [0], "rank": [0], "world_size": [1],
        "config": [json.dumps(config, sort_keys=True, default=str)], "code_version": [actstore.__version__],
    }))


def with_run_id(table: pa.Table, run_id: str) -> pa.Table:
    """``table`` with a leading ``run_id`` column, so runs can be told apart in SQL."""
    return table.add_column(0, "run_id", pa.array([run_id] * table.num_rows, pa.string()))


def _check_k(k: int | None, threshold: float) -> None:
    if k is not None and k < 1:
        raise click.BadParameter("must be at least 1", param_hint="--k")
    if not 0.0 <= threshold <= 1.0:
        raise click.BadParameter("must be between 0 and 1", param_hint="--threshold")


def _top(scores: np.ndarray, n: int = 3) -> str:
    H = scores.shape[1]
    flat = np.argsort(-scores.ravel(), kind="stable")[:n]
    return " ".join(f"{i // H}.{i % H}={scores.ravel()[i]:.2f}" for i in flat)


# ----------------------------------------------------------------------------------- maps


@click.command("maps")
@click.argument("store")
@click.option("--pairs", "pair_paths", multiple=True, required=True,
              help="MAPS pair file ([[source, target], ...]) or a directory of them; repeatable.")
@click.option("--relations", default=None, help="Comma-separated relation names (file stems) to keep.")
@click.option("--k", type=int, default=None,
              help="Top-k of a source's row that counts as a hit, for every relation.  Default: the authors' k per "
              "relation (1 for copying relations, 10 otherwise; Llama-3: 3 and 25).")
@click.option("--threshold", type=float, default=IMPLEMENTS_THRESHOLD, show_default=True,
              help="A head implements R when its score is at least this.")
@click.option("--multi-token", type=click.Choice(["skip", "first"]), default="skip", show_default=True,
              help="skip: score single-token pairs only (the authors' filter); first: a multi-token word stands "
              "as its first token (ours).")
@click.option("--min-pairs", type=int, default=MIN_PAIRS, show_default=True,
              help="Relations with fewer usable pairs are reported as excluded and scored nowhere (the authors' "
              "min_filtered_dataset_size).")
@click.option("--no-final-norm", is_flag=True, help="Read heads through the raw unembedding (the paper's code) "
              "instead of the final norm's weight times it.")
@click.option("--tokenizer", default=None, help="Tokenizer folder or name (default: the store's model).")
@click.option("--first-mlp/--no-first-mlp", "first_mlp", default=None,
              help="Read layers >= 1 through the first MLP's output on the embeddings (the authors' code; default: "
              "on, except for Llama-3.1-70B as in their code).  It loads the model (the store lacks that block's "
              "input weights); --no-first-mlp scores from the store's weights alone.")
@click.option("--model", "model_name", default=None, help="Model for the first MLP (default: the store's).")
@click.option("--salient-heads", default="all", show_default=True,
              help="Heads for salient operations: all, none, or LAYER.HEAD list (12.3,7.*).")
@click.option("--salient-tokens", type=int, default=10, show_default=True, help="Salient tokens per head (by sigma).")
@click.option("--mappings", type=int, default=5, show_default=True, help="Top mapped tokens per salient token.")
@click.option("--heatmaps", "heatmap_dir", default=None, help="Write a layer x head PNG per relation here.")
@click.option("--no-write", is_flag=True, help="Do not write result tables into the store.")
@click.option("--json", "as_json", is_flag=True, help="Print per-relation results as JSON.")
@friendly
def maps(store: str, pair_paths: tuple[str, ...], relations: str | None, k: int | None, threshold: float,
         multi_token: str, min_pairs: int, no_final_norm: bool, tokenizer: str | None, first_mlp: bool | None,
         model_name: str | None, salient_heads: str, salient_tokens: int, mappings: int, heatmap_dir: str | None,
         no_write: bool, as_json: bool) -> None:
    """Static MAPS scores of every head for each relation in --pairs, from STORE's weights."""
    import actstore
    from actstore.writer import write_result_table
    from query.maps import (
        MapsError,
        VocabProjection,
        excluded_line,
        load_pair_files,
        paper_first_mlp,
        parse_heads,
        relation_ks,
        relation_summary,
        salient_operations,
        salient_table,
        scores_table,
        split_by_min_pairs,
        static_scores,
        token_decoder,
        tokenize_pairs,
    )
    from query.store_tokenizer import tokenizer_for_store

    _check_k(k, threshold)
    if min_pairs < 0:
        raise click.BadParameter("must not be negative", param_hint="--min-pairs")
    started = time.time()
    s = actstore.open(store)
    g = s.geometry
    wanted = [r.strip() for r in relations.split(",") if r.strip()] if relations else None
    rels = load_pair_files(list(pair_paths), wanted)
    want_salient = salient_heads.strip().lower() != "none"
    sal_heads = parse_heads(salient_heads, g.n_layers, g.n_heads) if want_salient else None
    tok = tokenizer_for_store(s, tokenizer)
    tokenized = [tokenize_pairs(r, tok, vocab_size=g.vocab_size, multi_token=multi_token,  # type: ignore[arg-type]
                                allow_empty=True) for r in rels]
    stored_name = str(s.manifest.model.get("name") or "")
    if first_mlp is None:
        first_mlp = paper_first_mlp(stored_name)
    mlp = _first_mlp(s, model_name) if first_mlp else None
    kept, excluded = split_by_min_pairs(tokenized, min_pairs)
    if not kept:
        raise MapsError(f"no relation has the {min_pairs} usable pairs needed (usable/pairs: {excluded_line(excluded)}); "
                        "lower --min-pairs, or --multi-token first")
    ks = relation_ks([p.relation for p in kept], k, stored_name)
    proj = VocabProjection(s, final_norm=not no_final_norm, first_mlp=mlp)
    scores = static_scores(proj, kept, k_max=max(ks.values()))
    summaries = [relation_summary(name, sc, ks[name], threshold) for name, sc in scores.items()]
    run_id = new_run_id("maps")
    written: list[str] = []
    figures: list[str] = []
    ops = salient_operations(proj, sal_heads, n_tokens=salient_tokens, n_mappings=mappings,
                             vocab_limit=len(tok)) if want_salient else []
    decode = token_decoder(tok)
    k_policy = "given" if k is not None else "paper"
    if not no_write:
        tables = {"maps_scores": scores_table(scores, ks, threshold, g.kv_group),
                  "maps_relations": pa.Table.from_pylist(summaries)}
        if excluded:
            tables["maps_excluded"] = pa.Table.from_pylist(excluded)
        if ops:
            tables["maps_salient"] = salient_table(ops, decode)
        for name, table in tables.items():
            written.append(write_result_table(s, name, run_id, with_run_id(table, run_id)))
        write_run(s, run_id, "maps", started, {"pairs": list(pair_paths), "relations": wanted, "k": k,
                                               "k_policy": k_policy, "k_per_relation": ks,
                                               "threshold": threshold, "multi_token": multi_token,
                                               "min_pairs": min_pairs, "excluded": [e["relation"] for e in excluded],
                                               "final_norm": not no_final_norm, "tokenizer": tokenizer,
                                               "first_mlp": first_mlp})
    if heatmap_dir:
        from query.maps_figures import head_heatmap, safe_name

        for name, sc in scores.items():
            kr = ks[name]
            figures.append(str(head_heatmap(sc.score(kr), f"{heatmap_dir}/maps_{safe_name(name)}.png",
                                            f"MAPS static score, {name} (k={kr})", vmax=1.0, threshold=threshold)))
            figures.append(str(head_heatmap(sc.suppression(kr), f"{heatmap_dir}/maps_{safe_name(name)}_suppression.png",
                                            f"MAPS suppression score, {name} (k={kr})", vmax=1.0, threshold=threshold)))
    if as_json:
        out_rel = []
        for summ in summaries:
            sc = scores[summ["relation"]]
            phi, sup = sc.score(summ["k"]), sc.suppression(summ["k"])
            heads = [{"relation": summ["relation"], "layer": layer, "head": h, "score": float(phi[layer, h]),
                      "suppression": float(sup[layer, h])} for layer in range(g.n_layers) for h in range(g.n_heads)]
            out_rel.append({**summ, "heads": heads})
        salient = [{"layer": op.layer, "head": op.head, "tokens": [
            {"token": t, "token_id": int(i), "sigma": float(sg), "mapped": decode([int(x) for x in m])}
            for i, t, sg, m in zip(op.token_ids.tolist(), decode(op.token_ids.tolist()), op.sigma.tolist(), op.mapped_ids)]}
            for op in ops]
        click.echo(json.dumps({"store": s.url, "run_id": run_id, "k": k, "k_policy": k_policy, "threshold": threshold,
                               "final_norm": not no_final_norm, "first_mlp": first_mlp, "multi_token": multi_token,
                               "min_pairs": min_pairs, "relations": out_rel, "excluded": excluded,
                               "salient": salient, "tables": written, "heatmaps": figures}))
        return
    k_text = f"k={k}" if k is not None else "k per relation (the authors': " + ", ".join(
        f"{v} for {n}" for v, n in _k_groups(ks)) + ")"
    click.echo(f"MAPS static scores, {k_text}, threshold={threshold}, {g.n_layers}x{g.n_heads} heads, "
               f"{'single-token pairs' if multi_token == 'skip' else 'multi-token words as their first token'}"
               f"{', first MLP' if first_mlp else ', embeddings (no first MLP)'}, run {run_id}")
    click.echo(f"{'relation':<40} {'k':>2} {'pairs':>11} {'multi':>5} {'impl':>4} {'supp':>4}  best heads")
    for summ in summaries:
        sc = scores[summ["relation"]]
        multi = summ["n_multi_token"] if multi_token == "first" else summ["n_skipped_multi_token"]
        click.echo(f"{summ['relation']:<40} {summ['k']:>2} {summ['n_used']:>5}/{summ['n_pairs']:<5} {multi:>5} "
                   f"{summ['n_implementing']:>4} {summ['n_suppressing']:>4}  {_top(sc.score(summ['k']))}")
    click.echo("(multi: " + ("pairs scored on a first token" if multi_token == "first" else "multi-token pairs dropped")
               + ")")
    if excluded:
        click.echo(f"excluded, fewer than {min_pairs} usable pairs (usable/pairs): {excluded_line(excluded)}")
    if ops:
        click.echo(f"salient operations for {len(ops)} heads (table maps_salient)" if not no_write else
                   f"salient operations for {len(ops)} heads")
    for f in written:
        click.echo(f"wrote {f}")


def _k_groups(ks: dict[str, int]) -> list[tuple[int, str]]:
    """[(1, "name_copying, general_copying_english_500"), (10, "the other 14")] for the text output."""
    by: dict[int, list[str]] = {}
    for name, v in ks.items():
        by.setdefault(v, []).append(name)
    if len(by) == 1:
        return [(next(iter(by)), "all")]
    big = max(by, key=lambda v: len(by[v]))
    return [(v, ", ".join(names)) for v, names in sorted(by.items()) if v != big] + [(big, f"the other {len(by[big])}")]


# ----------------------------------------------------------------------------------- maps-dynamic


@click.command("maps-dynamic")
@click.argument("store")
@where_option("SQL predicate over examples, e.g. \"source = 'maps'\".")
@click.option("--relations", default=None, help="Comma-separated relation ids.")
@click.option("--k", type=int, default=None,
              help="Top-k for every relation.  Default: the authors' k per relation (1 for copying relations, 10 "
              "otherwise; Llama-3: 3 and 25).")
@click.option("--threshold", type=float, default=IMPLEMENTS_THRESHOLD, show_default=True)
@click.option("--multi-token", type=click.Choice(["skip", "first"]), default="skip", show_default=True,
              help="skip: only prompts whose subject and object are one token each (the authors' filter); "
              "first: every prompt, a multi-token word standing as its first token (ours).")
@click.option("--min-pairs", type=int, default=MIN_PAIRS, show_default=True,
              help="Relations with fewer usable pairs are reported as excluded and left out.")
@click.option("--pairs", "pair_paths", multiple=True,
              help="MAPS pair files or directories: count each relation's usable pairs in its file (the authors' "
              "criterion) rather than among the store's prompts (a sample of it undercounts).")
@click.option("--tokenizer", default=None, help="Tokenizer folder or name (default: the store's model).")
@click.option("--source-token", type=click.Choice(["first", "last"]), default="first", show_default=True,
              help="Which subject token is the static source and the no-context attention target.")
@click.option("--no-final-norm", is_flag=True, help="Raw unembedding instead of final norm weight times it.")
@click.option("--first-mlp/--no-first-mlp", "first_mlp", default=None,
              help="Static scores through the first MLP (the authors' code; default on except for Llama-3.1-70B; "
              "loads the model).")
@click.option("--model", "model_name", default=None, help="Model for the first MLP (default: the store's).")
@click.option("--compare-first-mlp", is_flag=True,
              help="Static scores both from the embeddings and through the first MLP (loads the model), sharing "
              "one dynamic pass: a correlation row per relation and variant.")
@click.option("--heatmaps", "heatmap_dir", default=None, help="Write static and dynamic heatmaps here.")
@click.option("--no-write", is_flag=True, help="Do not write result tables into the store.")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@click.option("--dask", "dask_address", default=None, metavar="SCHEDULER_ADDRESS",
              help="Run the projections on this Dask scheduler's workers (they open STORE themselves).")
@click.option("--workers", type=int, default=None, help="Run them on a local Dask cluster of N worker processes.")
@click.option("--prompts-per-task", type=int, default=None,
              help="Prompts per Dask task (whole chunks of 256; default: one task per worker).")
@click.option("--json", "as_json", is_flag=True)
@friendly
def maps_dynamic(store: str, where: str | None, relations: str | None, k: int | None, threshold: float,
                 multi_token: str, min_pairs: int, pair_paths: tuple[str, ...], tokenizer: str | None,
                 source_token: str, no_final_norm: bool, first_mlp: bool | None, model_name: str | None,
                 compare_first_mlp: bool, heatmap_dir: str | None, no_write: bool, quiet: bool,
                 dask_address: str | None, workers: int | None, prompts_per_task: int | None, as_json: bool) -> None:
    """Dynamic MAPS scores from STORE's head outputs, and their correlation with the static scores."""
    import actstore
    from actstore.writer import write_result_table
    from query.distributed import dask_client
    from query.maps import (
        MapsError,
        VocabProjection,
        load_pair_files,
        paper_first_mlp,
        relation_ks,
        tokenize_pairs,
    )
    from query.maps_dynamic import (
        correlation_summary,
        correlation_table,
        dynamic_ranks,
        head_table,
        usable_prompts,
    )

    _check_k(k, threshold)
    if min_pairs < 0:
        raise click.BadParameter("must not be negative", param_hint="--min-pairs")
    started = time.time()
    s = actstore.open(store)
    wanted = [r.strip() for r in relations.split(",") if r.strip()] if relations else None
    stored_name = str(s.manifest.model.get("name") or "")
    tok = None
    if multi_token == "skip" or pair_paths:
        from query.store_tokenizer import tokenizer_for_store

        tok = tokenizer_for_store(s, tokenizer)
    pair_counts = None
    if pair_paths:
        pair_counts = {}
        for rp in load_pair_files(list(pair_paths)):
            tp = tokenize_pairs(rp, tok, vocab_size=s.geometry.vocab_size, multi_token=multi_token,  # type: ignore[arg-type]
                                allow_empty=True)
            pair_counts[rp.relation] = (tp.n_used, tp.n_pairs)
    if first_mlp is None:
        first_mlp = paper_first_mlp(stored_name)
    mlp = _first_mlp(s, model_name) if first_mlp or compare_first_mlp else None
    chosen = usable_prompts(s, tokenizer=tok, where=where, relations=wanted, multi_token=multi_token,
                            min_pairs=min_pairs, pair_counts=pair_counts)
    if not chosen.relations:
        raise MapsError("no relation has the usable prompts and pairs needed (usable pairs/pairs: "
                        + ", ".join(f"{e['relation']} {e['n_used']}/{e['n_pairs']} ({e['counted_from']})"
                                    for e in chosen.excluded)
                        + f"; minimum {min_pairs}); lower --min-pairs, or --multi-token first")
    ks = relation_ks(chosen.relations, k, stored_name)
    proj = VocabProjection(s, final_norm=not no_final_norm, first_mlp=None if compare_first_mlp else mlp)
    alt = VocabProjection(s, final_norm=not no_final_norm, first_mlp=mlp) if compare_first_mlp else None
    with dask_client(dask_address, workers) as client:
        ranks = dynamic_ranks(s, where=where, relations=chosen.relations, source_token=source_token,  # type: ignore[arg-type]
                              final_norm=not no_final_norm, k_max=max(ks.values()), proj=proj,
                              log=None if quiet else lambda m: click.echo(m, err=True),
                              client=client, prompts_per_task=prompts_per_task, alt_proj=alt,
                              example_ids=chosen.example_ids.tolist())
    variants = [v for d in ranks.values() for v in (d, d.alt) if v is not None]  # per relation: plain, first MLP
    summaries = [correlation_summary(d, ks[d.relation], threshold) for d in variants]
    run_id = new_run_id("maps-dynamic")
    written: list[str] = []
    figures: list[str] = []
    k_policy = "given" if k is not None else "paper"
    if not no_write:
        heads_t = pa.concat_tables([head_table(d, ks[d.relation]) for d in variants])
        written.append(write_result_table(s, "maps_dynamic", run_id, with_run_id(heads_t, run_id)))
        written.append(write_result_table(s, "maps_correlation", run_id,
                                          with_run_id(correlation_table(summaries), run_id)))
        if chosen.excluded:
            written.append(write_result_table(s, "maps_excluded", run_id,
                                              with_run_id(pa.Table.from_pylist(chosen.excluded), run_id)))
        write_run(s, run_id, "maps-dynamic", started, {"where": where, "relations": wanted, "k": k,
                                                       "k_policy": k_policy, "k_per_relation": ks,
                                                       "multi_token": multi_token, "min_pairs": min_pairs,
                                                       "pairs": list(pair_paths),
                                                       "excluded": [e["relation"] for e in chosen.excluded],
                                                       "source_token": source_token, "final_norm": not no_final_norm,
                                                       "first_mlp": first_mlp, "compare_first_mlp": compare_first_mlp})
    if heatmap_dir:
        from query.maps_figures import head_heatmap, safe_name

        for name, d in ranks.items():
            kr = ks[name]
            maps_: list[tuple[str, Any]] = [("static_first_mlp" if d.first_mlp else "static", d.static_up)]
            if d.alt is not None:
                maps_.append(("static_first_mlp", d.alt.static_up))
            for key, arr in (*maps_, ("dynamic_w_context", d.w_up), ("dynamic_wo_context", d.wo_up)):
                figures.append(str(head_heatmap(d.per_template(arr, kr).mean(0),
                                                f"{heatmap_dir}/maps_{key}_{safe_name(name)}.png",
                                                f"{key.replace('_', ' ')}, {name} (k={kr})", vmax=1.0,
                                                threshold=threshold)))
    if as_json:
        out = []
        for summ, d in zip(summaries, variants):
            kr = ks[d.relation]
            st, w, o = (d.per_template(a, kr).mean(0) for a in (d.static_up, d.w_up, d.wo_up))
            L, H = st.shape
            heads = [{"relation": d.relation, "layer": layer, "head": h, "static": float(st[layer, h]),
                      "dyn_w_context": float(w[layer, h]), "dyn_wo_context": float(o[layer, h])}
                     for layer in range(L) for h in range(H)]
            out.append({**_nan_to_none(summ), "templates": d.templates, "heads": heads,
                        "n_prompts_store": chosen.counts[d.relation]["n_prompts"]})
        click.echo(json.dumps({"store": s.url, "run_id": run_id, "k": k, "k_policy": k_policy,
                               "final_norm": not no_final_norm, "first_mlp": first_mlp,
                               "compare_first_mlp": compare_first_mlp, "multi_token": multi_token,
                               "min_pairs": min_pairs, "source_token": source_token, "relations": out,
                               "excluded": chosen.excluded, "tables": written, "heatmaps": figures}))
        return
    static_src = ("embeddings and first MLP" if compare_first_mlp else "first MLP" if first_mlp else "embeddings")
    k_text = f"k={k}" if k is not None else "k per relation (the authors')"
    click.echo(f"MAPS static ({static_src}) vs dynamic (Pearson over heads x templates), {k_text}, "
               f"{'single-token prompts' if multi_token == 'skip' else 'every prompt (first tokens)'}, run {run_id}")
    click.echo(f"{'relation':<40} {'k':>2} {'prompts':>7} {'tmpl':>4} {'r w/o ctx':>9} {'r w/ ctx':>9} "
               f"{'supp w/o':>8} {'supp w/':>8} {'impl s/wo/w':>12}")
    for m in summaries:
        name = m["relation"] + (" (first MLP)" if m["first_mlp"] else " (embeddings)")
        click.echo(f"{name:<40} {m['k']:>2} {m['n_prompts']:>7} {m['n_templates']:>4} {m['corr_wo_context']:>9.3f} "
                   f"{m['corr_w_context']:>9.3f} {m['supp_corr_wo_context']:>8.3f} {m['supp_corr_w_context']:>8.3f} "
                   f"{m['n_implementing_static']:>4}/{m['n_implementing_wo_context']}/{m['n_implementing_w_context']}")
    if chosen.excluded:
        click.echo(f"excluded, fewer than {min_pairs} usable pairs (usable/pairs, counted from): " + ", ".join(
            f"{e['relation']} {e['n_used']}/{e['n_pairs']} ({e['counted_from']})" for e in chosen.excluded))
    for f in written:
        click.echo(f"wrote {f}")


def _first_mlp(store: Any, model_name: str | None) -> Any:
    """The first-MLP source transform of the store's model (loaded on the CPU, float32)."""
    from ingest.first_mlp import first_mlp_transform
    from ingest.models import known_alias, load_model

    if model_name:
        name = model_name
    else:  # the store's own name is data: only actstore's aliases are loaded without --model
        stored = str(store.manifest.model.get("name") or "").strip()
        if not stored:
            raise ValueError("--first-mlp: the store names no model; pass --model (or --no-first-mlp)")
        alias = known_alias(stored)
        if alias is None:
            raise ValueError(f"--first-mlp: the store's model {stored!r} is not one of actstore's aliases, and a name "
                             "read from a store is never loaded from disk or the hub on its own; pass --model "
                             "(or --no-first-mlp)")
        name = alias
    loaded = load_model(name)
    want = str(store.manifest.model.get("weight_hash") or "")
    if want and loaded.weight_hash != want:
        raise ValueError(f"--first-mlp: model {name!r} has other weights than the store's")
    return first_mlp_transform(loaded.model)


def _nan_to_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}
