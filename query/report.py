"""A self-contained HTML report of a store and every analysis result it holds.

    html = build_report(actstore.open("/tmp/s"))          # one string, no external assets
    write_report(store, "report.html")

The report discovers result tables by name (``tables/<name>/<run_id>.parquet``) and renders a
section only when its tables exist; a table that lacks a column a figure needs gets a note
instead of the figure, so results written by older or newer code never break the report.
Figures are matplotlib (Agg) PNGs embedded as base64 ``data:`` URIs.  Every section has a
stable element id (:data:`SECTION_IDS`) so tests and links can find it.

Sections (table names in brackets):

* ``section-summary``     model, geometry, corpus per relation, sizes, runs (always)
* ``section-probes``      probe accuracy per run and per relation [probe_runs, relation_metrics]
* ``section-headscore``   mean HeadScore heatmap (layer x head) per relation [head_scores]
* ``section-tokenscore``  TokenScore over the prompt's tokens, errors and correct predictions [token_scores]
* ``section-predictors``  F1 against each predictor, with correlations [relation_predictors, correlations]
* ``section-shortcuts``   lexical shortcut figures of probe errors [shortcut_summary, shortcut_errors]
* ``section-maps``        static MAPS score heatmaps per relation [maps_scores, maps_relations, maps_salient]
* ``section-maps-dynamic`` static vs dynamic MAPS scores [maps_dynamic, maps_correlation]
* ``section-maps-ablation`` accuracy with a relation's heads removed [maps_ablation]
* ``section-tracing``     causal tracing heatmaps (ROME position classes x layer) [trace_effects, trace_facts]
* ``section-patching``    activation patching recovery per layer and per head [patch_effects]
* ``section-lens``        logit / tuned lens curves per layer [lens]
* ``section-agreement``   method agreement table [method_agreement]
* ``section-tables``      any other result table: name, rows, columns and a preview
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.store import Store
from actstore.tables import SEGMENT_TABLES

SECTION_IDS: dict[str, str] = {
    "summary": "section-summary",
    "probes": "section-probes",
    "headscore": "section-headscore",
    "tokenscore": "section-tokenscore",
    "predictors": "section-predictors",
    "shortcuts": "section-shortcuts",
    "maps": "section-maps",
    "maps_dynamic": "section-maps-dynamic",
    "maps_ablation": "section-maps-ablation",
    "tracing": "section-tracing",
    "patching": "section-patching",
    "lens": "section-lens",
    "agreement": "section-agreement",
    "tables": "section-tables",
}

# Result tables each section reads (the first one must exist for the section to appear).
SECTION_TABLES: dict[str, tuple[str, ...]] = {
    "probes": ("probe_runs", "relation_metrics", "probe_episodes", "probe_predictions"),
    "headscore": ("head_scores",),
    "tokenscore": ("token_scores",),
    "predictors": ("relation_predictors", "correlations"),
    "shortcuts": ("shortcut_summary", "shortcut_errors"),
    "maps": ("maps_scores", "maps_relations", "maps_salient"),
    "maps_dynamic": ("maps_dynamic", "maps_correlation"),
    "maps_ablation": ("maps_ablation",),
    "tracing": ("trace_effects", "trace_facts"),
    "patching": ("patch_effects", "patch_pairs"),
    "lens": ("lens",),
    "agreement": ("method_agreement", "method_readings"),
}

TRACE_CLASSES = ("subject_first", "subject_middle", "subject_last", "first_after", "further_after", "last")


@dataclass(frozen=True)
class ReportOptions:
    """How much the report shows (every limit keeps the file small on big stores)."""

    max_runs: int = 3  # most recent runs shown per analysis
    max_relations: int = 24  # heatmaps per run
    token_errors: int = 6  # TokenScore examples: errors ...
    token_correct: int = 4  # ... and correct predictions
    preview_rows: int = 5  # rows shown for tables without a dedicated section
    dpi: int = 80


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    body: str

    @property
    def id(self) -> str:
        return SECTION_IDS.get(self.key, f"section-{self.key.replace('_', '-')}")


@dataclass
class _Ctx:
    store: Store
    opts: ReportOptions
    files: dict[str, list[str]]
    con: Any
    run_started: dict[str, float] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def has(self, name: str) -> bool:
        return bool(self.files.get(name))

    def sql(self, query: str) -> pa.Table:
        from actstore.sql import run_sql

        return run_sql(self.store, query, self.con)

    def table(self, name: str) -> pa.Table | None:
        """A whole result table (None when absent); marks it as shown."""
        if not self.has(name):
            return None
        self.used.add(name)
        return self.store.table(name, files=self.files[name])

    def latest_runs(self, t: pa.Table) -> list[str]:
        """The table's run ids, newest first, at most ``max_runs``."""
        if "run_id" not in t.column_names:
            return [""]
        runs = sorted({str(r) for r in t.column("run_id").to_pylist()},
                      key=lambda r: (self.run_started.get(r, 0.0), r), reverse=True)
        return runs[: self.opts.max_runs]


# ----------------------------------------------------------------------------------- html helpers
def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def fmt(v: object, digits: int = 3) -> str:
    """A cell value: floats rounded, NaN/None as a dash, lists shortened."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float | np.floating):
        f = float(v)
        if not math.isfinite(f):
            return "–"
        if f != 0 and (abs(f) >= 1e7 or abs(f) < 10 ** -digits):
            return f"{f:.{digits}g}"
        if abs(f) >= 100:
            return f"{f:,.0f}" if f == int(f) or abs(f) >= 1e4 else f"{f:.1f}"
        return f"{f:.{digits}f}"
    if isinstance(v, list | tuple):
        s = ", ".join(fmt(x, digits) for x in v[:8])
        return f"[{s}{', …' if len(v) > 8 else ''}]"
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "…"


def html_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, *,
               headers: dict[str, str] | None = None, cls: str = "data") -> str:
    if not rows:
        return '<p class="note">(no rows)</p>'
    cols = list(columns) if columns is not None else list(rows[0])
    head = "".join(f"<th>{esc((headers or {}).get(c, c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{esc(fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_html(fig: Any, alt: str, dpi: int = 80) -> str:
    """Close ``fig`` and return an ``<img>`` holding it as a base64 PNG."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<figure><img alt="{esc(alt)}" src="data:image/png;base64,{data}"><figcaption>{esc(alt)}</figcaption></figure>'


