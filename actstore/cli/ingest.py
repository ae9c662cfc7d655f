"""``actstore ingest``: run a model once over a data set with fused capture and write a store."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import (
    command,
    json_option,
    printable,
    procs_option,
    progress_lines,
    quiet_option,
    rank_args,
    threads_option,
)
from actstore.ingest.settings import IngestRequest


@command(
    example="actstore ingest --model smollm2-135m --dataset fewrel:val_wiki.json --limit-per-relation 50 "
    "--out /tmp/s"
)
@threads_option
@options_from(IngestRequest, first=("model", "dataset", "relations", "limit_per_relation", "template"))
@quiet_option
@json_option
@procs_option
def ingest(quiet: bool, as_json: bool, procs: int | None, **given: Any) -> None:
    """Run MODEL once over DATASET with fused capture and write the store OUT."""
    from actstore.core.progress import progress_wanted
    from actstore.ingest.ranks import launch_ranks, leave_process_group, rank_device, ranks_from_env
    from actstore.jobs.ingest import run_ingest

    out, resume, overwrite = given["out"], given["resume"], given["overwrite"]

    if procs is not None and procs > 1:  # the same command, without --procs, under torchrun
        # The launcher holds the store's writer lock until torchrun exits; the ranks run under it.
        def refuse_existing() -> None:  # under the lock, before any rank starts (the ranks check again)
            from actstore.core.ownership import check_root
            from actstore.core.storage import locate

            if not resume:
                check_root(locate(out), overwrite=overwrite)

        rc, error = launch_ranks(
            procs,
            rank_args(click.get_current_context()),
            out=out,
            precheck=refuse_existing,
            log=lambda m: click.echo(printable(m), err=True) if not quiet else None,
        )
        if rc != 0:
            raise click.ClickException(error or f"torchrun exited with status {rc}")
        return

    rank, world = ranks_from_env()  # set by torchrun: each rank ingests every world-th segment
    device = rank_device(given.pop("device"), world)  # one GPU per rank on each node
    req = config_from(
        IngestRequest, given, device=device, progress=progress_wanted(quiet), rank=rank, world_size=world
    )
    lines = progress_lines(quiet, as_json)
    try:
        report = run_ingest(req, log=lambda m: lines(m) if lines is not None and rank == 0 else None)
    finally:
        leave_process_group()
    summary = {
        "store": report.store,
        "examples": report.n_examples,
        "segments_written": report.segments_written,
        "segments_already_committed": report.segments_skipped,
        "seconds": round(report.seconds, 2),
    }
    unit = "positions" if req.positions == "all" else "examples"  # a corpus store's rows are positions
    click.echo(
        json.dumps(summary)
        if as_json
        else f"wrote {report.store}: {report.n_examples} {unit}, {report.segments_written} segments "
        f"({report.segments_skipped} already committed) in {report.seconds:.1f}s"
    )


COMMANDS = [ingest]
