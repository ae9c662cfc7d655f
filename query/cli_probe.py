"""``actstore probe | headscore | tokenscore | correlate | shortcuts`` (registered lazily by actstore.cli)."""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from typing import Any

import click

from actstore.cli import friendly, parse_int_list, where_option
from actstore.errors import QueryError


def _open(store: str) -> Any:
    import actstore

    return actstore.open(store)


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


# --------------------------------------------------------------------------------------- probe
@click.command()
@click.argument("store")
@click.option("--features", "kind", required=True,
              help="Feature kind: attn_head, attn, attn_entity, mlp, mlp_group, resid or z.")
@where_option("SQL predicate over examples selecting the instances.")
@click.option("--layers", default=None, help="Layer subset, e.g. 0,3,5-7 (resid: residual indices).")
@click.option("--heads", default=None, help="Head (or mlp_group group) subset, e.g. 0-3.")
@click.option("--groups", type=int, default=None, help="mlp_group: number of neuron groups (default: heads).")
@click.option("--n-way", type=int, default=5, show_default=True)
@click.option("--k-shot", type=int, default=5, show_default=True)
@click.option("--queries", type=int, default=5, show_default=True, help="Queries per class.")
@click.option("--episodes", type=int, default=500, show_default=True, help="Episodes per seed.")
@click.option("--seeds", type=int, default=5, show_default=True, help="Number of seeds (0 .. N-1).")
@click.option("--seed-start", type=int, default=0, show_default=True, help="First seed.")
@click.option("--top-k", type=int, default=3000, show_default=True, help="RelSpec features per relation.")
@click.option("--no-relspec", is_flag=True,
              help="Baseline without RelSpec: every feature, the same standardisation and training.")
@click.option("--contrast", type=click.Choice(["renormalised", "seed"]), default="renormalised", show_default=True,
              help="dW for HeadScore/TokenScore: competitors weighted by the softmax renormalised over them (ours) "
              "or by the full softmax (the seed's formula as written).")
