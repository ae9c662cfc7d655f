"""``actstore probe | headscore | tokenscore | correlate | shortcuts``: relation probes and what
their HeadScores and TokenScores say."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import click

from actstore.cli._config import config_from, defaults, options_from
from actstore.cli._options import (
    Run,
    command,
    figures_option,
    job,
    json_option,
    open_store_arg,
    run_options,
    store_argument,
    threads_option,
    where_option,
)
from actstore.jobs.settings import CorrelateConfig, ProbeRequest, ShortcutsConfig
from actstore.query.analyses.probe_config import ProbeConfig

PROBE_DEFAULTS = defaults(ProbeConfig)


def _clean(x: Any) -> Any:
    """JSON-safe: NaN -> null, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _echo_json(d: Any) -> None:
    click.echo(json.dumps(_clean(d)))


def run_option(fn: Any) -> Any:
    return click.option("--run", "run_id", required=True, help="Probe run id (see the runs table).")(fn)


# --------------------------------------------------------------------------------------- probe
@job(example="actstore probe /tmp/s --kind attn_head --where \"split = 'val'\" --episodes 100 --seeds 1")
@where_option
@options_from(ProbeRequest)
@click.option(
    "--seeds",
    "n_seeds",
    type=click.IntRange(min=1),
    default=len(PROBE_DEFAULTS["seeds"]),
    show_default=True,
    help="Number of seeds (seed-start .. seed-start + N - 1).",
)
@click.option(
    "--seed-start", type=int, default=PROBE_DEFAULTS["seeds"][0], show_default=True, help="First seed."
)
@run_options
def probe(
    store: str,
    where: str | None,
    n_seeds: int,
    seed_start: int,
    run: Run,
    **given: Any,
) -> None:
    """Episodic n-way k-shot relation probes with RelSpec feature selection."""
    from actstore.jobs.probe import contrast_text, run_probe

    cfg = config_from(ProbeConfig, given, where=where, seeds=tuple(range(seed_start, seed_start + n_seeds)))
    req = config_from(ProbeRequest, given, probe=cfg, save=run.save_results, progress=run.progress)
    s = open_store_arg(store)
    job = run_probe(s, req)
    out = job.output
    summary = out.summary()
    if run.save_results:
        summary["tables"] = sorted({p.split("/")[1] for p in job.tables})
    if run.as_json:
        _echo_json(summary)
        return
    lo, hi = out.ci95
    selection = f"RelSpec top {cfg.top_k}" if cfg.relspec else "no RelSpec (all features)"
    click.echo(
        f"{cfg.kind} {cfg.n_way}-way {cfg.k_shot}-shot: accuracy {100 * out.accuracy:.2f}% "
        f"(95% CI {100 * lo:.2f}-{100 * hi:.2f}) over {len(out.episodes)} episodes "
        f"({cfg.episodes} x {n_seeds} seeds), {selection}, {summary['mean_selected_features']:.0f} features/episode, "
        f"{out.seconds:.1f}s"
    )
    click.echo(f"HeadScore contrast: {contrast_text(cfg.contrast)}")
    click.echo(
        f"run {out.run_id}" + ("" if not run.save_results else f" (tables: {', '.join(summary['tables'])})")
    )


# --------------------------------------------------------------------------------------- headscore
@command(
    example="actstore headscore /tmp/s --run probe-20261201T080351-97216b7b --relation P177 --figures figs"
)
@store_argument
@run_option
@click.option("--relation", default=None, help="Only predictions whose gold relation is this one.")
@figures_option(help="Folder for the layer x head heatmap (headscore_RUN[_RELATION].png).")
@json_option
def headscore(store: str, run_id: str, relation: str | None, figures: str | None, as_json: bool) -> None:
    """Mean HeadScore per layer x head over a run's query predictions."""
    from actstore.jobs.probe import contrast_text, headscore_grid

    s = open_store_arg(store)
    g = headscore_grid(s, run_id, relation)
    title = f"HeadScore {run_id}" + (f" {relation}" if relation else "")
    pngs: list[str] = []
    if figures:
        from actstore.query.analyses.plotting import headscore_heatmap

        name = f"headscore_{run_id}" + (f"_{relation}" if relation else "") + ".png"
        pngs.append(str(headscore_heatmap(g.scores, g.layers, g.heads, os.path.join(figures, name), title)))
    if as_json:
        _echo_json(
            {
                "run_id": run_id,
                "relation": relation,
                "predictions": g.n_predictions,
                "layers": g.layers,
                "heads": g.heads,
                "scores": g.scores.tolist(),
                "heatmap": pngs[0] if pngs else None,
                "figures": pngs,
                "contrast": g.contrast,
            }
        )
        return
    click.echo(
        f"mean HeadScore over {g.n_predictions} predictions"
        + (f" of {relation}" if relation else "")
        + " (rows: layers, columns: heads; -1 = whole layer); contrast "
        + contrast_text(g.contrast)
    )
    click.echo("layer " + " ".join(f"{h:>8d}" for h in g.heads))
    for i, layer in enumerate(g.layers):
        click.echo(f"{layer:>5d} " + " ".join(f"{v:8.3f}" for v in g.scores[i]))
    for p in pngs:
        click.echo(f"wrote {p}")


