"""The ``actstore`` command line.  Every error is one line on stderr and a non-zero exit.

Heavy modules (torch, transformers, the ingest and query packages) are imported inside the
commands that need them, so ``actstore sql`` starts fast and the core does not depend on them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from actstore.errors import ActstoreError

F = TypeVar("F", bound=Callable[..., Any])


def printable(text: object) -> str:
    """``text`` with control and other non-printing characters escaped (``\\x1b``, ``\\u202e``), so that
    strings from a store or a data set (relation names, model names, file names) cannot drive the
    terminal with escape sequences when printed."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return "".join(out)


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {printable(' '.join(str(message).split()))}", err=True)
    sys.exit(code)


def friendly(fn: F) -> F:
    """Turn expected errors into one line and exit status 1 (2 for usage errors, as click does)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.exceptions.ClickException:
            raise
        except (ActstoreError, ValueError, FileNotFoundError, PermissionError, KeyError, OSError) as e:
            fail(str(e) if not isinstance(e, KeyError) else f"missing {e}")
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper  # type: ignore[return-value]


def parse_int_list(text: str | None, what: str = "layers") -> list[int] | None:
    """``"0,3,5-7"`` -> [0, 3, 5, 6, 7]."""
    if text is None or text.strip() == "":
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ValueError(f"--{what}: {part!r} is not an integer or a range like 5-7") from None
    return out


def _sql_memory(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from actstore.errors import QueryError
    from actstore.sql import check_memory_limit

    try:
        return check_memory_limit(value)
    except QueryError as e:
        raise click.BadParameter(str(e)) from None


def _where(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--where``: parsed as exactly one SQL expression before the command runs."""
    if value is None or not value.strip():
        return value
    from actstore.errors import QueryError
    from actstore.sql import predicate

    try:
        predicate(value)
    except QueryError as e:
        raise click.BadParameter(str(e)) from None
    return value + "\n" if "--" in value else value  # a trailing -- comment ends before whatever follows


def sql_limit_options(fn: F) -> F:
    """``--sql-memory`` and ``--sql-timeout``: the limits of every SQL statement the command runs."""
    from actstore.sql import DEFAULT_MEMORY_LIMIT, DEFAULT_TIMEOUT

    @functools.wraps(fn)
    def wrapper(*args: Any, sql_memory: str, sql_timeout: float, **kwargs: Any) -> Any:
        from actstore.sql import limits

        with limits(memory_limit=sql_memory, timeout=sql_timeout):
            return fn(*args, **kwargs)

    wrapper = click.option("--sql-timeout", type=click.FloatRange(min=0), default=DEFAULT_TIMEOUT, show_default=True,
                           help="Seconds one SQL statement may run (0: no limit).")(wrapper)
    wrapper = click.option("--sql-memory", default=DEFAULT_MEMORY_LIMIT, show_default=True, callback=_sql_memory,
                           help="Memory one SQL statement may use, e.g. 512MB; nothing spills to disk.")(wrapper)
    return wrapper  # type: ignore[return-value]


def where_option(help: str) -> Callable[[F], F]:
    """``--where`` (one SQL expression, checked before the command runs) and the SQL limit options."""

    def deco(fn: F) -> F:
        return click.option("--where", default=None, callback=_where, help=help)(sql_limit_options(fn))

    return deco


# Commands that live with their analyses (query/, ingest/), imported only when invoked.
LAZY_COMMANDS: dict[str, str] = {
    "probe": "query.cli_probe:probe",
    "headscore": "query.cli_probe:headscore",
    "tokenscore": "query.cli_probe:tokenscore",
    "correlate": "query.cli_probe:correlate",
    "shortcuts": "query.cli_probe:shortcuts",
    "maps": "query.cli_maps:maps",
    "maps-dynamic": "query.cli_maps:maps_dynamic",
    "ablate": "ingest.cli_interventions:ablate",
    "trace": "ingest.cli_interventions:trace",
    "patch": "ingest.cli_interventions:patch",
    "lens": "query.cli_methods:lens",
    "agree": "query.cli_methods:agree",
    "report": "query.cli_report:report",
    "demo": "actstore.demo:demo",
}


class LazyGroup(click.Group):
    """A click group whose listed commands are imported on first use (keeps startup fast)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        """Usage errors (bad option values, unknown options) as one ``error:`` line, like every error."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare ``actstore``: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            fail(e.format_message() + where, e.exit_code)
        except click.ClickException as e:
            fail(e.format_message(), e.exit_code)
        except click.exceptions.Abort:
            fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS:
            import importlib

            module, attr = LAZY_COMMANDS[cmd_name].split(":")
            try:
                cmd = getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as e:
                if e.name == module:
                    return None  # not built (yet): click reports "No such command"
                raise
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="actstore")
def main() -> None:
    """actstore: ingest a corpus once with fused capture, then query per-head and per-token features."""


