"""What every command shares: the command class, the options defined once, and small parsing helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

# --------------------------------------------------------------------------------------- helpers


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


def parse_int_list(text: str | None, what: str = "layers") -> list[int] | None:
    """``"0,3,5-7"`` -> [0, 3, 5, 6, 7]; None for no text."""
    if text is None or text.strip() == "":
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise click.BadParameter(
                        f"{part!r} is an empty range (write {hi}-{lo})", param_hint=f"--{what}"
                    )
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise click.BadParameter(
                f"{part!r} is not an integer or a range like 5-7", param_hint=f"--{what}"
            ) from None
    return out


def split_list(text: str | None) -> tuple[str, ...] | None:
    """``"a, b,,c"`` -> ("a", "b", "c"); None for None."""
    if text is None:
        return None
    return tuple(x.strip() for x in text.split(",") if x.strip())


def note(message: str) -> None:
    click.echo(f"note: {printable(message)}", err=True)


# --------------------------------------------------------------------------------------- commands


class ActstoreCommand(click.Command):
    """A command whose errors name the command-line option of a refused setting."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as e:
            name_settings(self, e)
            raise


def command(
    name: str | None = None, *, example: str, **kwargs: Any
) -> Callable[[Callable[..., Any]], click.Command]:
    """``click.command`` with :class:`ActstoreCommand` and ``example`` as the help's epilog."""
    epilog = "\b\nExample:\n  " + example.strip().replace("\n", "\n  ")
    return click.command(name, cls=ActstoreCommand, epilog=epilog, **kwargs)


# --------------------------------------------------------------------------------------- shared options


def store_argument(fn: F) -> F:
    """STORE, the first positional argument of every command reading a store."""
    return click.argument("store", metavar="STORE")(fn)


def json_option(fn: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help='Print one JSON object on stdout (errors too: {"error": ..., "type": ...}).',
    )(fn)


def quiet_option(fn: F) -> F:
    return click.option("--quiet", is_flag=True, help="No progress bars or progress lines on stderr.")(fn)


def procs_option(fn: F) -> F:
    return click.option(
        "--procs",
        type=click.IntRange(min=1),
        default=None,
        help="Run as N ranks on this machine (torchrun --nproc_per_node N, gloo; one summary line per rank).",
    )(fn)


def rank_args(ctx: click.Context) -> list[str]:
    """The command line of ``ctx`` again without ``--procs``, as each rank of ``--procs`` runs it: the
    options given (flags that are set), then ``--`` and the positional arguments."""
    options: list[str] = []
    positional: list[str] = []
    for p in ctx.command.params:
        value = ctx.params.get(p.name or "")
        if p.name == "procs" or value is None:
            continue
        if isinstance(p, click.Argument):
            positional += [str(v) for v in (value if isinstance(value, tuple) else (value,))]
        elif isinstance(p, click.Option) and p.is_flag:  # --x, or --x/--no-x either way
            options += [p.opts[-1]] if value else p.secondary_opts[-1:]
        elif isinstance(p, click.Option):
            options += [p.opts[-1], str(value)]
    return [*options, *(["--", *positional] if positional else [])]


def progress_lines(quiet: bool, as_json: bool = False) -> Callable[[str], None] | None:
    """The callback that prints a command's progress lines on stderr, or None: none with ``--quiet``,
    none with ``--json`` unless stderr is a terminal (a piped ``--json`` keeps stderr silent)."""
    from actstore.core.progress import progress_wanted

    if quiet or (as_json and not progress_wanted()):
        return None
    return lambda m: click.echo(printable(m), err=True)


@contextlib.contextmanager
def compute_threads(threads: int) -> Iterator[None]:
    """``--threads`` while a command runs: torch's intra-op threads, numpy's BLAS/OpenMP pools
    (threadpoolctl) and the DuckDB connections opened meanwhile set to ``threads``, restored
    afterwards; 0 leaves them as they are."""
    if threads <= 0:
        yield
        return
    import torch
    from threadpoolctl import threadpool_limits

    from actstore.core.sql_connect import sql_threads

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(threads), sql_threads(threads):
            yield
    finally:
        torch.set_num_threads(old)


