"""Sections ``section-tracing`` (causal tracing heatmaps: ROME position classes x layer, and single facts)
and ``section-patching`` (activation patching recovery per layer and per head)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.ticker import MaxNLocator

from actstore.query.analyses import plotting
from actstore.query.report.context import (
    Block,
    Heading,
    Note,
    ReportContext,
    Section,
    figure_block,
    floats,
    fmt,
    grid_mean,
    heatmap_block,
    missing,
    of_run,
    pick,
    run_label,
    strings,
    table_block,
    where_equal,
)

TRACE_CLASSES = ("subject_first", "subject_middle", "subject_last", "first_after", "further_after", "last")
COMPONENT_ORDER = {"resid": 0, "mlp": 1, "attn": 2}
COMPONENT_CMAPS = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}


def trace_classes(t: pa.Table) -> np.ndarray:
    """ROME position class of every row of ``trace_effects`` ([rows], index into TRACE_CLASSES; -1: before
    the subject)."""
    ex = np.asarray(t.column("example_id").to_pylist())
    pos = np.asarray(t.column("position").to_pylist())
    role = strings(t, "role")
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


def class_grid(cls: np.ndarray, layer: np.ndarray, vals: np.ndarray, n_layers: int) -> np.ndarray:
    """Mean of ``vals`` per (position class, layer): [len(TRACE_CLASSES), n_layers], NaN where there is none."""
    grid = np.full((len(TRACE_CLASSES), n_layers), np.nan)
    for k in range(len(TRACE_CLASSES)):
        for li in range(n_layers):
            m = (cls == k) & (layer == li) & np.isfinite(vals)
            if m.any():
                grid[k, li] = vals[m].mean()
    return grid


def _average_figure(sub: pa.Table, comps: list[str], value: str, n_facts: int, dpi: int) -> Block:
    cls = trace_classes(sub)
    layer = np.asarray(sub.column("layer").to_pylist())
    vals = floats(sub, value)
    comp_col = strings(sub, "component")
    n_layers = int(layer.max()) + 1 if layer.size else 0
    fig, axes = plotting.new_figure(len(comps), figsize=(4.2 * len(comps), 3.0))
    for ax, c in zip(axes[0], comps):
        m = comp_col == c
        plotting.draw_heatmap(
            ax,
            class_grid(cls[m], layer[m], vals[m], n_layers),
            rows=[x.replace("_", " ") for x in TRACE_CLASSES],
            cols=list(range(n_layers)),
            origin="upper",
            cmap=COMPONENT_CMAPS.get(c, "viridis"),
            xlabel="layer",
            ylabel=None,
            title=f"mean indirect effect: {c or value}",
        )
    return figure_block(fig, f"causal tracing, average over {n_facts} facts", dpi)


def _fact_figure(one: pa.Table, comps: list[str], value: str, title: str, dpi: int) -> Block:
    """One fact: the restored probability per (token, layer), a panel per component."""
    pos = np.asarray(one.column("position").to_pylist())
    n_tokens = int(pos.max()) + 1
    toks = [""] * n_tokens
    if "token" in one.column_names:
        for p, tok in zip(pos.tolist(), one.column("token").to_pylist()):
            toks[p] = str(tok)
    fig, axes = plotting.new_figure(len(comps), figsize=(4.2 * len(comps), min(9.0, 0.22 * n_tokens + 1.6)))
    for ax, c in zip(axes[0], comps):
        part = where_equal(one, "component", c) if c else one
        g, ps, ls = grid_mean(
            part, "prob" if "prob" in part.column_names else value, row="position", col="layer"
        )
        plotting.draw_heatmap(
            ax,
            g,
            rows=[toks[int(p)] for p in ps],
            cols=ls,
            origin="upper",
            cmap=COMPONENT_CMAPS.get(c, "viridis"),
            xlabel="layer",
            ylabel=None,
            title=c or value,
            tick_fontsize=6 if len(ps) > 30 else 7,
            max_ticks=max(16, len(ps)),
        )
    return figure_block(fig, f"causal tracing, {title}", dpi, title)


def tracing_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("trace_effects")
    facts = ctx.table("trace_facts")
    if t is None:
        return None
    value = next((c for c in ("indirect_effect", "effect") if c in t.column_names), None)
    miss = missing(t, "example_id", "layer", "position") + ([] if value else ["indirect_effect"])
    if miss or value is None:
        return Section("tracing", "Causal tracing", [Note(f"trace_effects lacks columns {miss}")])
    run, sub = ctx.latest_run(t)
    comps = (
        sorted({str(c) for c in sub.column("component").to_pylist()})
        if "component" in sub.column_names
        else [""]
    )
    comps.sort(key=lambda c: COMPONENT_ORDER.get(c, 9))
    n_facts = len(set(sub.column("example_id").to_pylist()))
    blocks: list[Block] = [
        Note(
            "Causal tracing (ROME): Gaussian noise on the subject's embeddings, then the clean state of one "
            "component restored at one layer (a window of layers for MLP and attention) and position. "
            "Indirect effect = P(object | restored) − P(object | corrupted), averaged over facts per "
            "position class."
        ),
        Heading(f"{run_label(run)}: {n_facts} facts"),
        _average_figure(sub, comps, value, n_facts, ctx.opts.dpi),
    ]
    fact_info = (
        {int(r["example_id"]): r for r in facts.to_pylist()}
        if facts is not None and "example_id" in facts.column_names
        else {}
    )
    for e in sorted(set(sub.column("example_id").to_pylist()))[:2]:
        f = fact_info.get(int(e), {})
        title = f"example {e}" + (
            f": {f.get('subject')} → {f.get('object')}, p_clean {fmt(f.get('p_clean'))}, "
            f"p_corrupt {fmt(f.get('p_corrupt'))}"
            if f
            else ""
        )
        blocks.append(_fact_figure(where_equal(sub, "example_id", e), comps, value, title, ctx.opts.dpi))
    if facts is not None:
        blocks.append(
            table_block(
                pick(
                    of_run(facts, run),
                    [
                        "example_id",
                        "relation_id",
                        "subject",
                        "object",
                        "p_clean",
                        "p_corrupt",
                        "total_effect",
                    ],
                )[:20]
            )
        )
    return Section("tracing", "Causal tracing", blocks)


def _patching_layers_figure(whole: pa.Table, dpi: int) -> Block:
    fig, axes = plotting.new_figure(figsize=(7, 3.2))
    ax = axes[0, 0]
    comp, pos = strings(whole, "component"), strings(whole, "position")
    layer = np.asarray(whole.column("layer").to_pylist())
    rec = floats(whole, "recovery")
    for c in sorted(set(comp.tolist())):
        for p in sorted(set(pos[comp == c].tolist())):
            m = (comp == c) & (pos == p)
            ls = sorted(set(layer[m].tolist()))
            ax.plot(
                ls,
                [np.nanmean(rec[m & (layer == li)]) for li in ls],
                marker=".",
                label=f"{c} @ {p}" if p else c,
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("mean recovery")
    ax.legend(fontsize=7)
    ax.set_title("patching recovery per layer", fontsize=9)
    return figure_block(fig, "activation patching per layer", dpi)


def patching_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("patch_effects")
    if t is None:
        return None
    miss = missing(t, "component", "layer", "recovery")
    if miss:
        return Section("patching", "Activation patching", [Note(f"patch_effects lacks columns {miss}")])
    run, sub = ctx.latest_run(t)
    blocks: list[Block] = [
        Note(
            "Activation patching: a clean activation patched into a counterfactual prompt; recovery of the "
            "clean-minus-counterfactual logit difference (1 = fully recovered)."
        ),
        Heading(run_label(run)),
        _patching_layers_figure(sub.filter(pc.not_equal(sub.column("component"), "head")), ctx.opts.dpi),
    ]
    heads = where_equal(sub, "component", "head")
    if heads.num_rows and "head" in heads.column_names:
        g, ls, hs = grid_mean(heads, "recovery")
        blocks.append(
            heatmap_block(g, rows=ls, cols=hs, title="per-head patching recovery", dpi=ctx.opts.dpi)
        )
    ctx.used.add("patch_pairs")
    return Section("patching", "Activation patching", blocks)
