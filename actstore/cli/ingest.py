"""``actstore ingest``: run a model once over a data set with fused capture and write a store."""

from __future__ import annotations

import json
import os

import click

from actstore.cli._options import command, json_option, printable, quiet_option


@command(
    example="actstore ingest --model smollm2-135m --dataset fewrel:val_wiki.json --limit-per-relation 50 "
    "--out /tmp/s"
)
@click.option(
    "--model",
    "model_name",
    default="smollm2-135m",
    show_default=True,
    help="Alias (smollm2-135m, gemma3-270m, tiny-llama, ...), local folder or hub name.",
)
@click.option(
    "--dataset",
    "dataset_spec",
    default="demo",
    show_default=True,
    help="KIND:PATH (KIND in fewrel, lre, known1000, maps, jsonl), a public data set by name "
    "(fewrel, lre, known1000, maps; docs/datasets.md), or demo.",
)
@click.option("--relations", default=None, help="Comma-separated relation ids to keep.")
@click.option("--limit-per-relation", type=int, default=None, help="At most this many prompts per relation.")
@click.option("--template", default=None, help="Prompt template for maps pairs, e.g. 'The capital of {} is'.")
@click.option(
    "--keep-object-first",
    is_flag=True,
    help="fewrel: keep instances whose object comes before the subject (skipped by default).",
)
@click.option("--batch-size", type=int, default=16, show_default=True, help="Prompts per forward pass.")
@click.option(
    "--dtype",
    "storage_dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float16",
    show_default=True,
    help="Storage dtype of the captured arrays.",
)
@click.option(
    "--model-dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="dtype the model runs in.",
)
@click.option(
    "--device", default="cpu", show_default=True, help="torch device of the model (cpu, cuda, ...)."
)
@click.option(
    "--segment-size",
    type=int,
    default=256,
    show_default=True,
    help="Examples per commit, a multiple of --batch-size.",
)
@click.option(
    "--padding-side",
    type=click.Choice(["left", "right"]),
    default="right",
    show_default=True,
    help="Side the prompts of a batch are padded on.",
)
@click.option(
    "--length-batching",
    is_flag=True,
    help="Run each segment's prompts through the model sorted by length (less padding; rows are "
    "stored in corpus order). Float values may differ from corpus-order batches in their last "
    "bits; recorded in the manifest, and --resume must repeat it.",
)
@click.option(
    "--chunk-layers",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Layers per chunk of the stored arrays (0: all layers in one chunk). One layer per chunk lets "
    "a query of a few layers read only their bytes.",
)
@click.option("--out", required=True, help="Store directory or URL.")
@click.option("--resume", is_flag=True, help="Continue an interrupted ingest from its last commit.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store at --out.")
@quiet_option
@json_option
@click.option(
    "--procs",
    type=click.IntRange(min=1),
    default=None,
    help="Run as N ranks on this machine (torchrun --nproc_per_node N, gloo; one summary line per rank).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="torch CPU threads per process (0: torch's default, one per core). Use 1 when other jobs share "
    "the cores: oversubscribed threads slow the forward pass several-fold.",
)
def ingest(
    model_name: str,
    dataset_spec: str,
    relations: str | None,
    limit_per_relation: int | None,
    template: str | None,
    keep_object_first: bool,
    batch_size: int,
    storage_dtype: str,
    model_dtype: str,
    device: str,
    segment_size: int,
    padding_side: str,
    length_batching: bool,
    chunk_layers: int,
    out: str,
    resume: bool,
    overwrite: bool,
    quiet: bool,
    as_json: bool,
    procs: int | None,
    threads: int,
) -> None:
    """Run MODEL once over DATASET with fused capture and write the store OUT."""
    from actstore.ingest.distributed import launch_ranks, leave_process_group, ranks_from_env
    from actstore.jobs.ingest import IngestRequest, run_ingest

    if procs is not None and procs > 1:  # the same command, without --procs, under torchrun
        ctx = click.get_current_context()
        args: list[str] = []
        for p in ctx.command.params:
            value = ctx.params.get(p.name or "")
            if p.name == "procs" or value is None or not isinstance(p, click.Option) or value is False:
                continue
            args += [p.opts[-1]] if p.is_flag else [p.opts[-1], str(value)]

        # The launcher holds the store's writer lock until torchrun exits; the ranks run under it.
        def refuse_existing() -> None:  # under the lock, before any rank starts (the ranks check again)
            from actstore.core.fs import locate
            from actstore.core.ownership import check_root

            if not resume:
                check_root(locate(out), overwrite=overwrite)

        rc, error = launch_ranks(
            procs,
            args,
            out=out,
            precheck=refuse_existing,
            log=lambda m: click.echo(printable(m), err=True) if not quiet else None,
        )
        if rc != 0:
            raise click.ClickException(error or f"torchrun exited with status {rc}")
        return

    rank, world = ranks_from_env()  # set by torchrun: each rank ingests every world-th segment
    if device == "cuda" and world > 1 and os.environ.get("LOCAL_RANK", "").isdigit():
        import torch  # one GPU per rank on each node (ranks share GPUs when there are fewer)

        device = f"cuda:{int(os.environ['LOCAL_RANK']) % max(1, torch.cuda.device_count())}"
    req = IngestRequest(
        model=model_name,
        dataset=dataset_spec,
        relations=[r.strip() for r in relations.split(",") if r.strip()] if relations is not None else None,
        limit_per_relation=limit_per_relation,
        template=template,
        keep_object_first=keep_object_first,
        batch_size=batch_size,
        storage_dtype=storage_dtype,
        model_dtype=model_dtype,
        device=device,
        segment_size=segment_size,
        padding_side=padding_side,
        length_batching=length_batching,
        chunk_layers=chunk_layers,
        out=out,
        resume=resume,
        overwrite=overwrite,
        progress=not quiet,
        rank=rank,
        world_size=world,
        threads=threads,
    )
    try:
        report = run_ingest(
            req, log=lambda m: click.echo(printable(m), err=True) if not quiet and rank == 0 else None
        )
    finally:
        leave_process_group()
    summary = {
        "store": report.store,
        "examples": report.n_examples,
        "segments_written": report.segments_written,
        "segments_already_committed": report.segments_skipped,
        "seconds": round(report.seconds, 2),
    }
    click.echo(
        json.dumps(summary)
        if as_json
        else f"wrote {report.store}: {report.n_examples} examples, {report.segments_written} segments "
        f"({report.segments_skipped} already committed) in {report.seconds:.1f}s"
    )


COMMANDS = [ingest]