def threads_option(fn: F) -> F:
    """``--threads`` (:data:`actstore.core.settings.THREADS_HELP`, default
    :data:`~actstore.core.settings.DEFAULT_THREADS`) of every command that computes, applied with
    :func:`compute_threads` around the command.  A command whose settings declare ``threads``
    themselves (ingest, probe: :func:`actstore.core.settings.threads_setting`) keeps that option and
    is wrapped alike; place this decorator above the settings' options."""
    from actstore.core.settings import DEFAULT_THREADS, THREADS_HELP

    declared = any(p.name == "threads" for p in getattr(fn, "__click_params__", ()))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads = kwargs["threads"] if declared else kwargs.pop("threads")
        with compute_threads(threads):
            return fn(*args, **kwargs)

    if declared:
        return wrapper  # type: ignore[return-value]
    return click.option(
        "--threads", type=click.IntRange(min=0), default=DEFAULT_THREADS, show_default=True, help=THREADS_HELP
    )(wrapper)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Run:
    """What every command that runs a job takes alike (:func:`run_options`): ``--no-save``, ``--quiet``
    and ``--json``.  (``save_results``, not ``save``: nnsight 0.8 gives every object a ``save``
    attribute, which a dataclass field of that name with no default would take as its default.)"""

    save_results: bool
    quiet: bool
    as_json: bool

    @property
    def progress(self) -> bool:
        """Whether to show progress bars (:func:`actstore.core.progress.progress_wanted`)."""
        from actstore.core.progress import progress_wanted

        return progress_wanted(self.quiet)

    def lines(self) -> Callable[[str], None] | None:
        """The progress lines' callback (:func:`progress_lines`)."""
        return progress_lines(self.quiet, self.as_json)


def run_options(fn: F) -> F:
    """``--no-save``, ``--quiet`` and ``--json``, given to the command as one argument ``run``
    (:class:`Run`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, no_save: bool, quiet: bool, as_json: bool, **kwargs: Any) -> Any:
        return fn(*args, run=Run(save_results=not no_save, quiet=quiet, as_json=as_json), **kwargs)

    return no_save_option(quiet_option(json_option(wrapper)))  # type: ignore[return-value]


def job(name: str | None = None, *, example: str) -> Callable[[Callable[..., Any]], click.Command]:
    """The head of a command that runs a job on a store: :func:`command`, ``--threads``
    (:func:`threads_option`) and STORE (:func:`store_argument`)."""

    def deco(fn: Callable[..., Any]) -> click.Command:
        return command(name, example=example)(store_argument(threads_option(fn)))

    return deco


def no_save_option(fn: F) -> F:
    return click.option("--no-save", is_flag=True, help="Do not write result tables into the store.")(fn)


def bounded_option(flag: str, default: float, help: str, *, low: float = 1) -> Callable[[F], F]:
    """``flag``: a number at least ``low`` (an int option for an int default, a float one otherwise),
    its default shown in the help."""
    kind = click.IntRange(min=int(low)) if isinstance(default, int) else click.FloatRange(min=low)
    return click.option(flag, type=kind, default=default, show_default=True, help=help)


def figures_option(help: str = "Folder for the figures (PNG).") -> Callable[[F], F]:
    return click.option("--figures", default=None, metavar="DIR", help=help)


def layers_option(help: str = "Layer subset, e.g. 0,3,5-7 (default: all).") -> Callable[[F], F]:
    return click.option("--layers", default=None, metavar="LIST", help=help)


def heads_option(help: str = "Head subset, e.g. 0-3 (default: all).") -> Callable[[F], F]:
    return click.option("--heads", default=None, metavar="LIST", help=help)


def model_option(help: str) -> Callable[[F], F]:
    """``--model`` of a command whose config has no model (the jobs that run the store's model take
    theirs from :class:`actstore.jobs.settings.StoreModelRun`)."""
    return click.option("--model", "model", default=None, help=help)


def _sql_memory(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from actstore.core.errors import QueryError
    from actstore.core.sql_limits import check_memory_limit

    try:
        return check_memory_limit(value)
    except QueryError as e:
        raise click.BadParameter(str(e)) from None


def _where(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--where``: parsed as exactly one SQL expression before the command runs."""
    if value is None or not value.strip():
        return value
    from actstore.core.errors import QueryError
    from actstore.core.sql import predicate

    try:
        predicate(value)
    except QueryError as e:
        raise click.BadParameter(str(e)) from None
    return value + "\n" if "--" in value else value  # a trailing -- comment ends before whatever follows


