"""Progress bars, one way: tqdm on stderr, sized to the terminal, off when not wanted.

    bar = progress_bar(total=len(items), desc="ingest", unit="prompt", enabled=not quiet)
    for item in items:
        ...
        bar.update(1)
    bar.close()

Part of the store core: imports nothing from ``ingest`` or ``query``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
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
    """A ``tqdm.auto.tqdm`` bar on stderr (``disable`` when not ``enabled``); wraps ``iterable`` when given."""

    return tqdm(
        iterable, total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True
    )