# --------------------------------------------------------------------------------------- ingest
@main.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Alias (smollm2-135m, gemma3-270m, tiny-llama, ...), local folder or hub name.")
@click.option("--dataset", "dataset_spec", default="demo", show_default=True,
              help="KIND:PATH with KIND in fewrel, lre, known1000, maps, jsonl; or demo.")
@click.option("--relations", default=None, help="Comma-separated relation ids to keep.")
@click.option("--limit-per-relation", type=int, default=None)
@click.option("--template", default=None, help="Prompt template for maps pairs, e.g. 'The capital of {} is'.")
@click.option("--keep-object-first", is_flag=True,
              help="fewrel: keep instances whose object comes before the subject (skipped by default).")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--dtype", "storage_dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float16",
              show_default=True, help="Storage dtype of the captured arrays.")
@click.option("--model-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--segment-size", type=int, default=256, show_default=True,
              help="Examples per commit, a multiple of --batch-size.")
@click.option("--padding-side", type=click.Choice(["left", "right"]), default="right", show_default=True)
@click.option("--out", required=True, help="Store directory or URL.")
@click.option("--resume", is_flag=True, help="Continue an interrupted ingest from its last commit.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store at --out.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@click.option("--procs", type=click.IntRange(min=1), default=None,
              help="Run as N ranks on this machine (torchrun --nproc_per_node N, gloo; one summary line per rank).")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="torch CPU threads per process (0: torch's default, one per core). Use 1 when other jobs share "
                   "the cores: oversubscribed threads slow the forward pass several-fold.")
@friendly
def ingest(model_name: str, dataset_spec: str, relations: str | None, limit_per_relation: int | None,
           template: str | None, keep_object_first: bool, batch_size: int, storage_dtype: str, model_dtype: str, device: str,
           segment_size: int, padding_side: str, out: str, resume: bool, overwrite: bool, quiet: bool,
           as_json: bool, procs: int | None, threads: int) -> None:
    """Run MODEL once over DATASET with fused capture and write the store OUT."""
    from ingest.distributed import launch_ranks, leave_process_group, ranks_from_env
    from ingest.run import IngestRequest, ingest_corpus

    if procs is not None and procs > 1:  # the same command, without --procs, under torchrun
        ctx = click.get_current_context()
        args: list[str] = []
        for p in ctx.command.params:
            value = ctx.params.get(p.name or "")
            if p.name == "procs" or value is None or not isinstance(p, click.Option) or value is False:
                continue
            args += [p.opts[-1]] if p.is_flag else [p.opts[-1], str(value)]
        # The launcher holds the store's writer lock until torchrun exits; the ranks run under it.
        rc, error = launch_ranks(procs, args, out=out,
                                 log=lambda m: click.echo(printable(m), err=True) if not quiet else None)
        if rc != 0:
            fail(error or f"torchrun exited with status {rc}")
        return

    rank, world = ranks_from_env()  # set by torchrun: each rank ingests every world-th segment
    if device == "cuda" and world > 1 and os.environ.get("LOCAL_RANK", "").isdigit():
        import torch  # one GPU per rank on each node (ranks share GPUs when there are fewer)

        device = f"cuda:{int(os.environ['LOCAL_RANK']) % max(1, torch.cuda.device_count())}"
    req = IngestRequest(
        model=model_name, dataset=dataset_spec,
        relations=[r.strip() for r in relations.split(",") if r.strip()] if relations is not None else None,
        limit_per_relation=limit_per_relation, template=template, keep_object_first=keep_object_first,
        batch_size=batch_size,
        storage_dtype=storage_dtype, model_dtype=model_dtype, device=device, segment_size=segment_size,
        padding_side=padding_side, out=out, resume=resume, overwrite=overwrite, progress=not quiet,
        rank=rank, world_size=world, threads=threads,
    )
    try:
        report = ingest_corpus(req, log=lambda m: click.echo(printable(m), err=True) if not quiet and rank == 0 else None)
    finally:
        leave_process_group()
    summary = {"store": report.store, "examples": report.n_examples, "segments_written": report.segments_written,
               "segments_already_committed": report.segments_skipped, "seconds": round(report.seconds, 2)}
    click.echo(json.dumps(summary) if as_json else
               f"wrote {report.store}: {report.n_examples} examples, {report.segments_written} segments "
               f"({report.segments_skipped} already committed) in {report.seconds:.1f}s")


