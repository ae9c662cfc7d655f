"""``actstore import``: activations captured elsewhere (vLLM ``extract_hidden_states`` files, a saved
TransformerLens cache or nnsight saves) written into a corpus store (docs/interop.md)."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._options import (
    command,
    json_option,
    parse_int_list,
    printable,
    procs_option,
    quiet_option,
    rank_args,
    threads_option,
)
from actstore.core.layout import WEIGHTS_MODES
from actstore.core.settings import DEFAULT_DEVICE


@command(
    "import",
    example="actstore import /tmp/hidden_states --layer-ids 1,9,17 --model smollm2-135m --out /tmp/s",
)
@threads_option
@click.argument("source", nargs=-1, required=True, metavar="SOURCE...")
@click.option("--out", required=True, help="The store to write (a path or URL).")
@click.option(
    "--model", default="smollm2-135m", show_default=True, help="The model the activations came from."
)
@click.option(
    "--layer-ids",
    default=None,
    help="vLLM files: the eagle_aux_hidden_state_layer_ids they were written with, in order (0,6,12).",
)
@click.option(
    "--dtype",
    "storage_dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "float16", "bfloat16"]),
    help="Storage dtype of the written residuals.",
)
@click.option(
    "--segment-size",
    default=None,
    type=click.IntRange(min=1),
    help="Positions per commit [default: about 16 MiB of stored residuals, a multiple of 256].",
)
@click.option(
    "--weights",
    default="shared",
    show_default=True,
    type=click.Choice(WEIGHTS_MODES),
    help="Where the model's weights go: shared (one copy per model in the user cache), copy (in the "
    "store), none (docs/storage.md).",
)
@click.option(
    "--predict/--no-predict",
    default=True,
    show_default=True,
    help="The model's next-token predictions from the last residual, when it is imported (the targets "
    "table's top_token_id, object_logprob, object_rank). Its logits over the vocabulary can cost far "
    "more than the import (SmolLM2-135M, 2,048 requests, 2 CPU cores: 12.6x the whole command); "
    "--no-predict stores -1 / NaN.",
)
@click.option(
    "--device",
    default=DEFAULT_DEVICE,
    show_default=True,
    help="torch device of the model, which computes the predictions (cuda: under --procs, cuda:LOCAL_RANK).",
)
@click.option("--resume", is_flag=True, help="Write the segments an interrupted import did not commit.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store.")
@quiet_option
@json_option
@procs_option
def import_(
    source: tuple[str, ...],
    layer_ids: str | None,
    procs: int | None,
    quiet: bool,
    as_json: bool,
    **settings: Any,
) -> None:
    """Write SOURCE into the corpus store OUT: a folder of (or files) vLLM extract_hidden_states
    safetensors (token_ids, hidden_states [seq, layers, d]; give --layer-ids), or a .safetensors /
    .pt file of a cache (TransformerLens hook names or transformers module paths -> [batch, pos, d])
    with its token ids under "tokens"."""
    from actstore.core.progress import progress_wanted
    from actstore.ingest.ranks import leave_process_group, rank_device, ranks_from_env
    from actstore.jobs.import_acts import read_source, write_corpus

    if procs is not None and procs > 1:
        _launch(procs, settings["out"], resume=settings["resume"], overwrite=settings["overwrite"])
        return
    src, tokens = read_source(list(source))
    ids = parse_int_list(layer_ids) if layer_ids else None
    rank, world = ranks_from_env()  # set by torchrun: each rank writes every world-th segment
    device = rank_device(settings.pop("device"), world)
    try:
        report = write_corpus(
            settings.pop("out"),
            src,
            tokens=tokens,
            layer_ids=ids,
            rank=rank,
            world_size=world,
            device=device,
            progress=progress_wanted(quiet),
            **settings,
        )
    finally:
        leave_process_group()
    if as_json:
        summary = {
            "store": report.store,
            "positions": report.n_examples,
            "segments_written": report.segments_written,
            "segments_already_committed": report.segments_skipped,
            "seconds": round(report.seconds, 2),
        }
        click.echo(json.dumps(summary))
        return
    click.echo(
        printable(
            f"{report.store}: {report.n_examples} positions, {report.segments_written} segments written"
        )
    )


def _launch(procs: int, out: str, *, resume: bool, overwrite: bool) -> None:
    """The same command, without --procs, as ``procs`` ranks under torchrun; the launcher holds the
    writer lock throughout, and removes a store its ranks created when one of them failed (a bad value
    in a file: one line, no store)."""
    from actstore.core.ownership import check_root, discard_created
    from actstore.core.storage import locate
    from actstore.ingest.ranks import launch_ranks

    created = {"fresh": False}

    def look() -> None:  # under the lock, before any rank starts (the ranks look again)
        if not resume:
            created["fresh"] = check_root(locate(out), overwrite=overwrite) is None

    def after(status: int) -> None:  # every rank has exited; the lock is still held
        if status != 0 and created["fresh"]:
            discard_created(locate(out))

    rc, error = launch_ranks(
        procs,
        rank_args(click.get_current_context()),
        out=out,
        precheck=look,
        command="import",
        after=after,
    )
    if rc != 0:
        raise click.ClickException(error or f"torchrun exited with status {rc}")


COMMANDS = [import_]
