"""Progress bars, one way: tqdm on stderr, sized to the terminal, off when not wanted.

    bar = progress_bar(total=len(items), desc="ingest", unit="prompt", enabled=not quiet)
    for item in items:
        ...
        bar.update(1)
    bar.close()

Part of the store core: imports nothing from ``ingest`` or ``query``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable
from typing import Any

from tqdm.auto import tqdm


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
) -> Any:
    """A ``tqdm.auto.tqdm`` bar on stderr (``disable`` when not ``enabled``); wraps ``iterable`` when given.
    A terminal that reports no width (0 columns: a fresh pseudo-terminal) gets 80 columns, not an empty bar."""

    sized = shutil.get_terminal_size((0, 0)).columns > 0
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=sized,
        ncols=None if sized else 80,
        nrows=None if sized else 24,  # tqdm hides a bar below a terminal's last row: 0 rows hide every bar
    )


#: Set to 1 to show progress on a stderr that is not a terminal (a log file, CI), 0 to never show it.
PROGRESS_ENV = "ACTSTORE_PROGRESS"


def progress_wanted(quiet: bool = False) -> bool:
    """Whether a command shows progress: never with ``quiet``, else when stderr is a terminal (or
    ``$ACTSTORE_PROGRESS`` is 1; 0 turns it off everywhere)."""
    if quiet:
        return False
    asked = os.environ.get(PROGRESS_ENV, "")
    if asked in ("0", "1"):
        return asked == "1"
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress_callback(bar: Any) -> Callable[[int], None]:
    """``bar.update`` as a plain callback (for library functions that take ``progress(n)``)."""

    def update(n: int = 1) -> None:
        bar.update(n)

    return update


def say_nothing(message: str) -> None:
    """A log that drops its lines: the default ``log`` of a job or a lock."""
