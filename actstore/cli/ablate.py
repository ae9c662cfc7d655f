"""``actstore ablate``: remove the heads MAPS says implement a relation and measure what the model loses."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import Run, check_where, job, open_store_arg, run_options, where_option
from actstore.jobs.settings import AblateRequest  # torch-free: the help imports it
from actstore.query.maps.settings import AblationConfig


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:+6.1f}%"


def _stderr(quiet: bool) -> Any:
    return None if quiet else (lambda m: click.echo(m, err=True))


@job(example="actstore ablate /tmp/s --relation country_capital --pairs maps/ --random-draws 5")
@options_from(AblateRequest, first=("relation",))
@click.option("--no-controls", is_flag=True, help="Skip control relations.")
@click.option("--heads", "heads_text", default=None, help="Remove these heads instead (LAYER.HEAD list).")
@where_option
@run_options
def ablate(
    store: str,
    no_controls: bool,
    heads_text: str | None,
    where: str | None,
    run: Run,
    **given: Any,
) -> None:
    """Accuracy on RELATION's prompts with no ablation, with its MAPS heads removed, with as many
    random heads removed, and on control relations."""
    from actstore.jobs.ablate import parse_heads_text, run_ablate

    s = open_store_arg(store)
    check_where(s, where)
    no_control: dict[str, Any] = {"controls": ()} if no_controls else {}  # () skips them; None chooses
    cfg = config_from(AblationConfig, given, heads=parse_heads_text(heads_text, s), where=where, **no_control)
    req = config_from(AblateRequest, given, ablation=cfg, save=run.save_results, quiet=run.quiet)
    out = run_ablate(s, req, log=_stderr(run.quiet))
    if run.as_json:
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
        f"{cfg.relation}: {m['n_prompts']} prompts, {m['n_heads']} heads removed ({m['head_selection']}, k={m['k']}"
        f"{', first MLP' if m['first_mlp'] else ''}, "
        f"{cfg.mode} ablation at {m['positions']} position(s)); run {out.run_id}"
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
