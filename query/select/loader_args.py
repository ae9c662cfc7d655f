"""The training feed's arguments: what it reads of a selection, its keyword options (for type checkers)
and the checks of its numbers and dtype (:mod:`actstore.query.select.loader`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypedDict

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import QueryError
from actstore.core.store import StoreReader


class Selected(Protocol):
    """What the loader reads of a selection (:class:`actstore.query.select.selection.Selection` is one; named
    by this protocol so that the selection module can import this one)."""

    store: StoreReader

    @property
    def rows(self) -> pa.Table: ...

    def n_sources(self) -> int: ...


DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def int_arg(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise QueryError(f"loader: {name} must be an integer, not {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise QueryError(f"loader: {name} must be {rng} (got {v})")
    return v


def dtype_arg(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise QueryError(f"loader: dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")


class LoaderOptions(TypedDict, total=False):
    """The keyword options of :class:`ActivationLoader` (and :meth:`Selection.loader`), for type
    checkers; their defaults are written once, in ``ActivationLoader.__init__``."""

    layers: Sequence[int] | None
    heads: Sequence[int] | None
    groups: int | None
    batch_size: int
    shuffle: bool
    seed: int
    buffer_rows: int
    workers: int
    prefetch: int | None
    rank: int
    world_size: int
    dtype: torch.dtype | str
    with_ids: bool
    drop_last: bool
    flatten: bool
    unit_rows: int | None
    epochs: int | None


__all__ = ["DTYPES", "LoaderOptions", "Selected"]