# --------------------------------------------------------------------------------------- tokenscore
@command(example="actstore tokenscore /tmp/s --run probe-20261201T080351-97216b7b --example 42")
@store_argument
@threads_option
@run_option
@click.option("--example", "example_id", type=int, required=True, help="Example id of the query prompt.")
@click.option(
    "--seed", type=int, default=None, help="Episode seed (default: the first episode with this query)."
)
@click.option("--episode", type=int, default=None, help="Episode index within its random seed.")
@click.option(
    "--contrast",
    type=click.Choice(["renormalised", "seed"]),
    default=None,
    help="Reading of dW (default: the run's own, see probe --contrast).",
)
@json_option
def tokenscore(
    store: str,
    run_id: str,
    example_id: int,
    seed: int | None,
    episode: int | None,
    contrast: str | None,
    as_json: bool,
) -> None:
    """TokenScore per layer over a query prompt's tokens (its episode is re-trained)."""
    from actstore.jobs.probe import contrast_text
    from actstore.query.analyses.explain import explain_example

    ex = explain_example(
        open_store_arg(store), run_id, example_id, seed=seed, episode=episode, contrast=contrast
    )
    layers = ex.layer_table()
    total = ex.token_scores.sum(0)
    if as_json:
        for row, ts in zip(layers, ex.token_scores):
            row["token_scores"] = ts.tolist()
        _echo_json(
            {
                "run_id": run_id,
                "example_id": example_id,
                "seed": ex.seed,
                "episode": ex.episode,
                "relation_id": ex.relation_id,
                "predicted": ex.predicted,
                "probability": ex.probability,
                "contrast": ex.contrast,
                "tokens": ex.tokens,
                "token_scores": total.tolist(),
                "layers": layers,
            }
        )
        return
    click.echo(
        f"example {example_id} (seed {ex.seed}, episode {ex.episode}): gold {ex.relation_id}, "
        f"predicted {ex.predicted} (p={ex.probability:.3f}); contrast {contrast_text(ex.contrast)}"
    )
    for tok, v in zip(ex.tokens, total):
        click.echo(f"  {tok!r:>20} {v:+10.4f}")
    click.echo("layer  head_score_sum  token_score_sum  centering  residual")
    for r in layers:
        click.echo(
            f"{r['layer']:>5} {r['head_score_sum']:15.4f} {r['token_score_sum']:16.4f} "
            f"{r['centering']:10.4f} {r['residual']:9.2e}"
        )


