"""Max-activating contexts: for every unit of one layer, the ``k`` selected rows where it is largest, in
one streaming pass (``actstore topk``).

Units (``kind``):

- ``mlp``: each MLP neuron of the layer: the stored activation ``a(t)`` (the input of the down
  projection), ``d_mlp`` units;
- ``attn_head``: each head's output norm ``||Delta_att,h(t)||_2`` (``H`` units);
- ``direction``: the projection ``x(t) . w`` of the features of ``on`` (a fixed-size kind:
  ``resid``, ``mlp``, ``attn``, ...) at the layer onto each row of ``directions`` ([m, F], e.g. a
  probe's weights): ``m`` units.

Memory holds the running top ``k`` of every unit (``k`` x units values and rows) and one block of
rows; each block is merged with ``numpy.argpartition`` (``O((k + b) * units)`` per block of ``b``
rows).  Rows with equal values are ordered by store row.  The result is one row per (unit, rank):
``unit, rank, row, example_id, position, value`` (``rank`` 0 the largest), in unit then rank order.

A corpus store's row is one token of a document: :func:`position_contexts` gives the text around it
(the tokens of the same window before and after it, from the ``positions`` table), what a reader needs
to see why a unit fires.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from actstore.core.errors import QueryError
from actstore.core.progress import progress_bar
from actstore.query.select.features import KINDS, SOURCE_KINDS, FeatureSpec, compute_block

if TYPE_CHECKING:
    from actstore.query.select.selection import Selection

TOPK_KINDS = ("mlp", "attn_head", "direction")
TOPK_SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string()),
        pa.field("layer", pa.int64()),
        pa.field("unit", pa.int64()),
        pa.field("rank", pa.int64()),
        pa.field("row", pa.int64()),
        pa.field("example_id", pa.int64()),
        pa.field("position", pa.int64()),
        pa.field("value", pa.float32()),
    ]
)


@dataclass(frozen=True)
class TopK:
    """The top ``k`` of each unit: ``values`` and store ``rows`` [units, k'] (k' = min(k, rows)),
    largest first; ``table`` as recorded."""

    kind: str
    layer: int
    values: np.ndarray
    rows: np.ndarray
    table: pa.Table


def _check(
    selection: Selection, kind: str, layer: int, k: int, on: str, directions: np.ndarray | None
) -> np.ndarray | None:
    store = selection.store
    if kind not in TOPK_KINDS:
        raise QueryError(f"topk: kind must be one of {', '.join(TOPK_KINDS)} (got {kind!r})")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= 10_000:
        raise QueryError(f"topk: k must be an integer between 1 and 10000 (got {k!r})")
    spec_kind = on if kind == "direction" else ("mlp" if kind == "mlp" else "attn_head")
    if kind == "direction":
        if on not in KINDS or on in SOURCE_KINDS:
            raise QueryError(f"topk: --on must be a fixed-size feature kind, not {on!r}")
        if directions is None:
            raise QueryError("topk: kind 'direction' needs directions (an [m, F] array)")
    FeatureSpec.parse(store, spec_kind, [layer], None)  # the layer's range, one line
    if kind != "direction":
        return None
    d = np.asarray(directions, dtype=np.float32)
    d = d[None] if d.ndim == 1 else d
    probe = next(selection.limit(1).iter_features(on, layers=[layer], batch_rows=1))[1]
    F = int(np.prod(probe.shape[1:]))
    if d.ndim != 2 or d.shape[1] != F or d.shape[0] < 1:
        raise QueryError(f"topk: directions must be [m, {F}] for {on} (got {list(d.shape)})")
    if not np.isfinite(d).all():
        raise QueryError("topk: directions hold a NaN or infinite value")
    return d


def _blocks(
    selection: Selection,
    kind: str,
    layer: int,
    on: str,
    directions: np.ndarray | None,
    batch_rows: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(store rows [b], values [b, units]) per block of the selection, in selection order."""
    store = selection.store
    row_col = selection.rows.column("row").to_numpy()
    at = 0
    if kind == "mlp":
        for _ids, block in selection.blocks(batch_rows):
            a = store.read_segment_rows(block.segment, "mlp", block.seg_rows, [layer])[:, 0]  # [b, d_mlp]
            yield row_col[at : at + a.shape[0]], a
            at += a.shape[0]
        return
    spec = FeatureSpec.parse(store, "attn_head" if kind == "attn_head" else on, [layer], None)
    for _ids, block in selection.blocks(batch_rows):
        x = compute_block(store, spec, block)
        b = x.shape[0]
        if kind == "attn_head":
            v = np.linalg.norm(x[:, 0], axis=-1)  # [b, H]
        else:
            assert directions is not None
            v = x.reshape(b, -1) @ directions.T  # [b, m]
        yield row_col[at : at + b], v.astype(np.float32, copy=False)
        at += b


