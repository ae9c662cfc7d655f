"""``actstore serve``: the interactive explorer over one or more stores (read-only, local by default)."""

from __future__ import annotations

import click

from actstore.cli._options import _sql_memory, bounded_option, command

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@command(example="actstore serve /tmp/s --port 8765    # then open http://127.0.0.1:8765/")
@click.argument("store", metavar="STORE", nargs=-1)
@click.option("--store", "more", multiple=True, metavar="STORE", help="Another store to serve (repeatable).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8765, show_default=True, help="Port (0: any free port)."
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Allow a --host other than 127.0.0.1/localhost/::1 (the explorer has no authentication).",
)
@click.option(
    "--sql-memory",
    default="1GB",
    show_default=True,
    callback=_sql_memory,
    help="Memory one console statement may use.",
)
@bounded_option("--sql-timeout", 30.0, "Seconds one console statement may run.", low=0.1)
@bounded_option("--max-download-rows", 1_000_000, "Rows a CSV/Parquet download may hold.")
@click.option(
    "--direction",
    "direction_files",
    multiple=True,
    metavar="FILE.npy|[NAME=]SPEC",
    help="A [d_model] or [m, d_model] array of residual directions whose unit pages a corpus store "
    "shows, named by the file's stem; or a direction spec of dfa (probe:[STORE:]RUN:RELATION[:L[.H]], "
    "neuron:L:I, token:ID, sae:PATH:I[:enc]) read on the first store, named NAME or the spec (repeatable).",
)
def serve(
    store: tuple[str, ...],
    more: tuple[str, ...],
    host: str,
    port: int,
    allow_remote: bool,
    sql_memory: str,
    sql_timeout: float,
    max_download_rows: int,
    direction_files: tuple[str, ...],
) -> None:
    """Serve a read-only web explorer of STORE (or several, or a folder of stores): store, relations,
    HeadScore heatmaps, prompts with per-source-token head contributions, heads, method comparison,
    a SQL console and a features projection; on a corpus store (--positions all) its documents, a
    search over its tokens, and unit pages (MLP neuron, head, direction) with their top contexts.  Nothing is written to the stores; no model is loaded."""
    import uvicorn

    from actstore.serve.app import create_app
    from actstore.serve.catalog import Catalog
    from actstore.serve.console import ConsoleLimits
    from actstore.serve.corpus import load_direction_files

    paths = list(store) + list(more)
    if not paths:
        raise click.UsageError("give at least one STORE")
    if host not in LOCAL_HOSTS and not allow_remote:
        raise click.UsageError(
            f"--host {host} would expose the stores beyond this machine: add --allow-remote to do so"
        )
    catalog = Catalog.open(paths)
    directions = load_direction_files(list(direction_files), next(iter(catalog)).store if paths else None)
    app = create_app(
        catalog, ConsoleLimits(sql_memory, sql_timeout, max_download_rows), directions=directions
    )
    if host not in LOCAL_HOSTS:
        click.echo(
            f"warning: serving on {host}: anyone who can reach this address can read the stores "
            "(there is no authentication)",
            err=True,
        )
    if port == 0:  # any free port: chosen here, so that the address printed is the one served
        import socket

        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"serving {', '.join(catalog.names)} on http://{shown}:{port}/ (Ctrl-C to stop)", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


COMMANDS = [serve]
