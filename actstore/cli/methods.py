"""``actstore lens | agree``: the logit and tuned lens, and how far interpretability methods agree
on each fact's key layer and MLP-vs-attention verdict."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click
import numpy as np

from actstore.cli._config import config_from, options_from
from actstore.cli._options import (
    Run,
    check_where,
    figures_option,
    job,
    open_store_arg,
    run_options,
    where_option,
)
from actstore.jobs.settings import AgreeConfig, CorpusLensConfig, LensRunConfig

PAPER_CONSENSUS_TEXT = "47.6%"  # share of facts on which every method agrees in An Empirical Study of Mechanistic Interpretability Approaches for Factual Recall (ACL 2025)


def method_label(method: str, tuned: str | None) -> str:
    """How outputs name a method: the tuned lens with its fitting rule, e.g. "tuned lens (adam)"."""
    return f"tuned lens ({tuned})" if method == "tuned_lens" and tuned else method


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None or not np.isfinite(x):
        return "   n/a"
    return f"{100 * x:5.1f}%" if pct else f"{x:+.2f}"


def _training_progress(label: str, steps: int, started: float) -> Callable[[int, float], None]:
    """A tuned-lens training callback printing its first, every 25th and last step to stderr."""

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 25 == 0 or step == steps:
            click.echo(
                f"{label}: step {step}/{steps}, sum of per-index KL {loss:.4f}, {time.time() - started:.0f} s",
                err=True,
            )

    return progress


# ------------------------------------------------------------------------------------ lens
@job(example="actstore lens /tmp/s --correct-only --tuned adam --figures figs")
@where_option
@options_from(LensRunConfig)
@click.option("--no-tuned", is_flag=True, help="Logit lens only, on every selected fact.")
@figures_option(help="Folder for the lens curves (PNG).")
@run_options
def lens(
    store: str,
    where: str | None,
    no_tuned: bool,
    figures: str | None,
    run: Run,
    **given: Any,
) -> None:
    """Logit lens and tuned lens from the stored residual stream: object probability and rank per layer."""
    from actstore.jobs.lens import run_lens

    started = time.time()
    s = open_store_arg(store)
    check_where(s, where)
    if no_tuned:
        given["tuned"] = None
    cfg = config_from(LensRunConfig, given, where=where, save=run.save_results, figures=figures)
    progress = _training_progress(f"tuned lens ({cfg.tuned})", cfg.steps, started)
    out = run_lens(s, cfg, progress=None if run.lines() is None else progress)
    r = out.result
    if run.as_json:
        click.echo(json.dumps(r))
        return
    method = r["tuned_method"]
    how = (
        ""
        if method is None
        else f"; tuned lens: {method}"
        + ("" if method == "ridge" else f", {out.steps} steps, lr {out.learning_rate:g}")
    )
    click.echo(
        f"{s.url}: lens on {r['n_eval']} held-out facts ({r['n_train']} train the tuned lens{how}); final index "
        f"= model output on {100 * r['final_index_matches_model']:.1f}%"
    )
    click.echo(
        "index  logit p   tuned p   logit rank  tuned rank  logit top1  tuned top1  logit KL  tuned KL"
    )
    nan = float("nan")
    for x in out.summary:
        click.echo(
            f"{x['index']:>5}  {x['logit_prob']:7.4f}  {x.get('tuned_prob', nan):8.4f}   "
            f"{x['logit_rank_median']:9.0f}  {x.get('tuned_rank_median', nan):10.0f}  "
            f"{100 * x['logit_top1']:9.1f}%  {100 * x.get('tuned_top1', nan):9.1f}%  "
            f"{x['logit_kl']:8.3f}  {x.get('tuned_kl', nan):8.3f}"
        )
    for f in (*out.tables, *out.figures):
        click.echo(f"wrote {f}")


# ------------------------------------------------------------------------------------ corpus-lens
@job(example="actstore corpus-lens /tmp/corpus --steps 100 --batch 256")
@options_from(CorpusLensConfig)
@run_options
def corpus_lens(store: str, run: Run, **given: Any) -> None:
    """The tuned lens as published: trained on a corpus store's positions (--positions all --kinds resid),
    compared with the logit lens by KL to the model's output on documents it never saw."""
    from actstore.jobs.corpus_lens import run_corpus_lens

    started = time.time()
    s = open_store_arg(store)
    cfg = config_from(CorpusLensConfig, given, save=run.save_results)
    progress = _training_progress("tuned lens", cfg.steps, started)
    out = run_corpus_lens(s, cfg, progress=None if run.lines() is None else progress)
    r = out.result
    if run.as_json:
        click.echo(json.dumps(r))
        return
    click.echo(
        f"{s.url}: trained on {r['train_rows']} positions of {r['train_documents']} documents, read on "
        f"{r['eval_rows']} positions of {r['eval_documents']} held-out documents"
    )
    click.echo("index  logit KL  tuned KL")
    for x in out.summary:
        click.echo(f"{x['index']:>5}  {x['kl_logit']:8.4f}  {x['kl_tuned']:8.4f}")
    for f in out.tables:
        click.echo(f"wrote {f}")


def _pct(x: float | None, sign: bool = False) -> str:
    return "n/a" if x is None else (f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}%")


