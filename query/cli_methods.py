"""Commands comparing interpretability methods (``lens``, ``agree``) and their figures.

Figures (matplotlib, Agg): ROME-style causal-tracing heatmaps (position x layer, one panel per
component), the per-position-class average of those, lens curves per layer, and the methods'
mean per-layer profiles.  ``trace`` (in :mod:`ingest.cli_interventions`) draws its heatmaps with
the functions here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from actstore.cli import friendly, where_option

# ------------------------------------------------------------------------------------ figures

_CMAPS = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}
_TITLES = {"resid": "single restored layer (residual)", "mlp": "restored MLP (window)",
           "attn": "restored attention (window)"}
ROLE_ORDER = ("subject_first", "subject_middle", "subject_last", "first_after", "further_after", "last")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def trace_heatmap(result: Any, path: Path) -> Path:
    """One fact: P(object) with the clean state restored, tokens (rows) x layers (columns), per component."""
    plt = _plt()
    f = result.fact
    comps = list(result.restored)
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 0.32 * f.n_tokens + 1.6), squeeze=False)
    labels = [t + ("*" if f.subject_span[0] <= i < f.subject_span[1] else "") for i, t in enumerate(f.tokens)]
    for ax, c in zip(axes[0], comps):
        grid = result.restored[c].T  # [T, L]
        im = ax.imshow(grid, cmap=_CMAPS.get(c, "viridis"), aspect="auto", vmin=min(result.p_corrupt, grid.min()))
        ax.set_yticks(range(f.n_tokens))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(_TITLES.get(c, c), fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046).set_label(f"p({f.object!r})", fontsize=7)
    fig.suptitle(f"{f.subject} -> {f.object}: p_clean {result.p_clean:.3f}, p_corrupt {result.p_corrupt:.3f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def position_class(p: int, span: tuple[int, int], n: int) -> str | None:
    """ROME's averaging classes (Meng et al. 2022, Fig. 1e-g); None before the subject."""
    s0, s1 = span
    if p == n - 1:
        return "last"
    if s0 <= p < s1:
        return "subject_first" if p == s0 else ("subject_last" if p == s1 - 1 else "subject_middle")
    if p == s1:
        return "first_after"
    return "further_after" if p > s1 else None


def average_by_class(results: Sequence[Any], component: str) -> np.ndarray:
    """Mean indirect effect per ROME position class x layer: [len(ROLE_ORDER), L] (NaN: no such token)."""
    L = next(iter(results)).restored[component].shape[0]
    sums = np.zeros((len(ROLE_ORDER), L))
    counts = np.zeros(len(ROLE_ORDER))
    for r in results:
        f = r.fact
        ie = r.indirect_effect(component)
        per: dict[str, list[int]] = {}
        for p in range(f.n_tokens):
            c = position_class(p, f.subject_span, f.n_tokens)
            if c is not None:
                per.setdefault(c, []).append(p)
        for c, ps in per.items():
            k = ROLE_ORDER.index(c)
            sums[k] += ie[:, ps].mean(axis=1)
            counts[k] += 1
    with np.errstate(invalid="ignore"):
        return sums / counts[:, None]


