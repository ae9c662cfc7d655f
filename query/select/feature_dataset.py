"""A ``torch.utils.data`` dataset that streams a selection's features for training.

    ds = FeatureDataset(store.select("split = 'train'"), "attn_head", layers=[3, 4], label="relation_id")
    loader = torch.utils.data.DataLoader(ds, batch_size=64)   # x [64, 2, H, d_model], y [64] int64
    for epoch in range(10):
        ds.set_epoch(epoch)                                     # a new order per epoch when shuffling
        for x, y in loader:
            ...

Features are computed one block of rows at a time (one segment, or ``batch_rows`` rows of one), so
memory holds one block, never the whole selection.  ``shuffle=True`` permutes the blocks and the rows
inside each block (a block-local shuffle: every row once per epoch, reproducible from ``seed`` and
the epoch).  With ``DataLoader(num_workers=k)`` each worker streams every k-th block.

``batch_size=B`` makes it yield batches instead of rows: ``x [B, ...]`` and ``y [B]``, the same rows in
the same order as a ``DataLoader(ds, batch_size=B)`` over the row dataset collates (the last batch may
be shorter), without a tensor and a collate per row (use ``DataLoader(ds, batch_size=None)``)::

    loader = torch.utils.data.DataLoader(FeatureDataset(sel, "resid", layers=[6], batch_size=256), batch_size=None)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import IterableDataset, get_worker_info

from actstore.core.errors import QueryError
from actstore.query.select.features import FeatureSpec, RowBlock, compute_block
from actstore.query.select.labelled import SOURCE_KINDS, pad_sources

if TYPE_CHECKING:
    from actstore.query.select.selection import Selection


class FeatureDataset(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """(features, label) per selected row: features as :meth:`Selection.features` gives one row of
    them (float32 tensor, source kinds zero-padded to the selection's longest source, or flattened
    to [F] with ``flatten=True``), label the index of the row's ``label`` value (a column of
    ``examples``) in :attr:`classes` (int64 scalar tensor; -1 for every row when ``label`` is None).
    """

    def __init__(
        self,
        selection: Selection,
        kind: str,
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        groups: int | None = None,
        label: str | None = "relation_id",
        batch_rows: int = 256,
        shuffle: bool = False,
        seed: int = 0,
        flatten: bool = False,
        batch_size: int | None = None,
    ) -> None:
        if batch_rows < 1:
            raise QueryError(f"batch_rows must be at least 1 (got {batch_rows})")
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise QueryError(f"batch_size must be at least 1 or None (got {batch_size!r})")
        self.batch_size = batch_size
        self.selection = selection
        self.spec = FeatureSpec.parse(selection.store, kind, layers, heads, groups)
        self.batch_rows = batch_rows
        self.shuffle = shuffle
        self.seed = seed
        self.flatten = flatten
        self.epoch = 0
        self.n_sources = selection.n_sources() if kind in SOURCE_KINDS else None
        self.example_ids = selection.example_ids  # [n]
        if label is None:
            self.classes: list[str] = []
            self.labels = np.full(len(selection), -1, dtype=np.int64)
        else:
            self.classes, self.labels = _label_indices(selection, label)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from now on (with ``shuffle``)."""
        self.epoch = int(epoch)

    def _blocks(self) -> list[tuple[int, RowBlock]]:
        """(offset of the block's first row in the selection, block) in selection order."""
        out, at = [], 0
        for ids, block in self.selection.blocks(self.batch_rows):
            out.append((at, block))
            at += len(ids)
        return out

    def __len__(self) -> int:
        """Rows, or batches with ``batch_size`` (the last may be shorter)."""
        n = len(self.selection)
        return n if self.batch_size is None else -(-n // self.batch_size)

    def _block_rows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) of each block in the order of the epoch (rows permuted within a block when shuffling)."""
        blocks = self._blocks()
        rng = np.random.default_rng([self.seed, self.epoch]) if self.shuffle else None
        order = rng.permutation(len(blocks)) if rng is not None else np.arange(len(blocks))
        info = get_worker_info()
        if info is not None:
            order = order[info.id :: info.num_workers]
        store = self.selection.store
        for b in order.tolist():
            at, block = blocks[b]
            x = compute_block(store, self.spec, block)
            if self.n_sources is not None:
                x = pad_sources(x, self.n_sources)
            if self.flatten:
                x = x.reshape(x.shape[0], -1)
            xt = torch.from_numpy(np.ascontiguousarray(x))
            y = torch.from_numpy(self.labels[at : at + x.shape[0]])
            if rng is not None:
                perm = torch.from_numpy(rng.permutation(x.shape[0]))
                xt, y = xt[perm], y[perm]
            yield xt, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.batch_size is None:
            for xt, y in self._block_rows():
                for i in range(xt.shape[0]):
                    yield xt[i], y[i]
            return
        size = self.batch_size
        xs: list[torch.Tensor] = []
        ys: list[torch.Tensor] = []
        held = 0
        for xt, y in self._block_rows():
            xs.append(xt)
            ys.append(y)
            held += xt.shape[0]
            if held < size:
                continue
            x_all, y_all = (torch.cat(xs), torch.cat(ys)) if len(xs) > 1 else (xs[0], ys[0])
            full = held - held % size
            for i in range(0, full, size):
                yield x_all[i : i + size], y_all[i : i + size]
            xs, ys = ([x_all[full:]], [y_all[full:]]) if held > full else ([], [])
            held -= full
        if held:
            yield (torch.cat(xs) if len(xs) > 1 else xs[0]), (torch.cat(ys) if len(ys) > 1 else ys[0])


def _label_indices(selection: Selection, label: str) -> tuple[list[str], np.ndarray]:
    """The sorted distinct values of column ``label`` of the selection's examples (as ``str``), and
    each row's index into them [n] int64.  ``relation_id`` comes with the selection's rows (no query);
    a string column without nulls is indexed by Arrow, any other through Python's ``str``."""
    col = selection.rows.column(label) if label == "relation_id" else selection.table([label]).column(0)
    if pa.types.is_string(col.type) and col.null_count == 0:
        classes = sorted(pc.unique(col).to_pylist())
        idx = pc.index_in(col, value_set=pa.array(classes, pa.string()))
        return classes, idx.to_numpy().astype(np.int64)
    values = [str(v) for v in col.to_pylist()]
    classes = sorted(set(values))
    labels = np.searchsorted(np.asarray(classes, dtype=object), np.asarray(values, dtype=object))
    return classes, labels.astype(np.int64)
