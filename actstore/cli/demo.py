"""``actstore demo``: the main job on built-in defaults, end to end on a laptop."""

from __future__ import annotations

from typing import Any

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import command, quiet_option, threads_option
from actstore.jobs.settings import DemoConfig


def _step(title: str) -> None:
    click.echo(click.style(f"==> {title}", bold=True), err=True)


def _detail(text: str) -> None:
    click.echo(text, err=True)


@command(example="actstore demo --out demo-out --limit-per-relation 20")
@threads_option
@options_from(DemoConfig)
@quiet_option
def demo(quiet: bool, **given: Any) -> None:
    """Ingest the demo corpus, run probes, HeadScore/TokenScore and MAPS, and write a report."""
    from actstore.core.progress import progress_wanted
    from actstore.jobs.demo import run_demo

    cfg = config_from(DemoConfig, given)
    if quiet:
        summary = run_demo(cfg)
    else:
        summary = run_demo(cfg, step=_step, log=_detail, progress=progress_wanted())
    report = summary.get("report")
    click.echo(
        f"done in {summary['seconds']}s. store: {summary['store']}"
        + (f"  report: {report}" if report else "")
    )


COMMANDS = [demo]