# --------------------------------------------------------------------------------------- correlate
@job(
    example="actstore correlate /tmp/s --run probe-20261201T080351-97216b7b --kb 'kb/*.txt' "
    "--dataset-file val_wiki.json --figures figs"
)
@click.argument("more_kb", nargs=-1)
@run_option
@click.option(
    "--kb",
    multiple=True,
    help="Q-id triple files (globs allowed; the option may repeat, and "
    "further files may follow it), or codex-m: the public CoDEx-M graph by name (docs/datasets.md).",
)
@options_from(CorrelateConfig)
@figures_option(help="Folder for one scatter PNG per predictor.")
@click.option(
    "--dask",
    "dask_address",
    default=None,
    metavar="SCHEDULER_ADDRESS",
    help="Run the predictor tasks on this Dask scheduler's workers (they open STORE and the --kb files).",
)
@click.option(
    "--workers", type=int, default=None, help="Run them on a local Dask cluster of N worker processes."
)
@run_options
def correlate(
    store: str,
    more_kb: tuple[str, ...],
    run_id: str,
    kb: tuple[str, ...],
    figures: str | None,
    dask_address: str | None,
    workers: int | None,
    run: Run,
    **given: Any,
) -> None:
    """Per-relation F1 vs output range, KG connectivity, TF-IDF similarity, HeadScore concentration."""
    from actstore.jobs.correlate import run_correlate

    cfg = config_from(
        CorrelateConfig,
        given,
        probe_run=run_id,
        kb=tuple(_kb_files((*kb, *more_kb))),
        dask_address=dask_address,
        workers=workers,
        figures=figures,
        save=run.save_results,
    )
    concentration = cfg.concentration
    out = run_correlate(open_store_arg(store), cfg)
    res, pngs, files = out.result, out.figures, cfg.kb
    rel_rows = res.relations.to_pylist()
    range_source = rel_rows[0]["output_range_source"] if rel_rows else None
    if run.as_json:
        _echo_json(
            {
                "run_id": out.run_id,
                "probe_run": run_id,
                "relations": rel_rows,
                "correlations": res.correlations.to_pylist(),
                "kb_coverage": res.kb_coverage,
                "plots": pngs,
                "concentration": concentration,
                "output_range": range_source,
            }
        )
        return
    click.echo(f"{'relation':<10} {'f1':>6} {'range':>6} {'conn':>6} {'cov':>5} {'tfidf':>6} {'conc':>5}")
    for r in rel_rows:
        click.echo(
            f"{r['relation_id']:<10} {r['f1']:6.3f} {r['output_range']:6.0f} {r['connectivity']:6.2f} "
            f"{r['connectivity_coverage']:5.2f} {r['tfidf_similarity']:6.3f} {r['head_concentration']:5.0f}"
        )
    click.echo(f"{'predictor':<20} {'n':>3} {'spearman':>9} {'p':>8} {'pearson':>8} {'p':>8}")
    for c in res.correlations.to_pylist():
        click.echo(
            f"{c['predictor']:<20} {c['n']:>3} {c['spearman_rho']:9.3f} {c['spearman_p']:8.3g} "
            f"{c['pearson_r']:8.3f} {c['pearson_p']:8.3g}"
        )
    if files:
        click.echo(f"knowledge-graph coverage: {100 * res.kb_coverage:.1f}% of instances")
    click.echo(f"output range: {range_source}")
    click.echo(
        "HeadScore concentration: "
        + (
            "predictions assigned to each relation, sum of |HeadScore| (no labels)"
            if concentration == "predicted-abs"
            else "predictions of each gold relation, |mean signed HeadScore| (gold labels)"
        )
    )
    for p in pngs:
        click.echo(f"wrote {p}")
    if out.run_id:
        click.echo(f"run {out.run_id} (tables: relation_predictors, correlations)")


def _kb_files(patterns: tuple[str, ...]) -> list[str]:
    """The triple files of ``--kb``: ``codex-m`` is the public CoDEx-M graph (fetched into the data set
    cache, or read from $ACTSTORE_DATA), anything else a glob of files."""
    from actstore.jobs.probe import expand_files

    files: list[str] = []
    for p in patterns:
        if p == "codex-m":
            from actstore.ingest.datasets.codex import triple_files
            from actstore.ingest.datasets.registry import fetch

            files += [str(f) for f in triple_files(fetch("codex-m"))]
        else:
            files += expand_files([p])
    return files


# --------------------------------------------------------------------------------------- shortcuts
@job(example="actstore shortcuts /tmp/s --run probe-20261201T080351-97216b7b --figures figs")
@run_option
@options_from(ShortcutsConfig)
@figures_option(help="Folder for the three-panel figure (shortcuts_RUN.png).")
@run_options
def shortcuts(store: str, run_id: str, figures: str | None, run: Run, **given: Any) -> None:
    """Spearman rho, Mass and StrongAlign-x of the run's errors' TokenScores vs lexical cues."""
    from actstore.jobs.shortcuts import run_shortcuts

    cfg = config_from(ShortcutsConfig, given, probe_run=run_id, figures=figures, save=run.save_results)
    n_cues = cfg.n_cues
    out = run_shortcuts(open_store_arg(store), cfg)
    res, png = out.result, out.figure
    summ = res.summary.to_pylist()[0]
    if run.as_json:
        _echo_json({**summ, "run_id": out.run_id, "probe_run": run_id, "plot": png})
        return
    click.echo(
        f"{summ['n_errors']} errors, {n_cues} cues per relation: Spearman rho {summ['spearman_rho']:.3f}, "
        f"Mass {summ['mass']:.3f} (baseline {summ['mass_baseline']:.3f}), "
        f"StrongAlign-x {100 * summ['strong_align']:.1f}%"
    )
    if png:
        click.echo(f"wrote {png}")
    if out.run_id:
        click.echo(f"run {out.run_id} (tables: shortcut_errors, shortcut_summary)")


COMMANDS = [probe, headscore, tokenscore, correlate, shortcuts]
