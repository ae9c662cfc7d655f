"""``actstore maps`` (static MAPS scores and salient operations, weights only) and ``actstore
maps-dynamic`` (scores from stored head outputs and their correlation with the static ones).
The result tables are described in :mod:`actstore.jobs.maps` and :mod:`actstore.jobs.maps_dynamic`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import (
    Run,
    check_where,
    figures_option,
    job,
    model_option,
    open_store_arg,
    run_options,
    where_option,
)
from actstore.jobs.settings import MapsDynamicConfig, MapsRunConfig  # torch-free: the help imports it

FIRST_MLP_MODEL_HELP = (
    "Model whose first MLP is loaded (default: the store's model when it is one of actstore's aliases)."
)


def _first_mlp(s: Any, model: str | None) -> Callable[[], Any]:
    """A loader of the store model's first-MLP transform (called only when a run needs it)."""

    def load() -> Any:
        from actstore.jobs.model import first_mlp_for_store

        return first_mlp_for_store(s, model)

    return load


def _tokenizer(s: Any, name: str | None) -> Callable[[], Any]:
    def load() -> Any:
        from actstore.api import tokenizer_for_store

        return tokenizer_for_store(s, name)

    return load


@job("maps", example="actstore maps /tmp/s --pairs maps/ --relations country_capital --figures figs")
@options_from(MapsRunConfig)
@click.option(
    "--first-mlp/--no-first-mlp",
    "first_mlp",
    default=None,
    help="Read layers >= 1 through the first MLP's output on the embeddings (the authors' code; default: "
    "on, except for Llama-3.1-70B as in their code).  It loads the model (the store lacks that block's "
    "input weights); --no-first-mlp scores from the store's weights alone.",
)
@model_option(FIRST_MLP_MODEL_HELP)
@figures_option(help="Folder for a layer x head PNG per relation.")
@run_options
def maps(
    store: str,
    first_mlp: bool | None,
    model: str | None,
    figures: str | None,
    run: Run,
    **given: Any,
) -> None:
    """Static MAPS scores of every head for each relation in --pairs, from STORE's weights."""
    from actstore.jobs.maps import k_groups, run_maps, top_heads_text
    from actstore.query.maps.pairs import excluded_line

    s = open_store_arg(store)
    cfg = config_from(MapsRunConfig, given, first_mlp=first_mlp, save=run.save_results, figures=figures)
    k, threshold, multi_token, tokenizer, min_pairs = (
        cfg.k,
        cfg.threshold,
        cfg.multi_token,
        cfg.tokenizer,
        cfg.min_pairs,
    )
    out = run_maps(s, cfg, _tokenizer(s, tokenizer), first_mlp=_first_mlp(s, model), progress=run.progress)
    if run.as_json:
        click.echo(json.dumps(out.result))
        return
    g = s.geometry
    k_text = (
        f"k={k}"
        if k is not None
        else "k per relation (the authors': " + ", ".join(f"{v} for {n}" for v, n in k_groups(out.ks)) + ")"
    )
    click.echo(
        f"MAPS static scores, {k_text}, threshold={threshold}, {g.n_layers}x{g.n_heads} heads, "
        f"{'single-token pairs' if multi_token == 'skip' else 'multi-token words as their first token'}"
        f"{', first MLP' if out.first_mlp else ', embeddings (no first MLP)'}, run {out.run_id}"
    )
    click.echo(f"{'relation':<40} {'k':>2} {'pairs':>11} {'multi':>5} {'impl':>4} {'supp':>4}  best heads")
    for summ in out.summaries:
        sc = out.scores[summ["relation"]]
        multi = summ["n_multi_token"] if multi_token == "first" else summ["n_skipped_multi_token"]
        click.echo(
            f"{summ['relation']:<40} {summ['k']:>2} {summ['n_used']:>5}/{summ['n_pairs']:<5} {multi:>5} "
            f"{summ['n_implementing']:>4} {summ['n_suppressing']:>4}  {top_heads_text(sc.score(summ['k']))}"
        )
    click.echo(
        "(multi: "
        + ("pairs scored on a first token" if multi_token == "first" else "multi-token pairs dropped")
        + ")"
    )
    if out.excluded:
        click.echo(
            f"excluded, fewer than {min_pairs} usable pairs (usable/pairs): {excluded_line(out.excluded)}"
        )
    if out.salient:
        click.echo(
            f"salient operations for {len(out.salient)} heads (table maps_salient)"
            if run.save_results
            else f"salient operations for {len(out.salient)} heads"
        )
    for f in out.tables:
        click.echo(f"wrote {f}")


