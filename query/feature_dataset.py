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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from actstore.core.errors import QueryError
from actstore.query.features import FeatureSpec, RowBlock, compute_block
from actstore.query.labelled import SOURCE_KINDS, pad_sources

if TYPE_CHECKING:
    from actstore.query.selection import Selection


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
    ) -> None:
        if batch_rows < 1:
            raise QueryError(f"batch_rows must be at least 1 (got {batch_rows})")
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
            values = [str(v) for v in selection.table([label]).column(0).to_pylist()]
            self.classes = sorted(set(values))
            self.labels = np.searchsorted(
                np.asarray(self.classes, dtype=object), np.asarray(values, dtype=object)
            )
            self.labels = self.labels.astype(np.int64)  # [n], index into classes

    def __len__(self) -> int:
        return len(self.selection)

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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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
            rows = rng.permutation(x.shape[0]) if rng is not None else range(x.shape[0])
            for i in rows:
                yield xt[i], y[i]
