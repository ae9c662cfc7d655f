"""How an analysis that reads the store's tables applies a selection of rows: the selection's example
ids bound as a parameter, never a predicate pasted into the statement."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Rows(Protocol):
    """A selection of rows (:class:`actstore.query.select.selection.Selection` is one)."""

    @property
    def example_ids(self) -> np.ndarray: ...


def rows_condition(
    rows: Rows | None, column: str = "example_id", name: str = "rows"
) -> tuple[str, dict[str, Any]]:
    """A SQL condition keeping the example ids of ``rows`` (every row when None) in ``column``, and the
    parameters it binds (``$name``)."""
    if rows is None:
        return "TRUE", {}
    # a semi-join on the unnested list: about 3x faster than list_contains at 10^5-10^6 ids
    return f"{column} IN (SELECT unnest(${name}::BIGINT[]))", {name: [int(i) for i in rows.example_ids]}