def _chance_table(result: dict[str, Any], label: Callable[[str], str]) -> None:
    """Each pair's key-layer and verdict agreement beside its chance level under the permutation null,
    the excess over chance (points, 95% interval) and Cohen's kappa; the consensus likewise."""
    grouping = result.get("null_grouping") or "none"
    click.echo(f"against chance (facts shuffled within: {grouping}; excess in points, 95% interval)")
    click.echo(
        f"{'methods':<34} {'key layer':>9} {'chance':>7} {'excess':>22} {'kappa':>6}   {'verdict':>7} {'chance':>7} {'kappa':>6}"
    )

    def row(d: dict[str, Any], name: str, k: str, v: str | None) -> None:
        def g(field: str) -> float | None:
            x = d.get(field)
            return None if x is None else float(x)

        exc = g(f"{k}_excess")
        lo, hi = g(f"{k}_excess_low"), g(f"{k}_excess_high")
        interval = "" if lo is None or hi is None else f" [{_pct(lo, True)}, {_pct(hi, True)}]"
        kappa = g(f"{k}_kappa")
        text = (
            f"{name:<34} {_pct(g(k if k == 'consensus' else f'{k}_agreement')):>9} {_pct(g(f'{k}_chance')):>7} "
            f"{_pct(exc, True) + interval:>22} {'n/a' if kappa is None else f'{kappa:+.2f}':>6}"
        )
        if v is not None:
            vk = g(f"{v}_kappa")
            text += (
                f"   {_pct(g(f'{v}_agreement')):>7} {_pct(g(f'{v}_chance')):>7} "
                f"{'n/a' if vk is None else f'{vk:+.2f}':>6}"
            )
        click.echo(text)

    for p in result["pairs"]:
        row(p, f"{label(p['method_a'])} vs {label(p['method_b'])}", "key_layer", "verdict")
    row(result, "all methods agree", "consensus", None)


# ------------------------------------------------------------------------------------ agree
@job(example="actstore agree /tmp/s --run trace-20261201T080351-97216b7b --methods trace,patch,logit_lens")
@options_from(AgreeConfig, first=("runs",))
@figures_option(help="Folder for the profile curves (PNG).")
@run_options
def agree(
    store: str,
    figures: str | None,
    run: Run,
    **given: Any,
) -> None:
    """Key layers and MLP-vs-attention verdicts of each method per fact, and how far the methods agree."""
    from actstore.jobs.compare import run_agreement

    started = time.time()
    s = open_store_arg(store)
    cfg = config_from(AgreeConfig, given, save=run.save_results, figures=figures)
    progress = _training_progress(f"tuned lens ({cfg.tuned})", cfg.steps, started)
    out = run_agreement(
        s,
        cfg,
        log=run.lines(),
        progress=None if run.lines() is None else progress,
    )
    result = dict(out.result)
    result.update(
        {
            "store": s.url,
            "run_id": out.run_id,
            "tables": out.tables,
            "figures": out.figures,
            "seconds": round(time.time() - started, 2),
        }
    )
    if run.as_json:
        click.echo(json.dumps(result, default=float))
        return
    L, tol = result["n_layers"], result["tolerance"]
    tl = result.get("tuned_lens") or {}

    def label(m: str) -> str:
        return method_label(m, tl.get("method"))

    click.echo(f"{result['model']} (L={L}): key layers agree within {tol} layer(s)")
    if tl.get("method") == "corpus":
        click.echo(
            f"{label('tuned_lens')}: translators of {tl['run_id']} on {tl['source']} "
            f"(trained on {tl['train_positions']} corpus positions)"
        )
    elif tl:
        how = (
            ""
            if tl["method"] == "ridge"
            else f", {tl['config']['steps']} steps of {min(tl['config']['batch'], tl['train_facts'])} facts"
        )
        click.echo(
            f"{label('tuned_lens')}: fit on {tl['train_facts']} facts not compared{how}, {tl['seconds']:.0f} s"
        )
    click.echo(
        f"{'methods':<34} {'facts':>5} {'key layer':>9} {'exact':>6} {'MLP/attn':>8} {'profile r':>9}   paper"
    )
    for p in result["pairs"]:
        paper = (
            ""
            if p["paper_key_layer"] is None
            else f"{100 * p['paper_key_layer']:.1f}% / {100 * p['paper_verdict']:.1f}% / {p['paper_correlation']:.2f}"
        )
        r = p["profile_correlation"]
        click.echo(
            f"{label(p['method_a']) + ' vs ' + label(p['method_b']):<34} {p['n_facts']:>5} {_fmt(p['key_layer_agreement']):>9} "
            f"{_fmt(p['key_layer_exact']):>6} {_fmt(p['verdict_agreement']):>8} "
            f"{'n/a' if r is None else f'{r:+.2f}':>9}   {paper}"
        )
    click.echo(
        f"{'all methods agree':<34} {result['consensus_facts']:>5} {_fmt(result['consensus']):>9}"
        f"{'':>27}   {PAPER_CONSENSUS_TEXT}"
    )
    _chance_table(result, label)
    cs = result.get("causal_shares")
    if cs:
        click.echo(
            f"MLP share of the causal effect: tracing {_fmt(cs['trace_mlp_share'])}, "
            f"patching {_fmt(cs.get('patch_mlp_share'))}"
        )
        for name, key in (
            ("at the subject's last token", "key_mlp_layer_relative_subject_last"),
            ("at any position", "key_mlp_layer_relative"),
        ):
            rel = cs.get(key)
            if rel:
                click.echo(
                    f"key MLP layer {name}: {100 * rel['median']:.0f}% of depth "
                    f"(IQR {100 * rel['q25']:.0f}-{100 * rel['q75']:.0f}%)"
                )
    click.echo(
        "median key layer: "
        + ", ".join(f"{label(m)} {v:.1f}" for m, v in result["key_layer_median"].items() if v is not None)
    )
    for f in (*out.tables, *out.figures):
        click.echo(f"wrote {f}")


COMMANDS = [lens, corpus_lens, agree]
__all__ = ["COMMANDS", "agree", "corpus_lens", "lens"]
