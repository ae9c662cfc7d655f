"""``actstore demo``: the main job on built-in defaults, end to end on a laptop."""

from __future__ import annotations

import click

from actstore.cli._options import command


def _step(title: str) -> None:
    click.echo(click.style(f"==> {title}", bold=True), err=True)


def _detail(text: str) -> None:
    click.echo(text, err=True)


@command(example="actstore demo --out demo-out --limit-per-relation 20")
@click.option("--out", default="demo-out", show_default=True, help="Folder for the store and the report.")
@click.option(
    "--model",
    "model",
    default="smollm2-135m",
    show_default=True,
    help="Model to ingest with: alias, local folder or hub name.",
)
@click.option("--limit-per-relation", type=int, default=None, help="Fewer prompts for a quicker demo.")
@click.option("--episodes", type=int, default=100, show_default=True, help="Probe episodes per seed.")
def demo(out: str, model: str, limit_per_relation: int | None, episodes: int) -> None:
    """Ingest the demo corpus, run probes, HeadScore/TokenScore and MAPS, and write a report."""
    from actstore.jobs.demo import run_demo

    summary = run_demo(
        out, model=model, limit_per_relation=limit_per_relation, episodes=episodes, step=_step, log=_detail
    )
    report = summary.get("report")
    click.echo(
        f"done in {summary['seconds']}s. store: {summary['store']}"
        + (f"  report: {report}" if report else "")
    )


COMMANDS = [demo]
