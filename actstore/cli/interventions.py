"""``actstore trace | patch``: run the store's model with interventions (causal tracing, activation
patching); ``ablate`` is :mod:`actstore.cli.ablate`."""

from __future__ import annotations

import json
from typing import Any

import click

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
from actstore.jobs.settings import PatchRequest, TraceRequest  # torch-free: the help imports it


# ----------------------------------------------------------------------------------- trace
@job(example="actstore trace /tmp/s --limit 20 --samples 3 --figures figs")
@where_option
@options_from(TraceRequest)
@figures_option(help="Folder for ROME-style heatmaps (PNG).")
@run_options
def trace(
    store: str,
    where: str | None,
    figures: str | None,
    run: Run,
    **given: Any,
) -> None:
    """Causal tracing: noise on the subject, restore clean states per layer and position, measure P(object)."""
    import numpy as np

    from actstore.jobs.trace import run_trace

    s = open_store_arg(store)
    check_where(s, where)
    req = config_from(
        TraceRequest, given, where=where, figures=figures, save=run.save_results, quiet=not run.progress
    )
    cfg = req.trace
    out = run_trace(s, req)
    rate = 60 * len(out.results) / out.seconds if out.seconds > 0 else None
    if run.as_json:
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
        f"{out.noise_std:.4g} ({cfg.samples} samples, window {cfg.window}); run {out.run_id}"
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
    from actstore.core.errors import InvalidSetting
    from actstore.jobs.patch import parse_pair

    try:
        return tuple(parse_pair(v) for v in value)
    except InvalidSetting as e:
        raise click.BadParameter(e.detail) from None


@job(example="actstore patch /tmp/s --pair 0:1 --pair 5:8 --json")
@where_option
@click.option(
    "--pair",
    "pairs",
    multiple=True,
    callback=_pairs,
    help="CLEAN_ID:COUNTERFACTUAL_ID (repeatable) instead of choosing counterfactuals.",
)
@options_from(PatchRequest)
@run_options
def patch(
    store: str,
    where: str | None,
    pairs: tuple[tuple[int, int], ...],
    run: Run,
    **given: Any,
) -> None:
    """Activation patching: clean activations into a counterfactual prompt of the same relation;
    logit-difference recovery per layer (attention, MLP, residual) and per head."""
    import numpy as np

    from actstore.jobs.patch import run_patch

    s = open_store_arg(store)
    check_where(s, where)
    req = config_from(
        PatchRequest, given, where=where, pairs=pairs, save=run.save_results, quiet=not run.progress
    )
    out = run_patch(s, req)
    if run.as_json:
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


COMMANDS = [trace, patch]