# --------------------------------------------------------------------------------------- info
@main.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True)
@friendly
def info(store: str, as_json: bool) -> None:
    """Summarise a store: model, geometry, corpus, sizes."""
    import actstore

    s = actstore.open(store)
    rel = s.sql("SELECT relation_id, any_value(relation_name) AS relation_name, count(*) AS n "
                "FROM examples GROUP BY 1 ORDER BY 1").to_pylist()
    tables = {name: len(files) for name, files in s.table_files().items()}
    d = {
        "store": s.url, "format_version": s.manifest.format_version, "model": s.manifest.model,
        "geometry": s.geometry.to_dict(), "storage_dtype": s.manifest.storage_dtype,
        "examples": s.manifest.n_examples, "rows_committed": s.n_rows,
        "segments": {"committed": len(s.commits), "total": s.manifest.n_segments}, "complete": s.complete,
        "relations": rel, "tables": tables, "bytes": _du(s),
    }
    if as_json:
        click.echo(json.dumps(d, indent=2, default=str))
        return
    g = s.geometry
    out = [  # store-provided strings (model, relation names) are printed with control characters escaped
        f"store     {s.url}  (format v{s.manifest.format_version})",
        f"model     {s.manifest.model.get('name')}  [{s.manifest.model.get('architecture')}]  "
        f"weights sha256 {str(s.manifest.model.get('weight_hash', ''))[:16]}",
        f"geometry  L={g.n_layers} H={g.n_heads} H_kv={g.n_kv_heads} d_head={g.d_head} "
        f"d_model={g.d_model} d_mlp={g.d_mlp} vocab={g.vocab_size}",
        f"rows      {s.n_rows}/{s.manifest.n_examples} in {len(s.commits)}/{s.manifest.n_segments} "
        f"segments, {s.manifest.storage_dtype}{'' if s.complete else '  (INCOMPLETE: resume the ingest)'}",
        f"size      {d['bytes'] / 1e6:.1f} MB",
        f"tables    {', '.join(f'{k} ({v} files)' for k, v in tables.items())}",
        *(f"  {printable(r['relation_id']):<24} {r['n']:>6}  {r['relation_name']}" for r in rel),
    ]
    for line in out:
        click.echo(printable(line))


def _du(s: Any) -> int:
    if s.location.is_local:
        total = 0
        for root, _, files in os.walk(s.location.root):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total
    return int(s.location.fs.du(s.location.root))


# --------------------------------------------------------------------------------------- sql
@main.command()
@click.argument("store")
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@sql_limit_options
@friendly
def sql(store: str, query: str, fmt: str) -> None:
    """Run one read-only SELECT over the store's tables."""
    import actstore
    from actstore.sql import render

    click.echo(render(actstore.open(store).sql(query), fmt))


# --------------------------------------------------------------------------------------- features
@main.command()
@click.argument("store")
@click.option("--kind", required=True, help="z, attn_head, attn, attn_head_token, attn_entity, attn_prob, mlp, mlp_group, resid")
@where_option("SQL predicate over examples, e.g. \"relation_id = 'P17'\".")
@click.option("--layers", default=None, help="e.g. 0,3,5-7")
@click.option("--heads", default=None, help="e.g. 0-3")
@click.option("--groups", type=int, default=None, help="mlp_group: number of neuron groups (default: heads).")
@click.option("--out", "out_path", required=True, help="Output .npy file.")
@click.option("--ids-out", default=None, help="Parquet file of (example_id, row) in the array's order.")
@friendly
def features(store: str, kind: str, where: str | None, layers: str | None, heads: str | None, groups: int | None,
             out_path: str, ids_out: str | None) -> None:
    """Write the features of the selected target rows to a .npy file (target-row order)."""
    import numpy as np
    import pyarrow.parquet as pq

    import actstore

    s = actstore.open(store)
    sel = s.select(where)
    x = sel.features(kind, layers=parse_int_list(layers), heads=parse_int_list(heads, "heads"), groups=groups)
    tmp = out_path + ".tmp.npy"
    np.save(tmp, x)
    os.replace(tmp, out_path if out_path.endswith(".npy") else out_path)
    if ids_out:
        pq.write_table(sel.rows.select(["example_id", "row"]), ids_out)
    click.echo(f"wrote {out_path}: {kind} {list(x.shape)} float32 for {len(sel)} rows")


# --------------------------------------------------------------------------------------- verify
@main.command()
@click.argument("store")
@click.option("--values", is_flag=True, help="Also decode every chunk and report NaN or infinite values.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def verify(store: str, values: bool, as_json: bool) -> None:
    """Check that every committed chunk and table is there with its recorded hash, offsets, the manifest."""
    import actstore
    from actstore.verify import verify_store

    report = verify_store(actstore.open(store), values=values)
    if as_json:
        click.echo(json.dumps({"store": report.store, "ok": report.ok, "status": report.status,
                               "segments": report.segments_checked, "chunks": report.chunks_checked,
                               "uncommitted_segments": report.uncommitted, "values_checked": report.values_checked,
                               "problems": report.problems, "notes": report.notes}))
    else:
        for n in report.notes:
            click.echo(f"NOTE {printable(n)}", err=True)
        for p in report.problems:
            click.echo(f"PROBLEM {printable(p)}", err=True)
        click.echo(f"{report.status}: {report.segments_checked} segments, "
                   f"{report.chunks_checked} chunks checked{' (values scanned)' if values else ''}, "
                   f"{len(report.problems)} problems")
    if not report.ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
