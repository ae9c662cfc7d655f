"""A store's size, one way: ``info`` (text and ``--json``), the report's summary and the explorer's store
page all call :func:`store_size` and print it with :func:`human_size`.

``total`` is every file under the store's root (what ``du`` counts); ``weights`` the part of it that is
the model's weights (``weights/``), shown on a line of its own. A store whose weights are in the
shared cache (``--weights shared``, :mod:`actstore.core.weight_store`) has none of its own: the
shared copy's bytes (``shared``, not part of ``total``: every store of the model uses the same copy)
and where it is are said on the weights line (:meth:`StoreSize.weights_line`).

Part of the store core: imports nothing from ``ingest`` or ``query``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from actstore.core.errors import ActstoreError
from actstore.core.storage import locate
from actstore.core.store import StoreReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreSize:
    total: int | None  # bytes of every file of the store (None: the storage does not say)
    weights: int | None  # bytes of its own weights (part of ``total``)
    where: str = "store"  # where its readers find the weights: store, shared, none or missing
    shared: int | None = None  # bytes of the shared copy it uses (not part of ``total``)
    shared_path: str = ""

    def to_dict(self) -> dict[str, int | str | None]:
        return {
            "bytes": self.total,
            "weights_bytes": self.weights,
            "weights_where": self.where,
            "weights_shared_bytes": self.shared,
            "weights_shared_path": self.shared_path or None,
        }

    def weights_line(self) -> str:
        """The weights' size and where they live, in a few words (``info``'s weights line)."""
        if self.where == "shared":
            return (
                f"{human_size(self.shared)} shared (not counted above; every store of this model uses "
                f"it): {self.shared_path}"
            )
        if self.where == "none":
            return "none (ingested with --weights none: analyses that need them refuse)"
        if self.where == "missing":
            return "missing (neither in the store nor in the shared cache: actstore verify says more)"
        return f"{human_size(self.weights)} of it, in the store"


def store_size(store: StoreReader) -> StoreSize:
    """The bytes of ``store`` on its storage, of its own weights among them, and of the shared copy of
    the weights it uses."""
    try:
        total, own = store.location.tree_bytes(""), store.location.tree_bytes("weights")
    except (OSError, NotImplementedError) as e:  # a backend without sizes, or refusing to list
        log.warning("the size of %s is unknown (%s: %s)", store.url, type(e).__name__, e)
        total, own = None, None
    try:
        record, src = store.weights_record, store.weights_source
    except ActstoreError:  # a malformed weights.json: verify names it
        return StoreSize(total, own, "missing")
    if src is None:
        return StoreSize(total, own, "none" if record is not None and record.mode == "none" else "missing")
    if src.kind == "store":
        return StoreSize(total, own)
    return StoreSize(total, own, "shared", locate(src.where).tree_bytes(""), src.where)


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