def heatmap(grid: np.ndarray, *, rows: Sequence[object], cols: Sequence[object], title: str, ylabel: str = "layer",
            xlabel: str = "head", cmap: str = "RdBu_r", symmetric: bool = True, vmin: float | None = None,
            vmax: float | None = None, threshold: float | None = None, dpi: int = 80) -> str:
    """A [rows, cols] heatmap as an ``<img>`` (rows bottom-up, like layers)."""
    plt = _plt()
    g = np.asarray(grid, dtype=np.float64)
    finite = g[np.isfinite(g)]
    if symmetric:
        lim = float(np.abs(finite).max()) if finite.size else 1.0
        vmin, vmax = -(lim or 1.0), lim or 1.0
    fig, ax = plt.subplots(figsize=(min(9.0, 1.8 + 0.32 * len(cols)), min(7.0, 1.4 + 0.16 * len(rows))))
    im = ax.imshow(g, aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    if threshold is not None:
        ys, xs = np.nonzero(g >= threshold)
        for y, x in zip(ys, xs):
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=0.8))
    int_ticks(ax, "x", cols)
    int_ticks(ax, "y", rows)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    return figure_html(fig, title, dpi)


def int_ticks(ax: Any, axis: str, labels: Sequence[object], fontsize: int = 7) -> None:
    """Tick at every cell (at most ~16 ticks) of an ``imshow`` axis, labelled with ``labels``."""
    step = max(1, len(labels) // 16)
    pos = list(range(0, len(labels), step))
    names = [str(labels[i]) for i in pos]
    if axis == "x":
        ax.set_xticks(pos, names, fontsize=fontsize)
    else:
        ax.set_yticks(pos, names, fontsize=fontsize)


def _grid(t: pa.Table, value: str, row: str = "layer", col: str = "head") -> tuple[np.ndarray, list[Any], list[Any]]:
    """Mean of ``value`` per (row, col) cell of a long table."""
    r = np.asarray(t.column(row).to_pylist())
    c = np.asarray(t.column(col).to_pylist())
    v = np.asarray([np.nan if x is None else float(x) for x in t.column(value).to_pylist()], dtype=np.float64)
    rows, ri = np.unique(r, return_inverse=True)
    cols, ci = np.unique(c, return_inverse=True)
    s = np.zeros((rows.size, cols.size))
    n = np.zeros_like(s)
    ok = np.isfinite(v)
    np.add.at(s, (ri[ok], ci[ok]), v[ok])
    np.add.at(n, (ri[ok], ci[ok]), 1)
    with np.errstate(invalid="ignore"):
        return s / n, rows.tolist(), cols.tolist()


def _missing(t: pa.Table, *cols: str) -> list[str]:
    return [c for c in cols if c not in t.column_names]


def _filter(t: pa.Table, column: str, value: object) -> pa.Table:
    if column not in t.column_names:
        return t
    import pyarrow.compute as pc

    return t.filter(pc.equal(t.column(column), pa.scalar(value, t.schema.field(column).type)))


def _rows(t: pa.Table, columns: Sequence[str]) -> list[dict[str, Any]]:
    return t.select([c for c in columns if c in t.column_names]).to_pylist()


def _run_label(run: str) -> str:
    return f"run {run}" if run else "all runs"


# ----------------------------------------------------------------------------------- sections
def summary_section(ctx: _Ctx) -> Section:
    s = ctx.store
    m, g = s.manifest, s.geometry
    model = m.model
    info = [
        {"": "store", "value": s.url},
        {"": "format", "value": f"actstore v{m.format_version}"},
        {"": "model", "value": f"{model.get('name')} ({model.get('architecture', '?')})"},
        {"": "weights sha256", "value": str(model.get("weight_hash", ""))[:16]},
        {"": "geometry", "value": f"L={g.n_layers} H={g.n_heads} H_kv={g.n_kv_heads} d_head={g.d_head} "
                                  f"d_model={g.d_model} d_mlp={g.d_mlp} vocab={g.vocab_size}"},
        {"": "rows", "value": f"{s.n_rows} of {m.n_examples} examples in {len(s.commits)}/{m.n_segments} segments"
                              + ("" if s.complete else " (INCOMPLETE)")},
        {"": "storage dtype", "value": m.storage_dtype},
        {"": "size on disk", "value": _human(store_bytes(s))},
    ]
    parts = ['<h3>Store</h3>', html_table(info, ["", "value"], cls="kv")]
    has_targets = True
    try:
        rel = ctx.sql("SELECT e.relation_id, any_value(e.relation_name) AS relation_name, "
                      "any_value(e.source) AS source, count(*) AS prompts, "
                      "avg(CASE WHEN t.object_rank = 0 THEN 1.0 ELSE 0.0 END) AS model_top1, "
                      "avg(e.n_tokens) AS mean_tokens "
                      "FROM examples e LEFT JOIN targets t USING (example_id) GROUP BY 1 ORDER BY 1").to_pylist()
    except Exception:  # older stores without object_rank
        has_targets = False
        rel = ctx.sql("SELECT relation_id, any_value(relation_name) AS relation_name, count(*) AS prompts "
                      "FROM examples GROUP BY 1 ORDER BY 1").to_pylist()
    cols = ["relation_id", "relation_name", "source", "prompts", "mean_tokens"] + (["model_top1"] if has_targets else [])
    parts += [f"<h3>Corpus: {len(rel)} relations, {sum(int(r['prompts']) for r in rel)} prompts</h3>",
              html_table(rel, cols, headers={"model_top1": "model top-1 = object"})]
    tables = []
    for name, files in sorted(ctx.files.items()):
        try:
            n = int(ctx.sql(f'SELECT count(*) AS n FROM "{name}"').column("n")[0].as_py()) if files else 0
        except Exception:
            n = -1
        tables.append({"table": name, "files": len(files), "rows": n if n >= 0 else None,
                       "kind": "corpus" if name in SEGMENT_TABLES or name == "heads" else
                       "run log" if name == "runs" else "result"})
    parts += ["<h3>Tables</h3>", html_table(tables, ["table", "kind", "files", "rows"])]
    if ctx.has("runs"):
        runs = ctx.sql('SELECT * FROM "runs"')
        rows = []
        for r in runs.to_pylist():
            started, finished = r.get("started"), r.get("finished")
            rows.append({"run_id": r.get("run_id"), "kind": r.get("kind"),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
                         if isinstance(started, int | float) else started,
                         "seconds": float(finished) - float(started)
                         if isinstance(started, int | float) and isinstance(finished, int | float) else None})
        rows.sort(key=lambda r: str(r["started"]))
        parts += [f"<h3>Runs ({len(rows)})</h3>", html_table(rows[-30:], ["run_id", "kind", "started", "seconds"])]
    return Section("summary", "Store summary", "\n".join(parts))


def probes_section(ctx: _Ctx) -> Section | None:
    runs = ctx.table("probe_runs")
    if runs is None:
        return None
    parts = []
    rows = sorted(runs.to_pylist(), key=lambda r: (ctx.run_started.get(str(r.get("run_id")), 0.0), str(r.get("run_id"))))
    for r in rows:
        if "accuracy" in r and r.get("ci95_low") is not None and r.get("ci95_high") is not None:
            r["accuracy ± 95% CI"] = (f"{100 * float(r['accuracy']):.2f}% "
                                      f"({100 * float(r['ci95_low']):.2f}–{100 * float(r['ci95_high']):.2f})")
        r["setting"] = f"{r.get('n_way', '?')}-way {r.get('k_shot', '?')}-shot"
    parts.append(html_table(rows, [c for c in ("run_id", "kind", "setting", "episodes", "relations", "rows",
                                               "mean_selected_features", "relspec", "contrast", "accuracy ± 95% CI",
                                               "seconds")
                                   if c in rows[0] or c in ("setting", "accuracy ± 95% CI")],
                            headers={"mean_selected_features": "features / episode"}))
    if rows and "accuracy" in rows[0]:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(min(10.0, 2.5 + 0.9 * len(rows)), 3.2))
        acc = [100 * float(r["accuracy"]) for r in rows]
        err = [[100 * (float(r["accuracy"]) - float(r.get("ci95_low") or r["accuracy"])) for r in rows],
               [100 * (float(r.get("ci95_high") or r["accuracy"]) - float(r["accuracy"])) for r in rows]]
        labels = [f"{r.get('kind', '?')}\n{r['setting']}" for r in rows]
        ax.bar(range(len(rows)), acc, yerr=err, capsize=3, color="#4c72b0")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 100)
        ax.set_title("probe accuracy per run (95% interval)", fontsize=9)
        fig.tight_layout()
        parts.append(figure_html(fig, "probe accuracy per run", ctx.opts.dpi))
    metrics = ctx.table("relation_metrics")
    if metrics is not None:
        for run in ctx.latest_runs(metrics):
            sub = _filter(metrics, "run_id", run) if run else metrics
            cols = [c for c in ("relation_id", "relation_name", "n_queries", "n_predicted", "precision", "recall",
                                "f1") if c in sub.column_names]
            recs = _rows(sub, cols)
            drawn = [r for r in recs if r.get("n_queries") or r.get("n_predicted")]
            parts.append(f"<h3>Per relation, {esc(_run_label(run))}</h3>")
            parts.append(html_table(drawn, cols))
            if len(drawn) < len(recs):
                parts.append(note(f"{len(recs) - len(drawn)} relations were never drawn as queries in this run's "
                                  "episodes (too few episodes): not shown"))
    ctx.used.update({"probe_episodes", "probe_predictions"})
    return Section("probes", "Probes: episodic relation classification", "\n".join(parts))