@click.option("--epochs", type=int, default=200, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True, help="Adam learning rate.")
@click.option("--feature-dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="In-memory feature matrix dtype (float16 halves memory).")
@click.option("--token-scores", type=click.Choice(["errors", "all", "none"]), default="errors", show_default=True,
              help="Which predictions get TokenScores stored (attention kinds only).")
@click.option("--train-batch", type=int, default=2, show_default=True,
              help="Episodes per training tensor problem (1-2 is fastest on a CPU).")
@click.option("--memory-mb", type=int, default=1024, show_default=True, help="Working-memory budget per chunk.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="torch CPU threads (1 is fastest on a shared machine; 0 = torch's default).")
@click.option("--no-save", is_flag=True, help="Do not write result tables into the store.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@friendly
def probe(store: str, kind: str, where: str | None, layers: str | None, heads: str | None, groups: int | None,
          n_way: int, k_shot: int, queries: int, episodes: int, seeds: int, seed_start: int, top_k: int,
          no_relspec: bool, contrast: str, epochs: int,
          lr: float, feature_dtype: str, token_scores: str, train_batch: int, memory_mb: int, threads: int, no_save: bool,
          quiet: bool, as_json: bool) -> None:
    """Episodic n-way k-shot relation probes with RelSpec feature selection."""
    from query.probe import ProbeConfig, run_probe, write_probe_tables

    if seeds < 1:
        raise QueryError(f"--seeds must be at least 1 (got {seeds})")
    if threads < 0:
        raise QueryError(f"--threads must be 0 or more (got {threads})")
    ls, hs = parse_int_list(layers), parse_int_list(heads, "heads")
    cfg = ProbeConfig(kind=kind, where=where, layers=None if ls is None else tuple(ls),
                      heads=None if hs is None else tuple(hs), groups=groups, n_way=n_way, k_shot=k_shot,
                      queries=queries, episodes=episodes, seeds=tuple(range(seed_start, seed_start + seeds)),
                      top_k=top_k, epochs=epochs, lr=lr, feature_dtype=feature_dtype, token_scores=token_scores,
                      memory_mb=memory_mb, threads=threads, train_batch=train_batch, relspec=not no_relspec,
                      contrast=contrast)
    s = _open(store)
    out = run_probe(s, cfg, progress=not quiet and sys.stderr.isatty())
    summary = out.summary()
    if not no_save:
        summary["tables"] = sorted({p.split("/")[1] for p in write_probe_tables(s, out)})
    if as_json:
        _echo_json(summary)
        return
    lo, hi = out.ci95
    selection = "no RelSpec (all features)" if no_relspec else f"RelSpec top {top_k}"
    click.echo(f"{kind} {n_way}-way {k_shot}-shot: accuracy {100 * out.accuracy:.2f}% "
               f"(95% CI {100 * lo:.2f}-{100 * hi:.2f}) over {len(out.episodes)} episodes "
               f"({episodes} x {seeds} seeds), {selection}, {summary['mean_selected_features']:.0f} features/episode, "
               f"{out.seconds:.1f}s")
    click.echo(f"HeadScore contrast: {_contrast_text(contrast)}")
    click.echo(f"run {out.run_id}" + ("" if no_save else f" (tables: {', '.join(summary['tables'])})"))


def _contrast_text(reading: str | None) -> str:
    reading = reading or "renormalised"
    return ("renormalised (dW = W_c_hat - sum pi'_c W_c, pi' renormalised over the competitors; ours)"
            if reading == "renormalised" else "seed (dW = W_c_hat - sum pi_c W_c, the full softmax; the seed's formula)")


def _run_contrast(s: Any, run_id: str) -> str:
    from query.attribution import run_row
    from query.probe import ProbeConfig

    return ProbeConfig.from_json(str(run_row(s, run_id)["config"])).contrast


# --------------------------------------------------------------------------------------- headscore
@click.command()
@click.argument("store")
@click.option("--run", "run_id", required=True)
@click.option("--relation", default=None, help="Only predictions whose gold relation is this one.")
@click.option("--heatmap", default=None, help="Write a layer x head heatmap PNG here.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def headscore(store: str, run_id: str, relation: str | None, heatmap: str | None, as_json: bool) -> None:
    """Mean HeadScore per layer x head over a run's query predictions."""
    import numpy as np

    from query.attribution import run_row, sql_quote

    s = _open(store)
    run_row(s, run_id)
    cond = f"run_id = '{sql_quote(run_id)}'"
    if relation is not None:
        known = [r["relation_id"] for r in s.sql(f"SELECT DISTINCT relation_id FROM head_scores WHERE {cond} "
                                                 "ORDER BY 1").to_pylist()]
        if relation not in known:
            raise QueryError(f"unknown relation {relation!r} for run {run_id} (one of {', '.join(known)})")
        cond += f" AND relation_id = '{sql_quote(relation)}'"
    rows = s.sql(f"SELECT layer, head, sum(score * n) / greatest(sum(n), 1) AS score, sum(n) AS n "
                 f"FROM head_scores WHERE {cond} GROUP BY 1, 2 ORDER BY 1, 2").to_pylist()
    layers = sorted({r["layer"] for r in rows})
    heads = sorted({r["head"] for r in rows})
    grid = np.full((len(layers), len(heads)), np.nan)
    for r in rows:
        grid[layers.index(r["layer"]), heads.index(r["head"])] = r["score"]
    n_pred = int(max((r["n"] for r in rows), default=0))
    if heatmap:
        _heatmap(grid, layers, heads, heatmap, f"HeadScore {run_id}" + (f" {relation}" if relation else ""))
    if as_json:
        _echo_json({"run_id": run_id, "relation": relation, "predictions": n_pred, "layers": layers, "heads": heads,
                    "scores": grid.tolist(), "heatmap": heatmap, "contrast": _run_contrast(s, run_id)})
        return
    click.echo(f"mean HeadScore over {n_pred} predictions" + (f" of {relation}" if relation else "") +
               " (rows: layers, columns: heads; -1 = whole layer); contrast " + _contrast_text(_run_contrast(s, run_id)))
    click.echo("layer " + " ".join(f"{h:>8d}" for h in heads))
    for i, layer in enumerate(layers):
        click.echo(f"{layer:>5d} " + " ".join(f"{v:8.3f}" for v in grid[i]))


def _heatmap(grid: Any, layers: list[int], heads: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.5 + 0.35 * len(heads), 1.5 + 0.2 * len(layers)))
    lim = float(abs(grid[~(grid != grid)]).max()) if grid.size else 1.0
    im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
    ax.set_xticks(range(len(heads)), [str(h) for h in heads], fontsize=7)
    ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=8)
    fig.colorbar(im)
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------- tokenscore
@click.command()
@click.argument("store")
@click.option("--run", "run_id", required=True)
@click.option("--example", "example_id", type=int, required=True)
@click.option("--seed", type=int, default=None, help="Episode seed (default: the first episode with this query).")
@click.option("--episode", type=int, default=None)
@click.option("--contrast", type=click.Choice(["renormalised", "seed"]), default=None,
              help="Reading of dW (default: the run's own, see probe --contrast).")
@click.option("--json", "as_json", is_flag=True)
@friendly
def tokenscore(store: str, run_id: str, example_id: int, seed: int | None, episode: int | None,
               contrast: str | None, as_json: bool) -> None:
    """TokenScore per layer over a query prompt's tokens (its episode is re-trained)."""
    from query.attribution import explain_example

    ex = explain_example(_open(store), run_id, example_id, seed=seed, episode=episode, contrast=contrast)
    layers = ex.layer_table()
    total = ex.token_scores.sum(0)
    if as_json:
        for row, ts in zip(layers, ex.token_scores):
            row["token_scores"] = ts.tolist()
        _echo_json({"run_id": run_id, "example_id": example_id, "seed": ex.seed, "episode": ex.episode,
                    "relation_id": ex.relation_id, "predicted": ex.predicted, "probability": ex.probability,
                    "contrast": ex.contrast, "tokens": ex.tokens, "token_scores": total.tolist(), "layers": layers})
        return
    click.echo(f"example {example_id} (seed {ex.seed}, episode {ex.episode}): gold {ex.relation_id}, "
               f"predicted {ex.predicted} (p={ex.probability:.3f}); contrast {_contrast_text(ex.contrast)}")
    for tok, v in zip(ex.tokens, total):
        click.echo(f"  {tok!r:>20} {v:+10.4f}")
    click.echo("layer  head_score_sum  token_score_sum  centering  residual")
    for r in layers:
        click.echo(f"{r['layer']:>5} {r['head_score_sum']:15.4f} {r['token_score_sum']:16.4f} "
                   f"{r['centering']:10.4f} {r['residual']:9.2e}")


# --------------------------------------------------------------------------------------- correlate
@click.command()
@click.argument("store")
@click.argument("more_kb", nargs=-1)
@click.option("--run", "run_id", required=True)
@click.option("--kb", multiple=True, help="Q-id triple files (globs allowed; the option may repeat, and "
              "further files may follow it).")
@click.option("--direction", type=click.Choice(["out", "both"]), default="out", show_default=True,
              help="An entity's properties: those it has as head, or in either position.")
@click.option("--plots", default=None, help="Directory for one scatter PNG per predictor.")
@click.option("--concentration", type=click.Choice(["predicted-abs", "gold-signed"]), default="predicted-abs",
              show_default=True, help="HeadScore concentration over the predictions assigned to each relation, "
              "summing |score| (no labels needed, the seed's reading), or the earlier gold-label signed version.")
@click.option("--dataset-file", default=None,
              help="The FewRel JSON the store was ingested from: output range over every instance of each relation "
              "in it, object-first ones included (ours; default when given).")
@click.option("--output-range", "range_kind", type=click.Choice(["dataset", "sample"]), default=None,
              help="Output range over the data set file or over the run's stored sample (default: dataset when "
              "--dataset-file is given, else sample).")
@click.option("--dask", "dask_address", default=None, metavar="SCHEDULER_ADDRESS",
              help="Run the predictor tasks on this Dask scheduler's workers (they open STORE and the --kb files).")
@click.option("--workers", type=int, default=None, help="Run them on a local Dask cluster of N worker processes.")
@click.option("--no-save", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def correlate(store: str, more_kb: tuple[str, ...], run_id: str, kb: tuple[str, ...], direction: str,
              plots: str | None, concentration: str, dataset_file: str | None, range_kind: str | None,
              dask_address: str | None, workers: int | None, no_save: bool, as_json: bool) -> None:
    """Per-relation F1 vs output range, KG connectivity, TF-IDF similarity, HeadScore concentration."""
    from actstore.writer import write_result_table
    from query.distributed import dask_client
    from query.predictors import relation_predictors, scatter_plots

    files: list[str] = []
    for pattern in (*kb, *more_kb):
        hits = sorted(glob.glob(pattern))
        if not hits:
            raise QueryError(f"--kb {pattern}: no such file")
        files += hits
    s = _open(store)
    with dask_client(dask_address, workers) as client:
        res = relation_predictors(s, run_id, kb=[os.path.abspath(f) for f in files], direction=direction,
                                  client=client, concentration=concentration, dataset_file=dataset_file,
                                  output_range=range_kind)
    pngs = scatter_plots(res, plots) if plots else []
    if not no_save:
        write_result_table(s, "relation_predictors", run_id, res.relations)
        write_result_table(s, "correlations", run_id, res.correlations)
    rel_rows = res.relations.to_pylist()
    range_source = rel_rows[0]["output_range_source"] if rel_rows else None
    if as_json:
        _echo_json({"run_id": run_id, "relations": rel_rows, "correlations": res.correlations.to_pylist(),
                    "kb_coverage": res.kb_coverage, "plots": pngs, "concentration": concentration,
                    "output_range": range_source})
        return
    click.echo(f"{'relation':<10} {'f1':>6} {'range':>6} {'conn':>6} {'cov':>5} {'tfidf':>6} {'conc':>5}")
    for r in res.relations.to_pylist():
        click.echo(f"{r['relation_id']:<10} {r['f1']:6.3f} {r['output_range']:6.0f} {r['connectivity']:6.2f} "
                   f"{r['connectivity_coverage']:5.2f} {r['tfidf_similarity']:6.3f} {r['head_concentration']:5.0f}")
    click.echo(f"{'predictor':<20} {'n':>3} {'spearman':>9} {'p':>8} {'pearson':>8} {'p':>8}")
    for c in res.correlations.to_pylist():
        click.echo(f"{c['predictor']:<20} {c['n']:>3} {c['spearman_rho']:9.3f} {c['spearman_p']:8.3g} "
                   f"{c['pearson_r']:8.3f} {c['pearson_p']:8.3g}")
    if files:
        click.echo(f"knowledge-graph coverage: {100 * res.kb_coverage:.1f}% of instances")
    click.echo(f"output range: {range_source}")
    click.echo("HeadScore concentration: " + (
        "predictions assigned to each relation, sum of |HeadScore| (no labels)" if concentration == "predicted-abs"
        else "predictions of each gold relation, |mean signed HeadScore| (gold labels)"))
    for p in pngs:
        click.echo(f"wrote {p}")


# --------------------------------------------------------------------------------------- shortcuts
@click.command()
@click.argument("store")
@click.option("--run", "run_id", required=True)
@click.option("--cues", "n_cues", type=int, default=20, show_default=True, help="Lexical cues per relation.")
@click.option("--plot", default=None, help="Write the three-panel figure (PNG) here.")
@click.option("--no-save", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def shortcuts(store: str, run_id: str, n_cues: int, plot: str | None, no_save: bool, as_json: bool) -> None:
    """Spearman rho, Mass and StrongAlign-x of the run's errors' TokenScores vs lexical cues."""
    from actstore.writer import write_result_table
    from query.shortcuts import shortcut_analysis, shortcut_figure

    s = _open(store)
    res = shortcut_analysis(s, run_id, n_cues=n_cues)
    png = shortcut_figure(res, plot) if plot else None
    if not no_save:
        write_result_table(s, "shortcut_errors", run_id, res.errors)
        write_result_table(s, "shortcut_summary", run_id, res.summary)
    summ = res.summary.to_pylist()[0]
    if as_json:
        _echo_json({**summ, "plot": png})
        return
    click.echo(f"{summ['n_errors']} errors, {n_cues} cues per relation: Spearman rho {summ['spearman_rho']:.3f}, "
               f"Mass {summ['mass']:.3f} (baseline {summ['mass_baseline']:.3f}), "
               f"StrongAlign-x {100 * summ['strong_align']:.1f}%")
    if png:
        click.echo(f"wrote {png}")
