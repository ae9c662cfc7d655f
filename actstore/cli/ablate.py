"""``actstore ablate``: remove the heads MAPS says implement a relation and measure what the model loses."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._options import (
    check_where,
    command,
    device_options,
    json_option,
    model_option,
    no_save_option,
    open_store_arg,
    quiet_option,
    store_argument,
    where_option,
)
from actstore.query.maps.defaults import IMPLEMENTS_THRESHOLD, MIN_PAIRS


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:+6.1f}%"


def _stderr(quiet: bool) -> Any:
    return None if quiet else (lambda m: click.echo(m, err=True))


@command(example="actstore ablate /tmp/s --relation country_capital --pairs maps/ --random-draws 5")
@store_argument
@model_option()
@click.option("--relation", required=True, help="Relation id whose MAPS heads are removed.")
@click.option(
    "--control",
    "controls",
    multiple=True,
    help="Control relation (repeatable); default: chosen as in the paper among the store's relations.",
)
@click.option("--no-controls", is_flag=True, help="Skip control relations.")
@click.option(
    "--max-controls",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Automatic controls: at most this many.",
)
@click.option(
    "--max-head-overlap",
    type=click.FloatRange(0, 1),
    default=0.15,
    show_default=True,
    help="Automatic controls: share of RELATION's heads among a control's own top heads, below this.",
)
@click.option(
    "--max-accuracy-gap",
    type=click.FloatRange(min=0),
    default=0.2,
    show_default=True,
    help="Automatic controls: base accuracy within this of RELATION's.",
)
@click.option(
    "--pairs",
    "pair_paths",
    multiple=True,
    help="MAPS pair files or directories for the static scores of RELATION and of the candidate controls "
    "(default, and for relations without a file: the store's own prompts).",
)
@click.option(
    "--scores-store",
    default=None,
    help="Read stored static scores (an `actstore maps` run with the same settings) from this store of "
    "the same model instead of STORE's.",
)
@click.option("--no-stored-scores", is_flag=True, help="Always compute the static scores from the weights.")
@click.option(
    "--k",
    type=click.IntRange(min=1),
    default=None,
    help="Top-k for every relation (default: the authors' k per relation, 1 for copying relations, 10 "
    "otherwise).",
)
@click.option(
    "--min-pairs",
    type=click.IntRange(min=0),
    default=MIN_PAIRS,
    show_default=True,
    help="Relations with fewer usable pairs take no part (the authors' minimum).",
)
@click.option(
    "--multi-token",
    type=click.Choice(["skip", "first"]),
    default="skip",
    show_default=True,
    help="Pair files: single-token pairs only (the authors' filter), or a word's first token (ours).",
)
@click.option(
    "--threshold",
    type=click.FloatRange(0, 1),
    default=IMPLEMENTS_THRESHOLD,
    show_default=True,
    help="A head implements the relation when its static score is at least this.",
)
@click.option(
    "--top-m",
    type=click.IntRange(min=1),
    default=None,
    help="Remove the m best non-zero heads instead of those >= threshold.",
)
@click.option("--heads", "heads_text", default=None, help="Remove these heads instead (LAYER.HEAD list).")
@click.option("--random-draws", type=int, default=5, show_default=True, help="Draws of as many random heads.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random draws.")
@click.option(
    "--mode",
    type=click.Choice(["zero", "mean"]),
    default="zero",
    show_default=True,
    help="zero: z_h = 0; mean: z_h = its mean over the store's rows.",
)
@click.option(
    "--all-positions", is_flag=True, help="Ablate at every position, not only the last prompt token."
)
@where_option
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Prompts per forward pass.",
)
@device_options
@click.option("--no-final-norm", is_flag=True, help="Static scores through the raw unembedding.")
@click.option(
    "--first-mlp/--no-first-mlp",
    "first_mlp",
    default=None,
    help="Static scores through the first MLP's output (the paper's code; default on, except Llama-3.1-70B).",
)
@no_save_option
@quiet_option
@json_option
def ablate(
    store: str,
    model: str | None,
    relation: str,
    controls: tuple[str, ...],
    no_controls: bool,
    max_controls: int,
    max_head_overlap: float,
    max_accuracy_gap: float,
    pair_paths: tuple[str, ...],
    scores_store: str | None,
    no_stored_scores: bool,
    k: int | None,
    min_pairs: int,
    multi_token: str,
    threshold: float,
    top_m: int | None,
    heads_text: str | None,
    random_draws: int,
    seed: int,
    mode: str,
    all_positions: bool,
    where: str | None,
    batch_size: int,
    device: str,
    model_dtype: str,
    allow_other_model: bool,
    no_final_norm: bool,
    first_mlp: bool | None,
    no_save: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Accuracy on RELATION's prompts with no ablation, with its MAPS heads removed, with as many
    random heads removed, and on control relations."""
    from actstore.ingest.interventions.ablation import AblationConfig
    from actstore.jobs.ablate import AblateRequest, parse_heads_text, run_ablate

    s = open_store_arg(store)
    check_where(s, where)
    cfg = AblationConfig(
        relation=relation,
        controls=() if no_controls else (tuple(controls) if controls else None),
        k=k,
        threshold=threshold,
        top_m=top_m,
        heads=parse_heads_text(heads_text, s),
        random_draws=random_draws,
        seed=seed,
        mode=mode,
        all_positions=all_positions,
        where=where,
        batch_size=batch_size,
        final_norm=not no_final_norm,
        first_mlp=first_mlp,
        min_pairs=min_pairs,
        multi_token=multi_token,
        max_controls=max_controls,
        max_head_overlap=max_head_overlap,
        max_accuracy_gap=max_accuracy_gap,
        reuse_stored=not no_stored_scores,
    )
    out = run_ablate(
        s,
        AblateRequest(
            ablation=cfg,
            model=model,
            pairs=pair_paths,
            scores_store=scores_store,
            device=device,
            model_dtype=model_dtype,
            allow_other_model=allow_other_model,
            save=not no_save,
        ),
        log=_stderr(quiet),
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": s.url,
                    "run_id": out.run_id,
                    "relations": [out.summary],
                    "rows": out.rows,
                    "tables": out.tables,
                }
            )
        )
        return
    m = out.summary
    click.echo(
        f"{relation}: {m['n_prompts']} prompts, {m['n_heads']} heads removed ({m['head_selection']}, k={m['k']}"
        f"{', first MLP' if m['first_mlp'] else ''}, "
        f"{mode} ablation at {m['positions']} position(s)); run {out.run_id}"
    )
    click.echo(f"  heads: {m['heads'] or '(none)'}")
    click.echo(f"  base accuracy            {m['base']:.3f}   (ingest recorded {m['store_base']:.3f})")
    click.echo(f"  relation heads removed   {m['ablated']:.3f}   {_pct(m['drop_pct'])} drop")
    if m["random_mean"] is not None:
        click.echo(
            f"  random heads removed     {m['random_mean']:.3f} +- {m['random_std']:.3f} "
            f"({m['random_draws']} draws)  {_pct(m['random_drop_pct'])} drop"
        )
    for c in m["controls"]:
        click.echo(
            f"  control {c['relation']:<24} base {c['base']:.3f} -> {c['ablated']:.3f}  {_pct(c['drop_pct'])} drop"
        )
    if m["control_choice"]:
        click.echo(f"  controls: {m['control_selection']}")
        for c in m["control_choice"]:
            click.echo(f"    {'chosen ' if c['chosen'] else 'skipped'} {c['relation']:<40} {c['reason']}")
    sources: dict[str, list[str]] = {}
    for rel, src in m["static_scores"].items():
        sources.setdefault(src, []).append(rel)
    for src, names in sources.items():
        click.echo(f"  static scores {src}: {', '.join(names)}")
    for f in out.tables:
        click.echo(f"wrote {f}")


COMMANDS = [ablate]
