"""``actstore trace | patch | ablate``: run the store's model with interventions (causal tracing,
activation patching, MAPS head ablation)."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._options import (
    check_where,
    command,
    device_options,
    figures_option,
    json_option,
    model_option,
    no_save_option,
    open_store_arg,
    quiet_option,
    split_list,
    store_argument,
    where_option,
)
from actstore.cli.maps import IMPLEMENTS_THRESHOLD, MIN_PAIRS


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:+6.1f}%"


def _stderr(quiet: bool) -> Any:
    return None if quiet else (lambda m: click.echo(m, err=True))


# ----------------------------------------------------------------------------------- trace
@command(example="actstore trace /tmp/s --limit 20 --samples 3 --figures figs")
@store_argument
@model_option()
@where_option
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="At most this many facts (in example order)."
)
@click.option(
    "--all-facts", is_flag=True, help="Also facts the model gets wrong (default: object_rank = 0 only)."
)
@click.option("--samples", type=int, default=3, show_default=True, help="Noise samples per fact.")
@click.option(
    "--noise",
    "noise_scale",
    type=float,
    default=3.0,
    show_default=True,
    help="Noise std in multiples of the std of the store's subject-token embeddings.",
)
@click.option("--noise-std", type=float, default=None, help="Absolute noise std (overrides --noise).")
@click.option(
    "--window",
    type=int,
    default=10,
    show_default=True,
    help="Layers restored together for MLP and attention.",
)
@click.option(
    "--components", default="resid,mlp,attn", show_default=True, help="Components restored (comma-separated)."
)
@click.option(
    "--all-positions", is_flag=True, help="Also run the positions before the subject (their effect is 0)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the noise.")
@click.option(
    "--batch-size", type=int, default=64, show_default=True, help="Corrupted copies per forward pass."
)
@device_options
@figures_option(help="Folder for ROME-style heatmaps (PNG).")
@click.option(
    "--max-figures", type=int, default=8, show_default=True, help="Per-fact heatmaps drawn at most."
)
@no_save_option
@quiet_option
@json_option
def trace(
    store: str,
    model: str | None,
    where: str | None,
    limit: int | None,
    all_facts: bool,
    samples: int,
    noise_scale: float,
    noise_std: float | None,
    window: int,
    components: str,
    all_positions: bool,
    seed: int,
    batch_size: int,
    device: str,
    model_dtype: str,
    allow_other_model: bool,
    figures: str | None,
    max_figures: int,
    no_save: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Causal tracing: noise on the subject, restore clean states per layer and position, measure P(object)."""
    import numpy as np

    from actstore.ingest.interventions.tracing import TraceConfig
    from actstore.jobs.trace import TraceRequest, run_trace

    s = open_store_arg(store)
    check_where(s, where)
    cfg = TraceConfig(
        samples=samples,
        noise_scale=noise_scale,
        window=window,
        components=split_list(components) or (),
        seed=seed,
        batch_size=batch_size,
        skip_before_subject=not all_positions,
    )
    out = run_trace(
        s,
        TraceRequest(
            model=model,
            where=where,
            limit=limit,
            all_facts=all_facts,
            noise_std=noise_std,
            trace=cfg,
            device=device,
            model_dtype=model_dtype,
            allow_other_model=allow_other_model,
            save=not no_save,
            figures=figures,
            max_figures=max_figures,
            quiet=quiet,
        ),
    )
    rate = 60 * len(out.results) / out.seconds if out.seconds > 0 else None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": s.url,
                    "run_id": out.run_id,
                    "noise_std": out.noise_std,
                    "config": out.config,
                    "facts": [r.to_json() for r in out.results],
                    "tables": out.tables,
                    "figures": out.figures,
                    "trace_seconds": round(out.seconds, 2),
                    "facts_per_minute": rate,
                }
            )
        )
        return
    click.echo(
        f"traced {len(out.results)} facts in {out.seconds:.1f}s ({rate or 0:.1f} facts/min), noise std "
        f"{out.noise_std:.4g} ({samples} samples, window {window}); run {out.run_id}"
    )
    for r in out.results:
        f = r.fact
        peaks = []
        for c in r.restored:
            ie = r.indirect_effect(c)
            layer, pos = np.unravel_index(int(np.argmax(ie)), ie.shape)
            peaks.append(f"{c} {ie[layer, pos]:+.3f}@L{layer}/{f.tokens[pos].strip() or repr(f.tokens[pos])}")
        click.echo(
            f"  {f.example_id:>5} {f.subject!r} -> {f.object!r}: p {r.p_clean:.3f} -> {r.p_corrupt:.3f} "
            f"(TE {r.total_effect:+.3f}); peak IE " + ", ".join(peaks)
        )
    for f_ in (*out.tables, *out.figures):
        click.echo(f"wrote {f_}")