def headscore_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("head_scores")
    if t is None:
        return None
    miss = _missing(t, "layer", "head", "score")
    if miss:
        return Section("headscore", "HeadScore", note(f"head_scores lacks columns {miss}"))
    kinds = _run_kinds(ctx)
    parts = [note("Mean HeadScore of the predictions of each gold relation: sum over the features of head (l, h) "
                  "of dW_m x'_m, with dW = W_pred - sum of the renormalised competitors' weights. Red: the head "
                  "pushes towards the predicted relation. Column -1 = a whole layer (per-layer feature kinds).")]
    for run in ctx.latest_runs(t):
        sub = _filter(t, "run_id", run) if run else t
        parts.append(f"<h3>{esc(_run_label(run))}{esc(' (' + kinds[run] + ')' if run in kinds else '')}</h3>")
        grid, layers, heads = _grid(sub, "score")
        imgs = [heatmap(grid, rows=layers, cols=heads, title="HeadScore, all relations", dpi=ctx.opts.dpi)]
        if "relation_id" in sub.column_names:
            rels = sorted({str(r) for r in sub.column("relation_id").to_pylist()})
            for rel in rels[: ctx.opts.max_relations]:
                g, ls, hs = _grid(_filter(sub, "relation_id", rel), "score")
                imgs.append(heatmap(g, rows=ls, cols=hs, title=f"HeadScore {rel}", dpi=ctx.opts.dpi))
            if len(rels) > ctx.opts.max_relations:
                imgs.append(note(f"{len(rels) - ctx.opts.max_relations} more relations not shown"))
        parts.append('<div class="grid">' + "".join(imgs) + "</div>")
    return Section("headscore", "HeadScore per relation (layer × head)", "\n".join(parts))


def _run_kinds(ctx: _Ctx) -> dict[str, str]:
    if not ctx.has("probe_runs"):
        return {}
    try:
        return {str(r["run_id"]): f"{r['kind']}, {r['n_way']}-way {r['k_shot']}-shot"
                for r in ctx.sql('SELECT run_id, kind, n_way, k_shot FROM "probe_runs"').to_pylist()}
    except Exception:
        return {}


def token_colour(v: float, lim: float) -> str:
    """Red for positive, blue for negative scores, opacity by |v| / lim."""
    a = 0.0 if lim <= 0 or not math.isfinite(v) else min(1.0, abs(v) / lim)
    rgb = "214, 39, 40" if v > 0 else "31, 119, 180"
    return f"rgba({rgb}, {0.85 * a:.3f})"