@job(
    "maps-dynamic",
    example="actstore maps-dynamic /tmp/s --where \"source = 'maps'\" --pairs maps/ --workers 2",
)
@where_option
@options_from(MapsDynamicConfig, first=("relations", "k", "threshold", "multi_token", "min_pairs", "pairs"))
@click.option(
    "--first-mlp/--no-first-mlp",
    "first_mlp",
    default=None,
    help="Static scores through the first MLP (the authors' code; default on except for Llama-3.1-70B; "
    "loads the model).",
)
@model_option(FIRST_MLP_MODEL_HELP)
@figures_option(help="Folder for the static and dynamic heatmaps.")
@click.option(
    "--dask",
    "dask_address",
    default=None,
    metavar="SCHEDULER_ADDRESS",
    help="Run the projections on this Dask scheduler's workers (they open STORE themselves).",
)
@click.option(
    "--workers", type=int, default=None, help="Run them on a local Dask cluster of N worker processes."
)
@run_options
def maps_dynamic(
    store: str,
    where: str | None,
    first_mlp: bool | None,
    model: str | None,
    figures: str | None,
    dask_address: str | None,
    workers: int | None,
    run: Run,
    **given: Any,
) -> None:
    """Dynamic MAPS scores from STORE's head outputs, and their correlation with the static scores."""
    from actstore.jobs.maps_dynamic import run_maps_dynamic
    from actstore.query.analyses.dask_tasks import dask_client

    s = open_store_arg(store)
    check_where(s, where)
    cfg = config_from(
        MapsDynamicConfig, given, where=where, first_mlp=first_mlp, save=run.save_results, figures=figures
    )
    k, multi_token, tokenizer, min_pairs = cfg.k, cfg.multi_token, cfg.tokenizer, cfg.min_pairs
    compare_first_mlp = cfg.compare_first_mlp
    mlp = _first_mlp(s, model)
    with dask_client(dask_address, workers) as client:
        out = run_maps_dynamic(
            s,
            cfg,
            _tokenizer(s, tokenizer),
            mlp,
            client=client,
            log=run.lines(),
        )
    if run.as_json:
        click.echo(json.dumps(out.result))
        return
    static_src = (
        "embeddings and first MLP" if compare_first_mlp else "first MLP" if out.first_mlp else "embeddings"
    )
    k_text = f"k={k}" if k is not None else "k per relation (the authors')"
    click.echo(
        f"MAPS static ({static_src}) vs dynamic (Pearson over heads x templates), {k_text}, "
        f"{'single-token prompts' if multi_token == 'skip' else 'every prompt (first tokens)'}, run {out.run_id}"
    )
    click.echo(
        f"{'relation':<40} {'k':>2} {'prompts':>7} {'tmpl':>4} {'r w/o ctx':>9} {'r w/ ctx':>9} "
        f"{'supp w/o':>8} {'supp w/':>8} {'impl s/wo/w':>12}"
    )
    for m in out.summaries:
        name = m["relation"] + (" (first MLP)" if m["first_mlp"] else " (embeddings)")
        click.echo(
            f"{name:<40} {m['k']:>2} {m['n_prompts']:>7} {m['n_templates']:>4} {m['corr_wo_context']:>9.3f} "
            f"{m['corr_w_context']:>9.3f} {m['supp_corr_wo_context']:>8.3f} {m['supp_corr_w_context']:>8.3f} "
            f"{m['n_implementing_static']:>4}/{m['n_implementing_wo_context']}/{m['n_implementing_w_context']}"
        )
    if out.excluded:
        click.echo(
            f"excluded, fewer than {min_pairs} usable pairs (usable/pairs, counted from): "
            + ", ".join(
                f"{e['relation']} {e['n_used']}/{e['n_pairs']} ({e['counted_from']})" for e in out.excluded
            )
        )
    for f in out.tables:
        click.echo(f"wrote {f}")


COMMANDS = [maps, maps_dynamic]