def sql_limit_options(fn: F) -> F:
    """``--sql-memory`` and ``--sql-timeout``: the limits of every SQL statement the command runs."""
    from actstore.core.sql_limits import DEFAULT_MEMORY_LIMIT, DEFAULT_TIMEOUT

    @functools.wraps(fn)
    def wrapper(*args: Any, sql_memory: str, sql_timeout: float, **kwargs: Any) -> Any:
        from actstore.core.sql_limits import limits

        with limits(memory_limit=sql_memory, timeout=sql_timeout):
            return fn(*args, **kwargs)

    wrapper = click.option(
        "--sql-timeout",
        type=click.FloatRange(min=0),
        default=DEFAULT_TIMEOUT,
        show_default=True,
        help="Seconds one SQL statement may run (0: no limit).",
    )(wrapper)
    wrapper = click.option(
        "--sql-memory",
        default=DEFAULT_MEMORY_LIMIT,
        show_default=True,
        callback=_sql_memory,
        help="Memory one SQL statement may use, e.g. 512MB; nothing spills to disk.",
    )(wrapper)
    return wrapper  # type: ignore[return-value]


WHERE_HELP = "SQL predicate over the examples table choosing the rows, e.g. \"relation_id = 'P177'\"."


def where_option(fn: F) -> F:
    """``--where`` (one SQL predicate over the examples table, checked before the command runs) and
    the SQL limit options."""
    return click.option("--where", default=None, callback=_where, help=WHERE_HELP)(sql_limit_options(fn))


def check_where(store: Any, where: str | None) -> None:
    """``--where`` must read the examples table alone: the same predicate means the same rows in
    every command, whichever tables the command joins it with."""
    if where is None or not where.strip():
        return
    from actstore.core.errors import ActstoreError

    try:
        store.sql(f"SELECT example_id FROM examples WHERE ({where}\n) LIMIT 0")
    except ActstoreError as e:
        raise click.BadParameter(
            f"a predicate over the examples table's columns: {e}", param_hint="--where"
        ) from None


def open_store_arg(path: str) -> Any:
    import actstore

    return actstore.open(path)


def option_names(params: Sequence[click.Parameter]) -> dict[str, str]:
    """Parameter name -> its (first long) option spelling, for naming settings in errors."""
    out: dict[str, str] = {}
    for p in params:
        if isinstance(p, click.Option) and p.name:
            longs = [o for o in p.opts if o.startswith("--")]
            out[p.name] = longs[0] if longs else p.opts[0]
    return out


def name_settings(command: click.Command, error: Exception) -> None:
    """Rewrite an :class:`actstore.core.errors.InvalidSetting` to name the command's option for the
    setting (``--model: ...``) instead of the library's parameter (``model: ...``)."""
    from actstore.core.errors import InvalidSetting

    if isinstance(error, InvalidSetting):
        names = option_names(
            command.params
        )  # a setting ``layers`` is the option ``--layer`` where there is one
        flag = (
            names.get(error.setting)
            or names.get(error.setting.rstrip("s"))
            or "--" + error.setting.replace("_", "-")
        )
        error.args = (f"{flag}: {error.detail}",)