def trace_average_heatmap(results: Sequence[Any], path: Path) -> Path:
    plt = _plt()
    comps = list(results[0].restored)
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 3.2), squeeze=False)
    for ax, c in zip(axes[0], comps):
        grid = average_by_class(results, c)
        im = ax.imshow(grid, cmap=_CMAPS.get(c, "viridis"), aspect="auto")
        ax.set_yticks(range(len(ROLE_ORDER)))
        ax.set_yticklabels([r.replace("_", " ") for r in ROLE_ORDER], fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(f"average indirect effect: {c}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"causal tracing, {len(results)} facts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lens_curves(summary: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    plt = _plt()
    x = [r["index"] for r in summary]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, style in (("logit", "-"), ("tuned", "--")):
        if f"{name}_prob" not in summary[0]:
            continue
        a1.plot(x, [r[f"{name}_prob"] for r in summary], style, label=f"{name} lens")
        a2.plot(x, [max(r[f"{name}_rank_median"], 0.5) for r in summary], style, label=f"{name} lens")
    a1.set_xlabel("residual index (0 = embeddings)")
    a1.set_ylabel("mean p(object)")
    a2.set_xlabel("residual index (0 = embeddings)")
    a2.set_ylabel("median object rank")
    a2.set_yscale("log")
    for a in (a1, a2):
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile_curves(readings: Sequence[Any], path: Path, title: str) -> Path:
    """Each method's mean per-layer profile, scaled to a maximum of 1."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in readings:
        m = np.nanmean(r.profile, axis=0)
        top = np.nanmax(np.abs(m)) if np.isfinite(m).any() else 0
        ax.plot(m / top if top else m, label=f"{r.method} (n={len(r.example_ids)})")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean profile / max")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ helpers


def _fact_ids(s: Any, where: str | None, correct_only: bool) -> np.ndarray:
    conds = ["t.object_token_id >= 0"] + (["t.object_rank = 0"] if correct_only else [])
    if where and where.strip():
        conds.append(f"e.example_id IN (SELECT example_id FROM examples JOIN targets USING (example_id) WHERE {where})")
    q = f"SELECT e.example_id FROM examples e JOIN targets t USING (example_id) WHERE {' AND '.join(conds)} ORDER BY 1"
    return np.asarray(s.sql(q).column("example_id").to_pylist(), dtype=np.int64)


def _write(s: Any, name: str, run_id: str, table: Any) -> str:
    from actstore.writer import write_result_table
    from query.cli_maps import with_run_id

    return write_result_table(s, name, run_id, with_run_id(table, run_id))


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None or not np.isfinite(x):
        return "   n/a"
    return f"{100 * x:5.1f}%" if pct else f"{x:+.2f}"


# ------------------------------------------------------------------------------------ lens


@click.command()
@click.option("--store", "store_path", required=True)
@where_option("SQL predicate over examples JOIN targets choosing the facts.")
@click.option("--correct-only", is_flag=True, help="Only facts the model answers correctly (object_rank = 0).")
@click.option("--train-fraction", type=float, default=0.5, show_default=True,
              help="Share of the facts that train the tuned lens; the rest are held out and evaluated.")
@click.option("--no-tuned", is_flag=True, help="Logit lens only, on every selected fact.")
@click.option("--tuned", "tuned_method", type=click.Choice(["adam", "sgd", "ridge"]), default="adam", show_default=True,
              help="Tuned-lens translators: trained on the KL to the model's output with Adam or Nesterov SGD "
                   "(Belrose et al., the tuned-lens package's settings), or the closed-form ridge fit (ours).")
@click.option("--tuned-steps", type=int, default=250, show_default=True, help="Training steps (adam, sgd).")
@click.option("--tuned-batch", type=int, default=2 ** 18, show_default=True,
              help="Training facts per step (adam, sgd); at least the number of training facts = full batch.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--figures", "fig_dir", default=None, help="Folder for the lens curves (PNG).")
@click.option("--no-write", is_flag=True, help="Do not write the result table into the store.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def lens(store_path: str, where: str | None, correct_only: bool, train_fraction: float, no_tuned: bool,
         tuned_method: str, tuned_steps: int, tuned_batch: int, seed: int, fig_dir: str | None, no_write: bool,
         as_json: bool) -> None:
    """Logit lens and tuned lens from the stored residual stream: object probability and rank per layer."""
    import actstore
    from query.cli_maps import new_run_id, write_run
    from query.lens import LensError, lens_study, split_facts
    from query.tuned_lens import TrainConfig

    started = time.time()
    config = TrainConfig(optimizer=tuned_method if tuned_method != "ridge" else "adam", steps=tuned_steps,
                         batch=tuned_batch, seed=seed, device="auto")
    if tuned_method != "ridge" and not no_tuned:
        config.check()
    s = actstore.open(store_path)
    ids = _fact_ids(s, where, correct_only)
    if ids.size == 0:
        raise LensError(f"{s.url}: no facts with an object" + (f" where {where}" if where else ""))
    if no_tuned:
        train, held = None, ids
    else:
        train, held = split_facts(ids, train_fraction, seed)
    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 25 == 0 or step == config.steps:
            click.echo(f"tuned lens ({tuned_method}): step {step}/{config.steps}, sum of per-index KL {loss:.4f}, "
                       f"{time.time() - started:.0f} s", err=True)

    study, tuned = lens_study(s, held, train, method=tuned_method, seed=seed, train_config=config,
                              progress=None if as_json else progress)
    summary = study.summary()
    final_match = float((study.logit.top[:, -1] == study.final_top).mean())
    method = None if no_tuned else tuned_method
    tuned_config: dict[str, Any] | None = None
    if method == "ridge":
        tuned_config = {"alphas": study.alphas}
    elif method is not None:
        tuned_config = config.describe()
    run_id = new_run_id("lens")
    written = []
    if not no_write:
        written.append(_write(s, "lens", run_id, study.table()))
        write_run(s, run_id, "lens", started, {"where": where, "correct_only": correct_only, "seed": seed,
                                                "train_fraction": None if no_tuned else train_fraction,
                                                "tuned": method, "tuned_config": tuned_config})
    figs = []
    if fig_dir:
        Path(fig_dir).mkdir(parents=True, exist_ok=True)
        figs.append(str(lens_curves(summary, Path(fig_dir) / "lens_curves.png",
                                    f"{s.manifest.model.get('name')}: {study.example_ids.size} held-out facts")))
    training: dict[str, Any] = {}
    if tuned is not None and method != "ridge":
        training = {k: tuned.info[k] for k in ("rows", "loss_first", "loss_last", "seconds", "train_kl_logit",
                                               "train_kl_tuned")}
    out = {"store": s.url, "run_id": run_id, "n_eval": int(study.example_ids.size), "n_train": int(study.train_ids.size),
           "final_index_matches_model": final_match, "tuned_method": method, "tuned_config": tuned_config,
           "tuned_training": training, "ridge_alphas": study.alphas, "per_index": summary,
           "tables": written, "figures": figs, "seconds": round(time.time() - started, 2)}
    if as_json:
        click.echo(json.dumps(out))
        return
    how = "" if method is None else f"; tuned lens: {method}" + (
        "" if method == "ridge" else f", {config.steps} steps, lr {config.learning_rate:g}")
    click.echo(f"{s.url}: lens on {study.example_ids.size} held-out facts "
               f"({study.train_ids.size} train the tuned lens{how}); final index = model output on "
               f"{100 * final_match:.1f}%")
    head = "index  logit p   tuned p   logit rank  tuned rank  logit top1  tuned top1  logit KL  tuned KL"
    click.echo(head)
    for r in summary:
        click.echo(f"{r['index']:>5}  {r['logit_prob']:7.4f}  {r.get('tuned_prob', float('nan')):8.4f}   "
                   f"{r['logit_rank_median']:9.0f}  {r.get('tuned_rank_median', float('nan')):10.0f}  "
                   f"{100 * r['logit_top1']:9.1f}%  {100 * r.get('tuned_top1', float('nan')):9.1f}%  "
                   f"{r['logit_kl']:8.3f}  {r.get('tuned_kl', float('nan')):8.3f}")
    for f in (*written, *figs):
        click.echo(f"wrote {f}")


# ------------------------------------------------------------------------------------ agree


@click.command()
@click.option("--store", "store_path", required=True)
@click.option("--trace-run", default=None, help="trace run id (default: the newest).")
@click.option("--patch-run", default=None, help="patch run id (default: the newest).")
@click.option("--methods", default=",".join(("trace", "patch", "probe", "attention", "logit_lens", "tuned_lens")),
              show_default=True, help="Methods to compare (comma-separated).")
@click.option("--tolerance", type=int, default=None, help="Key layers agree within this many layers (default L/10).")
@click.option("--plateau", type=float, default=0.9, show_default=True,
              help="Key layer = middle of the run of layers within this fraction of the peak (1 = argmax).")
@click.option("--probe-min-count", type=int, default=5, show_default=True,
              help="Objects with fewer facts in the store are not probe classes.")
@click.option("--probe-folds", type=int, default=3, show_default=True)
@click.option("--figures", "fig_dir", default=None, help="Folder for the profile curves (PNG).")
@click.option("--no-write", is_flag=True)
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def agree(store_path: str, trace_run: str | None, patch_run: str | None, methods: str, tolerance: int | None,
          plateau: float, probe_min_count: int, probe_folds: int, fig_dir: str | None, no_write: bool, quiet: bool,
          as_json: bool) -> None:
    """Key layers and MLP-vs-attention verdicts of each method per fact, and how far the methods agree."""
    import actstore
    from query.cli_maps import new_run_id, write_run
    from query.lens import TunedLens, stored_residuals
    from query.methods import (
        METHODS,
        MethodReading,
        MethodsError,
        ProbeConfig,
        agreement,
        agreement_table,
        attention_reading,
        causal_shares,
        default_tolerance,
        key_mlp_at_subject,
        lens_reading,
        patch_reading,
        probe_reading,
        stored_outputs,
        trace_reading,
    )

    def log(m: str) -> None:
        if not quiet:
            click.echo(m, err=True)

    started = time.time()
    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in wanted if m not in METHODS]
    if bad or len(wanted) < 2:
        raise MethodsError(f"--methods: {bad[0]!r} is not a method ({', '.join(METHODS)})" if bad else
                           "--methods: give at least two methods")
    if tolerance is not None and tolerance < 0:
        raise click.BadParameter("must be >= 0", param_hint="--tolerance")
    if not 0 < plateau <= 1:
        raise click.BadParameter("must be in (0, 1]", param_hint="--plateau")
    s = actstore.open(store_path)
    L = s.geometry.n_layers
    tol = default_tolerance(L) if tolerance is None else tolerance
    readings: dict[str, MethodReading] = {}
    if "trace" in wanted:
        readings["trace"] = trace_reading(s, trace_run, plateau)
    if "patch" in wanted:
        readings["patch"] = patch_reading(s, patch_run, plateau)
    if readings:
        ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    else:
        ids = _fact_ids(s, None, True)
    if ids.size == 0:
        raise MethodsError(f"{s.url}: no facts to compare")
    log(f"{ids.size} facts; reading the store")
    out = stored_outputs(s, ids)
    extra: dict[str, Any] = {"sublayers_additive": out.additive}
    if "logit_lens" in wanted:
        readings["logit_lens"] = lens_reading(s, out, plateau=plateau)
    if "tuned_lens" in wanted:
        train = np.setdiff1d(_fact_ids(s, None, False), ids)
        if train.size < 5:
            raise MethodsError(f"{s.url}: only {train.size} facts outside the compared ones to train the tuned lens "
                               "(ingest more facts, or drop tuned_lens from --methods)")
        log(f"tuned lens: fitting on {train.size} other facts")
        tl = TunedLens.fit_ridge(stored_residuals(s, train)[0])
        readings["tuned_lens"] = lens_reading(s, out, tl, plateau)
        extra["tuned_lens_train_facts"] = int(train.size)
    if "attention" in wanted:
        readings["attention"] = attention_reading(s, out, plateau)
    if "probe" in wanted:
        log("probes: cross-validated object probes on every residual index")
        readings["probe"], extra["probe"] = probe_reading(s, out, ProbeConfig(min_count=probe_min_count,
                                                                               folds=probe_folds), plateau)
    ordered = [readings[m] for m in wanted]
    result = agreement(ordered, tol)
    if "trace" in readings:
        result["causal_shares"] = causal_shares(readings["trace"], readings.get("patch"), L,
                                                key_mlp_at_subject(s, trace_run))
    result.update(extra)
    result["n_layers"] = L
    result["plateau"] = plateau
    result["model"] = s.manifest.model.get("name")
    result["verdict_mlp_share"] = {r.method: (float(np.mean(r.verdict[r.verdict != ""] == "mlp"))
                                              if (r.verdict != "").any() else None) for r in ordered}
    result["key_layer_median"] = {r.method: float(np.median(r.key_layer[r.key_layer >= 0]))
                                  if (r.key_layer >= 0).any() else None for r in ordered}
    result["n_facts"] = {r.method: int(len(r.example_ids)) for r in ordered}
    run_id = new_run_id("agree")
    written, figs = [], []
    if not no_write:
        import pyarrow as pa

        written.append(_write(s, "method_readings", run_id, pa.concat_tables([r.table() for r in ordered])))
        written.append(_write(s, "method_agreement", run_id, agreement_table(result)))
        write_run(s, run_id, "agree", started, {"trace_run": trace_run, "patch_run": patch_run, "methods": wanted,
                                                 "tolerance": tol, "plateau": plateau})
    if fig_dir:
        Path(fig_dir).mkdir(parents=True, exist_ok=True)
        figs.append(str(profile_curves(ordered, Path(fig_dir) / "method_profiles.png",
                                       f"{result['model']}: mean per-layer profiles")))
    result.update({"store": s.url, "run_id": run_id, "tables": written, "figures": figs,
                   "seconds": round(time.time() - started, 2)})
    if as_json:
        click.echo(json.dumps(result, default=float))
        return
    click.echo(f"{result['model']} (L={L}): key layers agree within {tol} layer(s)")
    click.echo(f"{'methods':<26} {'facts':>5} {'key layer':>9} {'exact':>6} {'MLP/attn':>8} {'profile r':>9}   paper")
    for p in result["pairs"]:
        paper = "" if p["paper_key_layer"] is None else \
            f"{100 * p['paper_key_layer']:.1f}% / {100 * p['paper_verdict']:.1f}% / {p['paper_correlation']:.2f}"
        r = p["profile_correlation"]
        click.echo(f"{p['method_a'] + ' vs ' + p['method_b']:<26} {p['n_facts']:>5} {_fmt(p['key_layer_agreement']):>9} "
                   f"{_fmt(p['key_layer_exact']):>6} {_fmt(p['verdict_agreement']):>8} "
                   f"{'n/a' if r is None else f'{r:+.2f}':>9}   {paper}")
    click.echo(f"{'all methods agree':<26} {result['consensus_facts']:>5} {_fmt(result['consensus']):>9}"
               f"{'':>27}   {SEED_CONSENSUS_TEXT}")
    cs = result.get("causal_shares")
    if cs:
        click.echo(f"MLP share of the causal effect: tracing {_fmt(cs['trace_mlp_share'])}, "
                   f"patching {_fmt(cs.get('patch_mlp_share'))}")
        for name, key in (("at the subject's last token", "key_mlp_layer_relative_subject_last"),
                          ("at any position", "key_mlp_layer_relative")):
            rel = cs.get(key)
            if rel:
                click.echo(f"key MLP layer {name}: {100 * rel['median']:.0f}% of depth "
                           f"(IQR {100 * rel['q25']:.0f}-{100 * rel['q75']:.0f}%)")
    click.echo("median key layer: " + ", ".join(f"{m} {v:.1f}" for m, v in result["key_layer_median"].items()
                                                if v is not None))
    for f in (*written, *figs):
        click.echo(f"wrote {f}")


SEED_CONSENSUS_TEXT = "47.6%"

__all__ = ["agree", "lens", "trace_heatmap", "trace_average_heatmap", "lens_curves", "profile_curves"]
