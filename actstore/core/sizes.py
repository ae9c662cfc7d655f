"""A store's size, one way: ``info`` (text and ``--json``), the report's summary and the explorer's store
page all call :func:`store_size` and print it with :func:`human_size`.

``total`` is every file under the store's root (what ``du`` counts); ``weights`` the part of it that is
the model's weights (``weights/``), shown on a line of its own.

Part of the store core: imports nothing from ``ingest`` or ``query``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from actstore.core.store import StoreReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreSize:
    total: int | None  # bytes of every file of the store (None: the storage does not say)
    weights: int | None  # bytes of its weights (part of ``total``)

    def to_dict(self) -> dict[str, int | None]:
        return {"bytes": self.total, "weights_bytes": self.weights}


def store_size(store: StoreReader) -> StoreSize:
    """The bytes of ``store`` on its storage, and of its weights among them."""
    try:
        return StoreSize(store.location.tree_bytes(""), store.location.tree_bytes("weights"))
    except (OSError, NotImplementedError) as e:  # a backend without sizes, or refusing to list
        log.warning("the size of %s is unknown (%s: %s)", store.url, type(e).__name__, e)
        return StoreSize(None, None)


def human_size(n: int | None) -> str:
    """``n`` bytes in binary units (``361.2 MiB``); ``unknown`` for None."""
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"