def tokenscore_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("token_scores")
    if t is None:
        return None
    miss = _missing(t, "example_id", "scores")
    if miss:
        return Section("tokenscore", "TokenScore", note(f"token_scores lacks columns {miss}"))
    parts = [note("TokenScore of each prompt token (summed over the probed layers): the contribution of that source "
                  "token's attention-head outputs to the predicted relation's logit contrast. Red pushes towards the "
                  "prediction, blue away from it; hover a token for its value. The centering term makes token "
                  "scores plus centering add up to the prediction's total HeadScore."),
             '<p class="legend">colour scale: <span class="tok" style="background:rgba(31, 119, 180, 0.85)">'
             'negative</span> <span class="tok">0</span> <span class="tok" style="background:rgba(214, 39, 40, 0.85)">'
             'positive</span></p>']
    for run in ctx.latest_runs(t)[:1]:
        sub = _filter(t, "run_id", run) if run else t
        recs = sub.to_pylist()
        has_pred = "relation_id" in sub.column_names and "predicted" in sub.column_names
        errors = [r for r in recs if has_pred and r["relation_id"] != r["predicted"]]
        correct = [r for r in recs if has_pred and r["relation_id"] == r["predicted"]]
        if not has_pred:
            correct = recs
        picked = _spread(errors, ctx.opts.token_errors) + _spread(correct, ctx.opts.token_correct)
        if not picked:
            continue
        ids = sorted({int(r["example_id"]) for r in picked})
        toks = _prompt_tokens(ctx, ids)
        probs = _prediction_probs(ctx, run, picked)
        parts.append(f"<h3>{esc(_run_label(run))}: {len(errors)} errors and {len(correct)} correct predictions "
                     f"with token scores; showing {len(picked)}</h3>")
        for r in picked:
            scores = [float(x) for x in (r["scores"] or [])]
            words = toks.get(int(r["example_id"]), [])
            lim = max((abs(x) for x in scores), default=0.0)
            spans = []
            for j, s in enumerate(scores):
                w = words[j] if j < len(words) else f"<{j}>"
                spans.append(f'<span class="tok" style="background:{token_colour(s, lim)}" '
                             f'title="{esc(f"{s:+.4f}")}">{esc(w)}</span>')
            ok = has_pred and r["relation_id"] == r["predicted"]
            label = "correct" if ok else "error" if has_pred else ""
            head = (f'<span class="badge {label}">{label}</span> example {r["example_id"]}'
                    + (f': gold <b>{esc(r["relation_id"])}</b>, predicted <b>{esc(r["predicted"])}</b>' if has_pred else "")
                    + (f" (p={probs[_key(r)]:.3f})" if _key(r) in probs else "")
                    + (f', centering {float(r["centering"]):+.3f}' if r.get("centering") is not None else "")
                    + (f', total HeadScore {float(r["head_score_total"]):+.3f}' if r.get("head_score_total") is not None
                       else ""))
            parts.append(f'<div class="tokex"><div class="meta">{head}</div><div class="prompt">{"".join(spans)}</div></div>')
    return Section("tokenscore", "TokenScore over the prompt", "\n".join(parts))


