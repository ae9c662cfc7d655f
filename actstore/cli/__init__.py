"""The ``actstore`` command line: one module per group of commands, shared options in
:mod:`actstore.cli._options`.

Command modules only parse options, call library functions and print.  Heavy modules (torch,
transformers, the ingest and query packages) are imported inside the command functions, so
``actstore --help`` and ``actstore sql`` start fast.

Errors: one ``error: ...`` line on stderr, or with ``--json`` one JSON object
``{"error": ..., "type": ..., "exit_code": ...}`` on stdout; ``--debug`` (before the command)
prints the traceback first.  Exit codes: 0 success, 1 error, 2 usage error, 3 ``verify`` found
damage, 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click

from actstore.cli._options import parse_int_list, printable, sql_limit_options, where_option
from actstore.core.errors import ActstoreError, InvalidSetting

from . import ablate as _ablate
from . import demo as _demo
from . import dfa as _dfa
from . import importing as _importing
from . import ingest as _ingest
from . import interventions as _interventions
from . import maps as _maps
from . import methods as _methods
from . import probe as _probe
from . import report as _report
from . import serve as _serve
from . import store as _store
from . import study as _study
from . import topk as _topk

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DAMAGED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXPECTED = (ActstoreError, ValueError, OSError, KeyError)  # errors with a message meant for the user


def _flags_before_command(args: Sequence[str], group: click.Group) -> list[str]:
    out = []
    for a in args:
        if a in group.commands or a == "--":
            break
        out.append(a)
    return out


def _json_requested(args: Sequence[str]) -> bool:
    return "--json" in list(args)[: list(args).index("--")] if "--" in args else "--json" in args


class ActstoreGroup(click.Group):
    """The top-level group: every error becomes one line (or one JSON object) and an exit code."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,  # type: ignore[override]
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in _flags_before_command(argv, self) or os.environ.get(
            "ACTSTORE_DEBUG", ""
        ) not in ("", "0")
        as_json = _json_requested(argv)
        silent = "--quiet" in argv or (as_json and not sys.stderr.isatty())  # a piped --json: no progress
        setup_logging(logging.DEBUG if debug else logging.WARNING if silent else logging.INFO)

        def fail(message: str, code: int, kind: str) -> None:
            if debug and sys.exc_info()[0] is not None:
                traceback.print_exc(file=sys.stderr)
            text = " ".join(str(message).split())
            if as_json:
                click.echo(json.dumps({"error": text, "type": kind, "exit_code": code}))
            else:
                click.echo(f"error: {printable(text)}", err=True)
            sys.exit(code)

        try:
            rv = super().main(argv, prog_name, complete_var, False, **extra)
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare ``actstore``: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            fail(e.format_message() + where, e.exit_code, "UsageError")
        except click.ClickException as e:
            fail(e.format_message(), e.exit_code, type(e).__name__)
        except (click.exceptions.Abort, KeyboardInterrupt):
            fail("interrupted", EXIT_INTERRUPTED, "KeyboardInterrupt")
        except KeyError as e:
            fail(f"missing {e}", EXIT_ERROR, type(e).__name__)
        except InvalidSetting as e:  # a value the command refuses before any work: a usage error
            fail(str(e), EXIT_USAGE, type(e).__name__)
        except EXPECTED as e:
            fail(str(e), EXIT_ERROR, type(e).__name__)
        except Exception as e:  # a bug: say so, and how to see where
            fail(
                f"internal error: {type(e).__name__}: {e}"
                + ("" if debug else " (run 'actstore --debug ...' for the traceback)"),
                EXIT_ERROR,
                type(e).__name__,
            )
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stderr`` of the moment (click's test runner swaps it per invocation)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("actstore: %(message)s"))
#: The packages whose library messages (``logging.getLogger(__name__)``) the command line shows.
LOGGED_PACKAGES = ("actstore", "ingest", "query")


def setup_logging(level: int) -> None:
    """Show the library's log messages on stderr as ``actstore: MESSAGE`` from ``level`` up (INFO by
    default, WARNING with ``--quiet``, DEBUG with ``--debug``); calling it again only changes the level."""
    for name in LOGGED_PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
        logger.propagate = False


@click.group(
    cls=ActstoreGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="\b\nExample:\n  actstore ingest --model tiny-llama --out /tmp/s\n  actstore info /tmp/s\n\n"
    "\b\nExit codes: 0 ok, 1 error, 2 usage error, 3 verify found damage, 130 interrupted.",
)
@click.version_option(package_name="actstore")
@click.option("--debug", is_flag=True, help="Print the traceback of an error (or set ACTSTORE_DEBUG=1).")
def main(debug: bool) -> None:
    """actstore: ingest a corpus once with fused capture, then query per-head and per-token features."""


for _module in (
    _store,
    _ingest,
    _probe,
    _maps,
    _interventions,
    _ablate,
    _methods,
    _study,
    _report,
    _serve,
    _demo,
    _topk,
    _dfa,
    _importing,
):
    for _cmd in _module.COMMANDS:
        main.add_command(_cmd)

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "main",
    "parse_int_list",
    "printable",
    "sql_limit_options",
    "where_option",
]