def top_activations(
    selection: Selection,
    kind: str,
    layer: int,
    k: int = 20,
    *,
    on: str = "resid",
    directions: np.ndarray | Sequence[Sequence[float]] | None = None,
    batch_rows: int = 1024,
    progress: bool = False,
) -> TopK:
    """The ``k`` largest values of every unit over the selection, in one pass (see the module);
    ``progress``: a bar of the rows read on stderr."""
    d = _check(selection, kind, layer, k, on, None if directions is None else np.asarray(directions))
    if len(selection) == 0:
        raise QueryError("topk: the selection is empty")
    k = int(k)
    best_v: np.ndarray | None = None  # [k', U]
    best_r: np.ndarray | None = None
    bar = progress_bar(total=len(selection), desc=f"topk {kind} layer {layer}", unit="row", enabled=progress)
    for rows, v in _blocks(selection, kind, layer, on, d, batch_rows):
        bar.update(len(rows))
        r = np.broadcast_to(rows[:, None], v.shape)
        if best_v is not None and best_r is not None:
            v = np.concatenate([best_v, v])
            r = np.concatenate([best_r, r])
        if v.shape[0] > k:
            # keep the top k by (value desc, row asc): rank the values, break ties by the row
            keep = _top_rows(v, r, k)
            v = np.take_along_axis(v, keep, 0)
            r = np.take_along_axis(r, keep, 0)
        best_v, best_r = np.ascontiguousarray(v), np.ascontiguousarray(r)
    bar.close()
    assert best_v is not None and best_r is not None
    order = np.lexsort((best_r, -best_v), axis=0)  # per unit: value desc, then row asc
    values = np.take_along_axis(best_v, order, 0).T  # [U, k']
    rows_out = np.take_along_axis(best_r, order, 0).T
    return TopK(kind, layer, values, rows_out, _table(selection, kind, layer, values, rows_out))


@dataclass(frozen=True)
class Context:
    """The text of a corpus row's token and of the tokens of its window around it."""

    before: str
    token: str
    after: str


def position_contexts(
    store: object, rows: Sequence[int], before: int = 12, after: int = 4
) -> dict[int, Context]:
    """For each row of a corpus store (``--positions all``), the ``before`` tokens of its window that
    precede it and the ``after`` that follow, as text: the tokens' characters in the document, a space
    where the document has characters between two tokens.  Rows are consecutive tokens of a window in
    corpus order, so one query over ``positions`` by row ranges reads them all (``O(len(rows) *
    (before + after))`` rows, pruned by the compacted files' row statistics)."""
    want = sorted({int(r) for r in rows})
    if not want:
        return {}
    ranges = np.unique(np.concatenate([np.arange(max(r - before, 0), r + after + 1) for r in want]))
    got = store.sql(  # type: ignore[attr-defined]
        "SELECT row, document, window_index, token, char_start, char_end FROM positions "
        "WHERE row IN (SELECT unnest($r::BIGINT[])) ORDER BY row",
        {"r": ranges.tolist()},
    ).to_pydict()
    at = {int(r): i for i, r in enumerate(got["row"])}

    def text(i: int, j: int) -> str:  # tokens i..j-1 (indices into got), joined as in the document
        out = ""
        for x in range(i, j):
            gap = x > i and got["char_start"][x] > got["char_end"][x - 1] >= 0
            out += (" " if gap else "") + str(got["token"][x])
        return out

    contexts: dict[int, Context] = {}
    for r in want:
        if r not in at:
            continue
        i = at[r]
        key = (got["document"][i], got["window_index"][i])
        lo = i
        while lo > 0 and i - lo < before and (got["document"][lo - 1], got["window_index"][lo - 1]) == key:
            lo -= 1
        hi = i + 1
        while (
            hi < len(got["row"]) and hi - i <= after and (got["document"][hi], got["window_index"][hi]) == key
        ):
            hi += 1
        left = text(lo, i) + (" " if lo < i and got["char_start"][i] > got["char_end"][i - 1] >= 0 else "")
        right = (" " if hi > i + 1 and got["char_start"][i + 1] > got["char_end"][i] >= 0 else "") + text(
            i + 1, hi
        )
        contexts[r] = Context(left, str(got["token"][i]), right)
    return contexts


def _top_rows(v: np.ndarray, r: np.ndarray, k: int) -> np.ndarray:
    """Indices (along axis 0) of the top ``k`` of each column by value, ties broken toward the smaller row."""
    part = np.argpartition(-v, k - 1, axis=0)[:k]  # the k largest, in no order; ties at the edge arbitrary
    kth = np.take_along_axis(v, part, 0).min(axis=0)  # the k-th value of each unit
    tied = (v == kth[None]).sum(axis=0) > (np.take_along_axis(v, part, 0) == kth[None]).sum(axis=0)
    if not tied.any():
        return part
    for u in np.flatnonzero(tied):  # rare: more rows equal the k-th value than fit; take the smallest rows
        order = np.lexsort((r[:, u], -v[:, u]))
        part[:, u] = order[:k]
    return part


def _table(selection: Selection, kind: str, layer: int, values: np.ndarray, rows: np.ndarray) -> pa.Table:
    U, kk = values.shape
    sel_rows = selection.rows
    row_col = sel_rows.column("row").to_numpy()
    order = np.argsort(row_col)
    flat = rows.reshape(-1)
    at = order[np.searchsorted(row_col, flat, sorter=order)]
    example = sel_rows.column("example_id").to_numpy()[at]
    pos = selection.store.sql(
        "SELECT row, position FROM targets WHERE row IN (SELECT unnest($r::BIGINT[]))",
        {"r": sorted({int(x) for x in flat})},
    )
    pos_of = dict(zip(pos.column("row").to_pylist(), pos.column("position").to_pylist()))
    return pa.table(
        {
            "kind": pa.array([kind] * (U * kk), pa.string()),
            "layer": pa.array(np.full(U * kk, layer, np.int64)),
            "unit": pa.array(np.repeat(np.arange(U, dtype=np.int64), kk)),
            "rank": pa.array(np.tile(np.arange(kk, dtype=np.int64), U)),
            "row": pa.array(flat.astype(np.int64)),
            "example_id": pa.array(example.astype(np.int64)),
            "position": pa.array([int(pos_of[int(x)]) for x in flat], pa.int64()),
            "value": pa.array(values.reshape(-1).astype(np.float32)),
        },
        schema=TOPK_SCHEMA,
    )