def _key(r: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (r.get("seed"), r.get("episode"), r.get("example_id"))


def _spread(items: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` items spread over the list (different relations and episodes, deterministic)."""
    if n <= 0 or not items:
        return []
    by_rel: dict[str, list[dict[str, Any]]] = {}
    for r in items:
        by_rel.setdefault(str(r.get("relation_id")), []).append(r)
    out: list[dict[str, Any]] = []
    queues = [list(v) for _, v in sorted(by_rel.items())]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def _prompt_tokens(ctx: _Ctx, ids: list[int]) -> dict[int, list[str]]:
    """Each prompt's tokens as they appear in its text (character spans when stored)."""
    if not ids:
        return {}
    idl = ", ".join(str(i) for i in ids)
    try:
        rows = ctx.sql("SELECT t.example_id, list(t.token ORDER BY t.position) AS toks, "
                       "list(t.char_start ORDER BY t.position) AS cs, list(t.char_end ORDER BY t.position) AS ce, "
                       f"any_value(e.text) AS text FROM tokens t JOIN examples e USING (example_id) "
                       f"WHERE t.example_id IN ({idl}) GROUP BY 1").to_pylist()
    except Exception:
        rows = ctx.sql(f"SELECT example_id, list(token ORDER BY position) AS toks FROM tokens "
                       f"WHERE example_id IN ({idl}) GROUP BY 1").to_pylist()
    out: dict[int, list[str]] = {}
    for r in rows:
        text = r.get("text")
        words = []
        for j, tok in enumerate(r["toks"]):
            cs, ce = (r.get("cs") or [None] * (j + 1))[j], (r.get("ce") or [None] * (j + 1))[j]
            if text is not None and cs is not None and ce is not None and 0 <= cs < ce <= len(text):
                words.append(text[cs:ce])
            else:
                words.append(str(tok or "").replace("Ġ", " ").replace("▁", " "))
        out[int(r["example_id"])] = words
    return out


def _prediction_probs(ctx: _Ctx, run: str, picked: list[dict[str, Any]]) -> dict[tuple[Any, Any, Any], float]:
    if not ctx.has("probe_predictions") or not run or not picked:
        return {}
    ids = ", ".join(str(int(r["example_id"])) for r in picked)
    try:
        rows = ctx.sql(f"SELECT seed, episode, example_id, prob FROM \"probe_predictions\" WHERE run_id = "
                       f"'{run.replace(chr(39), chr(39) * 2)}' AND example_id IN ({ids})").to_pylist()
    except Exception:
        return {}
    return {(r["seed"], r["episode"], r["example_id"]): float(r["prob"]) for r in rows}


def predictors_section(ctx: _Ctx) -> Section | None:
    rel = ctx.table("relation_predictors")
    corr = ctx.table("correlations")
    if rel is None and corr is None:
        return None
    parts = []
    plt = _plt()
    runs = ctx.latest_runs(rel if rel is not None else corr)  # type: ignore[arg-type]
    for run in runs[:1]:
        c_sub = (_filter(corr, "run_id", run) if run else corr) if corr is not None else None
        r_sub = (_filter(rel, "run_id", run) if run else rel) if rel is not None else None
        parts.append(f"<h3>{esc(_run_label(run))}</h3>")
        if c_sub is not None:
            parts.append(html_table(_rows(c_sub, ["predictor", "n", "spearman_rho", "spearman_p", "pearson_r",
                                                  "pearson_p", "coverage"])))
        if r_sub is None or "f1" not in r_sub.column_names:
            continue
        recs = r_sub.to_pylist()
        predictors = [str(x["predictor"]) for x in c_sub.to_pylist()] if c_sub is not None and \
            "predictor" in c_sub.column_names else [c for c in r_sub.column_names if c in (
                "output_range", "output_range_ratio", "connectivity", "tfidf_similarity", "head_concentration")]
        stats = {str(x.get("predictor")): x for x in (c_sub.to_pylist() if c_sub is not None else [])}
        imgs = []
        for p in predictors:
            if p not in r_sub.column_names:
                continue
            xs = np.asarray([np.nan if r[p] is None else float(r[p]) for r in recs])
            ys = np.asarray([np.nan if r["f1"] is None else float(r["f1"]) for r in recs])
            if not np.isfinite(xs).any():
                continue
            fig, ax = plt.subplots(figsize=(4.2, 3.4))
            ax.scatter(xs, ys, s=18, color="#dd8452")
            for r, x, y in zip(recs, xs, ys):
                if np.isfinite(x) and np.isfinite(y):
                    ax.annotate(str(r.get("relation_id")), (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
            st = stats.get(p, {})
            rho, pv = st.get("spearman_rho"), st.get("spearman_p")
            ax.set_xlabel(p, fontsize=8)
            ax.set_ylabel("probe F1", fontsize=8)
            ax.set_title(f"{p}: Spearman {fmt(rho, 2)} (p={fmt(pv, 2)})", fontsize=8)
            fig.tight_layout()
            imgs.append(figure_html(fig, f"F1 vs {p}", ctx.opts.dpi))
        parts.append('<div class="grid">' + "".join(imgs) + "</div>")
        parts.append(html_table(_rows(r_sub, ["relation_id", "relation_name", "f1", "n_instances", "output_range",
                                              "connectivity", "connectivity_coverage", "tfidf_similarity",
                                              "head_concentration"])))
    return Section("predictors", "Predictors of per-relation probe accuracy", "\n".join(parts))


def shortcuts_section(ctx: _Ctx) -> Section | None:
    summ = ctx.table("shortcut_summary")
    errs = ctx.table("shortcut_errors")
    if summ is None and errs is None:
        return None
    parts = []
    if summ is not None:
        parts.append(html_table(_rows(summ, ["run_id", "n_errors", "n_cues", "spearman_rho", "mass", "mass_baseline",
                                             "strong_align"]),
                                headers={"strong_align": "StrongAlign-x", "spearman_rho": "Spearman rho"}))
    if errs is not None and not _missing(errs, "rho", "mass"):
        run = ctx.latest_runs(errs)[0]
        sub = _filter(errs, "run_id", run) if run else errs
        rho = np.asarray([x for x in sub.column("rho").to_pylist() if x is not None and math.isfinite(x)])
        mass = np.asarray([x for x in sub.column("mass").to_pylist() if x is not None and math.isfinite(x)])
        plt = _plt()
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3))
        a1.hist(rho, bins=20, range=(-1, 1), color="#4c72b0")
        a1.set_title("Spearman rho (TokenScore vs lexical cue) per error", fontsize=8)
        a2.hist(mass, bins=20, range=(0, 1), color="#55a868")
        a2.set_title("TokenScore mass on lexical cues per error", fontsize=8)
        fig.tight_layout()
        parts.append(figure_html(fig, f"lexical shortcuts, {_run_label(run)}", ctx.opts.dpi))
    return Section("shortcuts", "Lexical shortcuts in probe errors", "\n".join(parts))


def maps_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("maps_scores")
    rel = ctx.table("maps_relations")
    if t is None and rel is None:
        return None
    parts = [note("Static MAPS: phi_R(h) = share of a relation's (source, target) pairs whose target is in the "
                  "top-k of the source's row of M = E W_VO U (weights only). Red outlines: heads implementing R "
                  "(phi >= threshold).")]
    if t is not None:
        miss = _missing(t, "relation", "layer", "head", "score")
        if miss:
            parts.append(note(f"maps_scores lacks columns {miss}"))
        else:
            run = ctx.latest_runs(t)[0]
            sub = _filter(t, "run_id", run) if run else t
            thr = 0.15
            if rel is not None and "threshold" in rel.column_names:
                thr = float(rel.column("threshold")[0].as_py())
            parts.append(f"<h3>{esc(_run_label(run))}</h3>")
            imgs = []
            for name in sorted({str(x) for x in sub.column("relation").to_pylist()})[: ctx.opts.max_relations]:
                one = _filter(sub, "relation", name)
                g, ls, hs = _grid(one, "score")
                k = one.column("k")[0].as_py() if "k" in one.column_names else "?"
                panels = [("score", g, "viridis")]
                if "suppression" in one.column_names:
                    panels.append(("suppression", _grid(one, "suppression")[0], "magma"))
                imgs.append(_maps_figure(name, k, panels, ls, hs, thr, ctx.opts.dpi))
            parts.append('<div class="grid">' + "".join(imgs) + "</div>")
    if rel is not None:
        run = ctx.latest_runs(rel)[0]
        sub = _filter(rel, "run_id", run) if run else rel
        parts.append(html_table(_rows(sub, ["relation", "n_pairs", "n_used", "n_multi_token", "n_unknown",
                                            "n_implementing", "n_suppressing", "max_score", "best_layer", "best_head"])))
    sal = ctx.table("maps_salient")
    if sal is not None and not _missing(sal, "layer", "head", "sigma"):
        run = ctx.latest_runs(sal)[0]
        sub = _filter(sal, "run_id", run) if run else sal
        recs = sorted(sub.to_pylist(), key=lambda r: -float(r["sigma"] or 0))[:12]
        parts.append("<h3>Most salient operations (largest sigma_t = |e_t W_VO| / |e_t|)</h3>")
        parts.append(html_table(recs, [c for c in ("layer", "head", "token", "sigma", "mapped_tokens") if c in sub.column_names]))
    return Section("maps", "MAPS: head functions from the weights", "\n".join(parts))


def _maps_figure(name: str, k: object, panels: list[tuple[str, np.ndarray, str]], layers: list[Any],
                 heads: list[Any], threshold: float, dpi: int) -> str:
    """Relation and suppression scores side by side (layer x head, 0..1, heads >= threshold outlined)."""
    plt = _plt()
    w = min(5.5, 1.4 + 0.3 * len(heads))
    fig, axes = plt.subplots(1, len(panels), figsize=(w * len(panels), min(6.5, 1.5 + 0.15 * len(layers))),
                             squeeze=False)
    for ax, (label, g, cmap) in zip(axes[0], panels):
        im = ax.imshow(g, aspect="auto", origin="lower", cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ys, xs = np.nonzero(g >= threshold)
        for y, x in zip(ys, xs):
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=0.8))
        int_ticks(ax, "x", heads)
        int_ticks(ax, "y", layers)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_title(f"{label} (k={k})", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(f"MAPS {name}", fontsize=9)
    fig.tight_layout()
    return figure_html(fig, f"MAPS {name}: relation and suppression scores", dpi)


def maps_dynamic_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("maps_dynamic")
    corr = ctx.table("maps_correlation")
    if t is None and corr is None:
        return None
    parts = []
    if corr is not None:
        run = ctx.latest_runs(corr)[0]
        sub = _filter(corr, "run_id", run) if run else corr
        parts.append(html_table(_rows(sub, ["relation", "n_prompts", "n_templates", "k", "corr_wo_context",
                                            "corr_w_context", "n_implementing_static", "n_implementing_wo_context",
                                            "n_implementing_w_context"]),
                                headers={"corr_wo_context": "r static vs dynamic (no context)",
                                         "corr_w_context": "r static vs dynamic (context)"}))
    if t is not None:
        value_cols = [c for c in ("static_score", "dyn_wo_context", "dyn_w_context") if c in t.column_names]
        if "relation" not in t.column_names or not value_cols or _missing(t, "layer", "head"):
            parts.append(note("maps_dynamic lacks the relation/layer/head/score columns"))
        else:
            run = ctx.latest_runs(t)[0]
            sub = _filter(t, "run_id", run) if run else t
            plt = _plt()
            for name in sorted({str(x) for x in sub.column("relation").to_pylist()})[: ctx.opts.max_relations]:
                one = _filter(sub, "relation", name)
                grids = [_grid(one, c) for c in value_cols]
                fig, axes = plt.subplots(1, len(value_cols) + 1, figsize=(3.4 * (len(value_cols) + 1), 3.0))
                for ax, c, (g, ls, hs) in zip(axes, value_cols, grids):
                    im = ax.imshow(g, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
                    int_ticks(ax, "x", hs)
                    int_ticks(ax, "y", ls)
                    ax.set_title(c.replace("_", " "), fontsize=8)
                    ax.set_xlabel("head", fontsize=7)
                    ax.set_ylabel("layer", fontsize=7)
                fig.colorbar(im, ax=axes[len(value_cols) - 1], fraction=0.05)
                ax = axes[-1]
                if "static_score" in value_cols:
                    st = grids[0][0].ravel()
                    for c, (g, _, _) in zip(value_cols[1:], grids[1:]):
                        ax.scatter(st, g.ravel(), s=6, alpha=0.6, label=c.replace("_", " "))
                    ax.set_xlabel("static score", fontsize=7)
                    ax.set_ylabel("dynamic score", fontsize=7)
                    ax.legend(fontsize=6)
                ax.set_title("per head", fontsize=8)
                fig.suptitle(f"MAPS static vs dynamic: {name}", fontsize=9)
                fig.tight_layout()
                parts.append(figure_html(fig, f"MAPS static vs dynamic, {name}", ctx.opts.dpi))
    return Section("maps_dynamic", "MAPS: static vs dynamic scores", "\n".join(parts))


def maps_ablation_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("maps_ablation")
    if t is None:
        return None
    parts = []
    miss = _missing(t, "condition", "accuracy")
    if not miss:
        recs = t.to_pylist()
        groups: dict[tuple[str, str], dict[str, list[float]]] = {}
        for r in recs:
            key = (str(r.get("relation", "")), str(r.get("evaluated", r.get("relation", ""))))
            groups.setdefault(key, {}).setdefault(str(r["condition"]), []).append(float(r["accuracy"]))
        conds = sorted({c for g in groups.values() for c in g})
        plt = _plt()
        fig, ax = plt.subplots(figsize=(min(10.0, 2.5 + 1.2 * len(groups)), 3.2))
        width = 0.8 / max(1, len(conds))
        for i, c in enumerate(conds):
            ax.bar([j + i * width for j in range(len(groups))],
                   [float(np.mean(g.get(c, [np.nan]))) for g in groups.values()], width, label=c)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))],
                      [f"{a}\non {b}" if a != b else a for a, b in groups], fontsize=7)
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=7)
        ax.set_title("accuracy with heads removed", fontsize=9)
        fig.tight_layout()
        parts.append(figure_html(fig, "MAPS head ablation", ctx.opts.dpi))
    parts.append(html_table(_rows(t, ["relation", "evaluated", "condition", "draw", "n_heads", "heads", "accuracy",
                                      "n_prompts", "mode"])[:40]))
    return Section("maps_ablation", "MAPS: head ablation", "\n".join(parts))


def trace_classes(t: pa.Table) -> np.ndarray:
    """ROME position class of every row of ``trace_effects`` (-1: before the subject)."""
    ex = np.asarray(t.column("example_id").to_pylist())
    pos = np.asarray(t.column("position").to_pylist())
    role = np.asarray([str(x) for x in t.column("role").to_pylist()]) if "role" in t.column_names else \
        np.full(ex.size, "")
    last: dict[int, int] = {}
    first_after: dict[int, int] = {}
    for e, p, r in zip(ex.tolist(), pos.tolist(), role.tolist()):
        last[e] = max(last.get(e, p), p)
        if r.startswith("subject"):
            first_after[e] = max(first_after.get(e, p + 1), p + 1)
    out = np.full(ex.size, -1)
    for i, (e, p, r) in enumerate(zip(ex.tolist(), pos.tolist(), role.tolist())):
        if p == last[e]:
            out[i] = TRACE_CLASSES.index("last")
        elif r in ("subject_first", "subject_middle", "subject_last"):
            out[i] = TRACE_CLASSES.index(r)
        elif e in first_after and p == first_after[e]:
            out[i] = TRACE_CLASSES.index("first_after")
        elif e in first_after and p > first_after[e]:
            out[i] = TRACE_CLASSES.index("further_after")
    return out


def tracing_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("trace_effects")
    facts = ctx.table("trace_facts")
    if t is None:
        return None
    value = "indirect_effect" if "indirect_effect" in t.column_names else "effect" if "effect" in t.column_names else None
    miss = _missing(t, "example_id", "layer", "position") + ([] if value else ["indirect_effect"])
    if miss:
        return Section("tracing", "Causal tracing", note(f"trace_effects lacks columns {miss}"))
    assert value is not None
    run = ctx.latest_runs(t)[0]
    sub = _filter(t, "run_id", run) if run else t
    comps = sorted({str(c) for c in sub.column("component").to_pylist()}) if "component" in sub.column_names else [""]
    order = {"resid": 0, "mlp": 1, "attn": 2}
    comps.sort(key=lambda c: order.get(c, 9))
    cmaps = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}
    n_facts = len(set(sub.column("example_id").to_pylist()))
    parts = [note("Causal tracing (ROME): Gaussian noise on the subject's embeddings, then the clean state of one "
                  "component restored at one layer (a window of layers for MLP and attention) and position. "
                  "Indirect effect = P(object | restored) − P(object | corrupted), averaged over facts per "
                  "position class."), f"<h3>{esc(_run_label(run))}: {n_facts} facts</h3>"]
    cls = trace_classes(sub)
    layer = np.asarray(sub.column("layer").to_pylist())
    vals = np.asarray([np.nan if v is None else float(v) for v in sub.column(value).to_pylist()])
    comp_col = np.asarray([str(c) for c in sub.column("component").to_pylist()]) if comps != [""] else \
        np.full(layer.size, "")
    plt = _plt()
    L = int(layer.max()) + 1 if layer.size else 0
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 3.0), squeeze=False)
    for ax, c in zip(axes[0], comps):
        grid = np.full((len(TRACE_CLASSES), L), np.nan)
        for k in range(len(TRACE_CLASSES)):
            for li in range(L):
                m = (comp_col == c) & (cls == k) & (layer == li) & np.isfinite(vals)
                if m.any():
                    grid[k, li] = vals[m].mean()
        im = ax.imshow(grid, aspect="auto", cmap=cmaps.get(c, "viridis"), interpolation="nearest")
        ax.set_yticks(range(len(TRACE_CLASSES)), [x.replace("_", " ") for x in TRACE_CLASSES], fontsize=7)
        int_ticks(ax, "x", list(range(L)))
        ax.set_xlabel("layer", fontsize=8)
        ax.set_title(f"mean indirect effect: {c or value}", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    parts.append(figure_html(fig, f"causal tracing, average over {n_facts} facts", ctx.opts.dpi))
    # One fact in full: tokens x layers per component.
    fact_info = {int(r["example_id"]): r for r in facts.to_pylist()} if facts is not None and \
        "example_id" in facts.column_names else {}
    ex_ids = sorted(set(sub.column("example_id").to_pylist()))[:2]
    for e in ex_ids:
        one = _filter(sub, "example_id", e)
        pos = np.asarray(one.column("position").to_pylist())
        T = int(pos.max()) + 1
        toks = [""] * T
        if "token" in one.column_names:
            for p, tok in zip(pos.tolist(), one.column("token").to_pylist()):
                toks[p] = str(tok)
        fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), min(9.0, 0.22 * T + 1.6)), squeeze=False)
        for ax, c in zip(axes[0], comps):
            part = _filter(one, "component", c) if c else one
            g, ls, ps = _grid(part, "prob" if "prob" in part.column_names else value, row="position", col="layer")
            im = ax.imshow(g, aspect="auto", cmap=cmaps.get(c, "viridis"), interpolation="nearest")
            ax.set_yticks(range(len(ls)), [toks[int(p)] for p in ls], fontsize=6 if len(ls) > 30 else 7)
            int_ticks(ax, "x", ps)
            ax.set_xlabel("layer", fontsize=8)
            ax.set_title(c or value, fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.05)
        f = fact_info.get(int(e), {})
        title = f"example {e}" + (f": {f.get('subject')} → {f.get('object')}, p_clean {fmt(f.get('p_clean'))}, "
                                  f"p_corrupt {fmt(f.get('p_corrupt'))}" if f else "")
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        parts.append(figure_html(fig, f"causal tracing, {title}", ctx.opts.dpi))
    if facts is not None:
        fsub = _filter(facts, "run_id", run) if run else facts
        parts.append(html_table(_rows(fsub, ["example_id", "relation_id", "subject", "object", "p_clean",
                                             "p_corrupt", "total_effect"])[:20]))
    return Section("tracing", "Causal tracing", "\n".join(parts))


def patching_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("patch_effects")
    if t is None:
        return None
    miss = _missing(t, "component", "layer", "recovery")
    if miss:
        return Section("patching", "Activation patching", note(f"patch_effects lacks columns {miss}"))
    run = ctx.latest_runs(t)[0]
    sub = _filter(t, "run_id", run) if run else t
    parts = [note("Activation patching: a clean activation patched into a counterfactual prompt; recovery of the "
                  "clean-minus-counterfactual logit difference (1 = fully recovered)."),
             f"<h3>{esc(_run_label(run))}</h3>"]
    plt = _plt()
    import pyarrow.compute as pc
    from matplotlib.ticker import MaxNLocator

    whole = sub.filter(pc.not_equal(sub.column("component"), "head"))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    comp = np.asarray([str(c) for c in whole.column("component").to_pylist()])
    pos = np.asarray([str(p) for p in whole.column("position").to_pylist()]) if "position" in whole.column_names \
        else np.full(comp.size, "")
    layer = np.asarray(whole.column("layer").to_pylist())
    rec = np.asarray([np.nan if v is None else float(v) for v in whole.column("recovery").to_pylist()])
    for c in sorted(set(comp.tolist())):
        for p in sorted(set(pos[comp == c].tolist())):
            m = (comp == c) & (pos == p)
            ls = sorted(set(layer[m].tolist()))
            ax.plot(ls, [np.nanmean(rec[m & (layer == li)]) for li in ls], marker=".", label=f"{c} @ {p}" if p else c)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("mean recovery")
    ax.legend(fontsize=7)
    ax.set_title("patching recovery per layer", fontsize=9)
    fig.tight_layout()
    parts.append(figure_html(fig, "activation patching per layer", ctx.opts.dpi))
    heads = _filter(sub, "component", "head")
    if heads.num_rows and "head" in heads.column_names:
        g, ls, hs = _grid(heads, "recovery")
        parts.append(heatmap(g, rows=ls, cols=hs, title="per-head patching recovery", dpi=ctx.opts.dpi))
    ctx.used.add("patch_pairs")
    return Section("patching", "Activation patching", "\n".join(parts))


def lens_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("lens")
    if t is None:
        return None
    xcol = "index" if "index" in t.column_names else "layer"
    miss = _missing(t, xcol)
    ycols = [c for c in ("object_prob", "object_rank") if c in t.column_names]
    if miss or not ycols:
        return Section("lens", "Logit and tuned lens", note("lens lacks a layer and an object_prob/object_rank column"))
    run = ctx.latest_runs(t)[0]
    sub = _filter(t, "run_id", run) if run else t
    lens = np.asarray([str(x) for x in sub.column("lens").to_pylist()]) if "lens" in sub.column_names else \
        np.full(sub.num_rows, "lens")
    x = np.asarray(sub.column(xcol).to_pylist())
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(ycols) + ("object_rank" in ycols), figsize=(4.2 * (len(ycols) + 1), 3.2),
                             squeeze=False)
    panels: list[tuple[str, Callable[[np.ndarray], float], str]] = []
    if "object_prob" in ycols:
        panels.append(("object_prob", lambda v: float(np.mean(v)), "mean p(object)"))
    if "object_rank" in ycols:
        panels.append(("object_rank", lambda v: float(np.mean(v == 0)), "top-1 share (object ranked first)"))
        panels.append(("object_rank", lambda v: max(float(np.median(v)), 0.5), "median object rank"))
    for ax, (col, agg, label) in zip(axes[0], panels):
        y = np.asarray([np.nan if v is None else float(v) for v in sub.column(col).to_pylist()])
        for name in sorted(set(lens.tolist())):
            xs = sorted(set(x[lens == name].tolist()))
            ax.plot(xs, [agg(y[(lens == name) & (x == xi)]) for xi in xs], marker=".", label=f"{name} lens")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("residual index (0 = embeddings)" if xcol == "index" else "layer", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        if label.startswith("median"):
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    n = len(set(sub.column("example_id").to_pylist())) if "example_id" in sub.column_names else sub.num_rows
    fig.suptitle(f"lens curves, {n} facts", fontsize=9)
    fig.tight_layout()
    parts = [note("Logit lens: the stored residual stream read through the final norm and unembedding. Tuned lens: "
                  "an affine translator per layer trained on stored residuals, evaluated on held-out facts."),
             f"<h3>{esc(_run_label(run))}</h3>", figure_html(fig, "logit and tuned lens per layer", ctx.opts.dpi)]
    return Section("lens", "Logit and tuned lens", "\n".join(parts))


def agreement_section(ctx: _Ctx) -> Section | None:
    t = ctx.table("method_agreement")
    if t is None:
        return None
    run = ctx.latest_runs(t)[0]
    sub = _filter(t, "run_id", run) if run else t
    ctx.used.add("method_readings")
    return Section("agreement", "Agreement between interpretability methods",
                   f"<h3>{esc(_run_label(run))}</h3>" + html_table(_rows(sub, [
                       "method_a", "method_b", "n_facts", "key_layer_agreement", "key_layer_exact", "n_verdict",
                       "verdict_agreement", "profile_correlation"])))


def other_tables_section(ctx: _Ctx) -> Section | None:
    skip = set(SEGMENT_TABLES) | {"heads", "runs"} | ctx.used
    rest = [n for n in sorted(ctx.files) if n not in skip and ctx.files[n]]
    if not rest:
        return None
    parts = []
    for name in rest:
        t = ctx.store.table(name, files=ctx.files[name])
        parts.append(f"<h3>{esc(name)}: {t.num_rows} rows, {len(ctx.files[name])} runs</h3>")
        parts.append(html_table(t.slice(0, ctx.opts.preview_rows).to_pylist(), t.column_names))
    return Section("tables", "Other result tables", "\n".join(parts))


SECTIONS: tuple[tuple[str, Callable[[_Ctx], Section | None]], ...] = (
    ("probes", probes_section),
    ("headscore", headscore_section),
    ("tokenscore", tokenscore_section),
    ("predictors", predictors_section),
    ("shortcuts", shortcuts_section),
    ("maps", maps_section),
    ("maps_dynamic", maps_dynamic_section),
    ("maps_ablation", maps_ablation_section),
    ("tracing", tracing_section),
    ("patching", patching_section),
    ("lens", lens_section),
    ("agreement", agreement_section),
)


# ----------------------------------------------------------------------------------- assembly
def store_bytes(store: Store) -> int:
    loc = store.location
    if loc.is_local:
        total = 0
        for root, _, files in os.walk(loc.root):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total
    try:
        return int(loc.fs.du(loc.root))
    except Exception:
        return 0


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def expected_sections(store: Store) -> list[str]:
    """Ids of the sections a report of ``store`` holds (tables present), in page order."""
    files = store.table_files()
    out = [SECTION_IDS["summary"]]
    for key, _ in SECTIONS:
        if any(files.get(t) for t in SECTION_TABLES[key]):
            out.append(SECTION_IDS[key])
    return out


def collect_sections(store: Store, options: ReportOptions | None = None,
                     log: Callable[[str], None] | None = None) -> list[Section]:
    """Every section for ``store``; a section whose rendering fails shows the error instead."""
    opts = options or ReportOptions()
    files = store.table_files()
    ctx = _Ctx(store, opts, files, store.connect())
    if files.get("runs"):
        try:
            ctx.run_started = {str(r["run_id"]): float(r["started"]) for r in
                               ctx.sql('SELECT run_id, started FROM "runs"').to_pylist()
                               if r["started"] is not None}
        except Exception:
            ctx.run_started = {}
    sections = [summary_section(ctx)]
    for key, fn in SECTIONS:
        if not any(files.get(t) for t in SECTION_TABLES[key]):
            continue
        if log:
            log(f"report: {key}")
        try:
            sec = fn(ctx)
        except Exception as e:  # one broken table must not lose the rest of the report
            sec = Section(key, key.replace("_", " "), note(f"could not render this section: {type(e).__name__}: {e}"))
            ctx.used.update(SECTION_TABLES[key])
        if sec is not None:
            sections.append(sec)
    other = other_tables_section(ctx)
    if other is not None:
        sections.append(other)
    return sections


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#223;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;font-size:13px;color:#ccd}
nav{padding:8px 24px;background:#eef;font-size:13px}nav a{margin-right:14px;color:#224}
section{background:#fff;margin:14px 24px;padding:8px 18px 14px;border:1px solid #ddd;border-radius:6px}
h2{font-size:17px;border-bottom:1px solid #eee;padding-bottom:4px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left}
th{background:#f2f2f6}table.kv td:first-child{font-weight:600;background:#f7f7fa}
.note{color:#555;font-size:12.5px;max-width:70em}.grid{display:flex;flex-wrap:wrap;gap:8px}
figure{margin:4px;display:inline-block}figcaption{font-size:11px;color:#666;text-align:center}
img{max-width:100%;border:1px solid #eee}
.tokex{margin:8px 0;padding:6px;border-left:3px solid #ccc}.tokex .meta{font-size:12px;color:#444;margin-bottom:3px}
.prompt{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;white-space:pre-wrap;line-height:1.9}
.tok{padding:1px 0;border-radius:2px}.badge{font-size:11px;padding:1px 5px;border-radius:3px;background:#ddd}
.badge.error{background:#f4c7c3}.badge.correct{background:#c8e6c9}
"""


def render_html(store: Store, sections: Sequence[Section], *, title: str | None = None) -> str:
    g = store.geometry
    name = str(store.manifest.model.get("name"))
    ttl = title or f"actstore report: {name}"
    nav = "".join(f'<a href="#{s.id}">{esc(s.title)}</a>' for s in sections)
    body = "\n".join(f'<section id="{s.id}" class="report-section"><h2>{esc(s.title)}</h2>\n{s.body}\n</section>'
                     for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(ttl)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{esc(ttl)}</h1><p>{esc(store.url)} · {store.n_rows} rows · L={g.n_layers} H={g.n_heads} "
            f"· generated {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p></header>"
            f"<nav>{nav}</nav>\n{body}\n</body></html>\n")


def build_report(store: Store, *, options: ReportOptions | None = None, title: str | None = None,
                 log: Callable[[str], None] | None = None) -> str:
    """The report of ``store`` as one HTML string."""
    return render_html(store, collect_sections(store, options, log), title=title)


def write_report(store: Store, out: str | os.PathLike[str], *, options: ReportOptions | None = None,
                 title: str | None = None, log: Callable[[str], None] | None = None) -> str:
    """Write the report atomically to ``out`` (a local file) and return its path."""
    text = build_report(store, options=options, title=title, log=log)
    path = os.fspath(out)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