# ----------------------------------------------------------------------------------- patch
def _pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    from actstore.core.invalid import InvalidSetting
    from actstore.jobs.patch import parse_pair

    try:
        return tuple(parse_pair(v) for v in value)
    except InvalidSetting as e:
        raise click.BadParameter(e.detail) from None


@command(example="actstore patch /tmp/s --pair 0:1 --pair 5:8 --json")
@store_argument
@model_option()
@where_option
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many clean facts.")
@click.option(
    "--all-facts",
    is_flag=True,
    help="Also facts the model gets wrong, as clean facts and as counterfactuals.",
)
@click.option(
    "--pair",
    "pairs",
    multiple=True,
    callback=_pairs,
    help="CLEAN_ID:COUNTERFACTUAL_ID (repeatable) instead of choosing counterfactuals.",
)
@click.option(
    "--components", default="resid,attn,mlp", show_default=True, help="Components patched (comma-separated)."
)
@click.option(
    "--positions",
    default="subject_last,last",
    show_default=True,
    help="Positions patched (subject_first, subject_last, last, ...; comma-separated).",
)
@click.option("--no-heads", is_flag=True, help="Skip the per-head patches.")
@click.option(
    "--head-positions", default="last", show_default=True, help="Positions of the per-head patches."
)
@click.option("--batch-size", type=int, default=64, show_default=True, help="Patched runs per forward pass.")
@device_options
@no_save_option
@quiet_option
@json_option
def patch(
    store: str,
    model: str | None,
    where: str | None,
    limit: int | None,
    all_facts: bool,
    pairs: tuple[tuple[int, int], ...],
    components: str,
    positions: str,
    no_heads: bool,
    head_positions: str,
    batch_size: int,
    device: str,
    model_dtype: str,
    allow_other_model: bool,
    no_save: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Activation patching: clean activations into a counterfactual prompt of the same relation;
    logit-difference recovery per layer (attention, MLP, residual) and per head."""
    import numpy as np

    from actstore.ingest.interventions.patching import PatchConfig
    from actstore.jobs.patch import PatchRequest, run_patch

    s = open_store_arg(store)
    check_where(s, where)
    cfg = PatchConfig(
        components=split_list(components) or (),
        positions=split_list(positions) or (),
        heads=not no_heads,
        head_positions=split_list(head_positions) or (),
        batch_size=batch_size,
    )
    out = run_patch(
        s,
        PatchRequest(
            model=model,
            where=where,
            limit=limit,
            all_facts=all_facts,
            pairs=pairs,
            patch=cfg,
            device=device,
            model_dtype=model_dtype,
            allow_other_model=allow_other_model,
            save=not no_save,
            quiet=quiet,
        ),
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": s.url,
                    "run_id": out.run_id,
                    "config": out.config,
                    "pairs": [r.to_json() for r in out.results],
                    "skipped": out.skipped,
                    "tables": out.tables,
                    "patch_seconds": round(out.seconds, 2),
                }
            )
        )
        return
    click.echo(
        f"patched {len(out.results)} pairs in {out.seconds:.1f}s ({len(out.skipped)} facts without a "
        f"counterfactual); run {out.run_id}"
    )
    for r in out.results:
        c, x = r.pair.clean, r.pair.counterfactual
        best = []
        for (comp, pos), v in r.recovery.items():
            if comp != "resid" and np.isfinite(v).any():
                layer = int(np.nanargmax(v))
                best.append(f"{comp}@{pos} {v[layer]:+.2f}@L{layer}")
        click.echo(
            f"  {c.example_id:>5} {c.subject!r}->{c.object!r} into {x.subject!r}->{x.object!r}: "
            f"LD {r.ld_clean:+.2f} / {r.ld_cf:+.2f}; best " + ", ".join(best)
        )
    for f_ in out.tables:
        click.echo(f"wrote {f_}")


# ----------------------------------------------------------------------------------- ablate
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


COMMANDS = [trace, patch, ablate]
