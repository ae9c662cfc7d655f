"""``actstore import``: activations captured elsewhere (vLLM ``extract_hidden_states`` files, a saved
TransformerLens cache or nnsight saves) written into a corpus store (docs/interop.md)."""

from __future__ import annotations

from typing import Any

import click

from actstore.cli._options import command, parse_int_list, printable, threads_option
from actstore.core.layout import WEIGHTS_MODES


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
@click.option("--resume", is_flag=True, help="Write the segments an interrupted import did not commit.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store.")
def import_(source: tuple[str, ...], layer_ids: str | None, **settings: Any) -> None:
    """Write SOURCE into the corpus store OUT: a folder of (or files) vLLM extract_hidden_states
    safetensors (token_ids, hidden_states [seq, layers, d]; give --layer-ids), or a .safetensors /
    .pt file of a cache (TransformerLens hook names or transformers module paths -> [batch, pos, d])
    with its token ids under "tokens"."""
    from actstore.jobs.import_acts import read_source, write_corpus

    src, tokens = read_source(list(source))
    ids = parse_int_list(layer_ids) if layer_ids else None
    report = write_corpus(settings.pop("out"), src, tokens=tokens, layer_ids=ids, **settings)
    click.echo(
        printable(
            f"{report.store}: {report.n_examples} positions, {report.segments_written} segments written"
        )
    )


COMMANDS = [import_]
