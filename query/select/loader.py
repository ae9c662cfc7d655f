"""A shuffled, resumable, rank-split training feed of a selection's features (``Selection.loader``).

    feed = store.select().loader("resid", layers=[6], batch_size=4096, buffer_rows=1 << 16)
    for epoch in range(3):                      # the epoch advances by itself (or feed.set_epoch(e))
        for x in feed:                          # x: torch [4096, 1, d_model] float32
            ...
        ckpt = feed.state_dict()                # mid-epoch too: resume with feed.load_state_dict(ckpt)

The order of an epoch, for ``N`` selected rows, is fixed before anything is read:

1. **Units.** The selected rows are grouped by storage chunks: a unit is a run of ``unit_rows // chunk_rows``
   whole chunks of one segment (``chunk_rows`` rows of ``z``, ``mlp`` and ``resid`` per chunk file or
   shard of layer chunks; ``unit_rows`` defaults to 256 rows, or one chunk where chunks are longer
   (a corpus store's), read in one call), holding the selected rows among them.  ``shuffle=True`` permutes the
   units with ``numpy.random.default_rng([seed, epoch])``; ``shuffle=False`` keeps store order.
2. **Ranks.** The rows, in that unit order, are cut into ``world_size`` contiguous shares: rank ``r``
   gets positions ``r*N//W .. (r+1)*N//W`` (counts differ by at most one; every rank sees whole
   chunks except at most one at each end of its share).  Every rank computes the same unit order,
   so the shares are disjoint and cover every row.  ``drop_last=True`` gives every rank
   ``(N//W)//batch_size`` full batches (the same count on every rank, as DDP needs); the rows beyond
   are skipped that epoch (different ones every epoch, since the order changes).
3. **Windows.** A rank's share is cut into windows of ``buffer_rows`` rows; with ``shuffle`` the rows
   of each window are permuted in memory (``default_rng([seed, epoch, rank, window])``).  Batches
   are consecutive ``batch_size`` rows of that stream (a batch may span two windows).

So an epoch visits each row exactly once, the order is a function of ``(seed, epoch, rank,
world_size, buffer_rows)`` and the selection, and a position in it is one integer:
:meth:`ActivationLoader.state_dict` records ``(epoch, position)``; resuming re-reads the window
that holds ``position`` and skips the rows already given.

Reads: the window's rows are read one unit at a time, in store order, into a window buffer (the
stored kinds ``resid`` and ``z`` in the storage dtype, decoded by the store's chunk reader straight
into the buffer when their chunks hold exactly the chosen layers; the others by
:func:`actstore.query.select.features.compute_block`; a unit cut by a window or share boundary is read once
per side), ``prefetch`` units ahead; the window is then permuted as a whole into a second buffer
(one gather of its rows, torch, the GIL released), the first buffer handed back, and the batches are
consecutive slices of the permuted window, each copied and converted to ``dtype`` by torch: a tensor
of its own.  The first window is read by the consuming thread when the iteration starts (it waits for
it anyway); the next ones, across epoch boundaries too, by a background thread one window ahead.
Memory: at most three window buffers of ``buffer_rows`` rows in use (the one being cut, one ready,
one being read or permuted; reused across windows and epochs) plus ``prefetch`` units of at most
``unit_rows`` rows, whatever the selection's size.
Where one window holds every selected row (one rank, ``buffer_rows`` at least the selection's rows),
the first epoch's window stays in memory and each epoch after it is permuted from it in its own
order, without reading the store again (one more buffer of the selection's rows, kept by the loader).
``workers=0`` reads in the consuming thread (no threads at all); ``workers=1`` (the default) reads and
assembles in one background thread; ``workers=k >= 2`` adds a pool of ``k`` reader threads.

The order is computed in :mod:`actstore.query.select.loader_order`, the pieces are read by
:mod:`actstore.query.select.loader_reads`, the windows assembled and permuted (and the thread that
does it) in :mod:`actstore.query.select.loader_windows`; this module holds the feed: its settings and
state, and the batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from actstore.core.errors import QueryError
from actstore.query.select.features import FeatureSpec, row_shape
from actstore.query.select.labelled import SOURCE_KINDS
from actstore.query.select.loader_args import Selected, dtype_arg, int_arg
from actstore.query.select.loader_order import EpochOrder
from actstore.query.select.loader_reads import Buffers, PieceReader
from actstore.query.select.loader_windows import IN_USE, Window, WindowSource

STATE_VERSION = 1
BURST_BYTES = 1 << 21  # whole batches cut together, at most this many bytes of them (at least one batch)


class ActivationLoader:
    """An iterable of torch tensors ``[batch, *row]`` (``row`` as one row of
    :meth:`Selection.features`; ``flatten=True``: ``[batch, F]``), or of ``(row_ids, x)`` with
    ``with_ids=True`` (``row_ids`` int64: the store ``row`` of each target, the ``row`` column of
    ``selection.rows``).  See the module docstring for the order, the rank split and the memory."""

    def __init__(
        self,
        selection: Selected,
        kind: str,
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        groups: int | None = None,
        batch_size: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        buffer_rows: int = 1 << 15,
        workers: int = 1,
        prefetch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        dtype: torch.dtype | str = torch.float32,
        with_ids: bool = False,
        drop_last: bool = False,
        flatten: bool = False,
        unit_rows: int | None = None,
        epochs: int | None = 1,
    ) -> None:
        self.batch_size = int_arg("batch_size", batch_size, 1)
        self.buffer_rows = int_arg("buffer_rows", buffer_rows, 1)
        self.workers = int_arg("workers", workers, 0, 256)
        self.prefetch = int_arg("prefetch", prefetch if prefetch is not None else 2 * max(1, workers), 1)
        self.world_size = int_arg("world_size", world_size, 1)
        self.rank = int_arg("rank", rank, 0, self.world_size - 1)
        self.seed = int_arg("seed", seed, 0)
        for name, flag in (("shuffle", shuffle), ("with_ids", with_ids), ("drop_last", drop_last)):
            if not isinstance(flag, (bool, np.bool_)):
                raise QueryError(f"loader: {name} must be True or False, not {flag!r}")
        self.shuffle, self.with_ids, self.drop_last = bool(shuffle), bool(with_ids), bool(drop_last)
        self.flatten = bool(flatten)
        self.epochs = None if epochs is None else int_arg("epochs", epochs, 1)
        self.dtype = dtype_arg(dtype)
        self.selection = selection
        self.store = selection.store
        self.spec = FeatureSpec.parse(self.store, kind, layers, heads, groups)
        rows = selection.rows
        if rows.num_rows == 0:
            raise QueryError("loader: the selection is empty")
        self._n_sources = selection.n_sources() if kind in SOURCE_KINDS else 0
        # Stored kinds are read and shuffled in the storage dtype and converted by torch once per
        # window (numpy's float16 widening is several times slower, and the window is half the size).
        self._stored = self.spec.kind == "resid" or (self.spec.kind == "z" and self.spec.heads is None)
        storage = self.store.manifest.storage_dtype
        self._bf16_bits = self._stored and storage == "bfloat16"
        self._win_dtype = (
            np.dtype({"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}[storage])
            if self._stored
            else np.dtype(np.float32)
        )
        self._row_shape = row_shape(self.store, self.spec, self._n_sources)
        self._cols = {
            name: rows.column(name).to_numpy().astype(np.int64, copy=False)
            for name in ("row", "segment", "seg_row", "src_start", "n_src", "subject_start", "subject_end")
        }
        chunk_rows = self.store.manifest.chunk_rows
        default_unit = max(chunk_rows, 256 // chunk_rows * chunk_rows)
        self.unit_rows = int_arg("unit_rows", unit_rows if unit_rows is not None else default_unit, 1)
        per_unit = max(1, self.unit_rows // chunk_rows)  # whole chunks per unit
        unit_start, unit_stop = EpochOrder.units(
            self._cols["segment"], self._cols["seg_row"], chunk_rows * per_unit
        )
        self._order = EpochOrder(
            unit_start,
            unit_stop,
            batch_size=self.batch_size,
            buffer_rows=self.buffer_rows,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
        )
        self.n_rows = int(self._cols["segment"].size)
        out_bytes = int(np.prod(self._row_shape)) * torch.empty(0, dtype=self.dtype).element_size()
        self._burst = max(1, BURST_BYTES // max(1, self.batch_size * out_bytes))
        self._buffers = Buffers()
        self._shape = (min(self.buffer_rows, self.rows_per_epoch), *self._row_shape)
        # One window holds every selected row (one rank, buffer_rows >= rows): the first epoch's window
        # stays (rows, ids, positions) and later epochs are gathered from it, the store not read again.
        self._source = WindowSource(
            self._order,
            PieceReader(self.store, self.spec, self._cols, self._n_sources, self._stored),
            self._buffers,
            self._shape,
            self._win_dtype,
            self._cols["row"],
            workers=self.workers,
            prefetch=self.prefetch,
            with_ids=self.with_ids,
            whole=self.world_size == 1 and self.n_rows <= self.buffer_rows,
        )
        self.epoch = 0
        self.position = 0  # rows of this rank's share already given in the current epoch
        self._next: Iterator[Any] | None = None  # the iteration ``next(feed)`` pulls from

    # -- the order ---------------------------------------------------------------------------------

    @property
    def n_units(self) -> int:
        """The units the order permutes: runs of whole storage chunks of one segment (``unit_rows``
        rows of the store, rounded down to whole chunks, at least one) that hold selected rows."""
        return self._order.n_units

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        lo, hi = self._order.share()
        return -(-(hi - lo) // self.batch_size)

    @property
    def rows_per_epoch(self) -> int:
        lo, hi = self._order.share()
        return hi - lo

    def epoch_rows(self, epoch: int | None = None) -> np.ndarray:
        """The store ``row`` of every row this rank gives in ``epoch`` (default: the current one), in
        order, computed without reading any activations (for checks and tests)."""
        return self._order.epoch_rows(self._cols["row"], self.epoch if epoch is None else int(epoch))

    # -- state -------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        self.epoch = int_arg("epoch", epoch, 0)
        self.position = 0
        self._next = None

    def state_dict(self) -> dict[str, Any]:
        """Where the feed is: the epoch and the rows of this rank already given (updated before each
        batch is handed out), with the settings the order depends on."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            **self._settings(),
        }

    @cached_property
    def _fingerprint(self) -> str:
        return hashlib.sha256(self._cols["row"].tobytes()).hexdigest()[:16]

    def _settings(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "buffer_rows": self.buffer_rows,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "unit_rows": self.unit_rows,
            "rank": self.rank,
            "world_size": self.world_size,
            "n_rows": self.n_rows,
            "rows_fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`): the next iteration gives the rest of that
        epoch.  Refused with one line when the state is of another selection or other settings."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise QueryError("loader: not a loader state (state_dict() of this version)")
        for key, want in self._settings().items():
            if state.get(key) != want:
                raise QueryError(f"loader: the state has {key}={state.get(key)!r}, this loader {want!r}")
        epoch = int_arg("epoch", state.get("epoch"), 0)
        position = int_arg("position", state.get("position"), 0, self.rows_per_epoch)
        self.epoch, self.position = epoch, position
        self._next = None

    # -- reading -----------------------------------------------------------------------------------

    def _tensor(self, rows: np.ndarray) -> torch.Tensor:
        """Window rows (storage dtype) as a torch tensor sharing their memory, flattened if asked."""
        t = (
            torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
            if self._bf16_bits
            else torch.from_numpy(rows)
        )
        return t.reshape(t.shape[0], -1) if self.flatten else t

    def __iter__(self) -> Iterator[Any]:
        """``epochs`` epochs, one after the other: the rest of the current epoch (all of it unless
        resumed), then ``epochs - 1`` whole ones (``epochs=None``: without end, as a training loop that
        counts its own steps takes it); at the end of each the epoch advances, and the next is
        reshuffled by its number.  ``state_dict()`` holds the epoch and the position in it, so a
        resumed feed continues in whichever epoch it stopped.  The windows of all of them come from one
        background thread (:mod:`actstore.query.select.loader_windows`), the next epoch's first window
        read while the last one of this epoch is cut."""
        if self.epochs is None and self.rows_per_epoch == 0:
            raise QueryError(
                "loader: epochs=None with no rows per epoch on this rank (drop_last, batch_size)"
            )
        # the window buffers allocated here, by the consuming thread: a buffer freed by an earlier
        # loader is reused without the page faults of fresh memory (a new thread's arena has none)
        self._buffers.reserve(self._shape, self._win_dtype, IN_USE)
        windows = self._source.background(self.epoch, self.position, self.epochs)
        try:
            done = 0
            while self.epochs is None or done < self.epochs:
                yield from self._epoch(windows)
                done += 1
        finally:
            windows.close()  # the background thread stopped and joined

    def __next__(self) -> Any:
        """The next batch of one running iteration, for loops that call ``next`` on their data (SAELens's
        ``SAETrainer(data_provider=feed)``); ``StopIteration`` where the iteration's epochs end (never
        with ``epochs=None``), and the next call starts a new one."""
        if self._next is None:
            self._next = iter(self)
        try:
            return next(self._next)
        except StopIteration:
            self._next = None
            raise

    def _epoch(self, windows: Iterator[tuple[int, Window | None]]) -> Iterator[Any]:
        """The rest of the current epoch (all of it unless resumed), from its windows in ``windows`` up to
        the epoch's end mark; at its end the epoch advances.

        Each batch is a slice of consecutive rows of a permuted window, copied and converted to
        ``dtype`` by torch in one pass: a new tensor, never a view of the window (whose buffer is reused
        once all its rows are given).  The whole batches are cut up to ``_burst`` at a time (about
        ``BURST_BYTES`` of them), in one tight loop: cut one at a time between a training loop's
        steps, each paid its cold caches (about 20 us against 5 a batch, tiny-llama batches of 256)."""
        epoch, start = self.epoch, self.position
        total = self.rows_per_epoch
        bs, dtype = self.batch_size, self.dtype
        skip = start % self.buffer_rows
        carry_x: list[torch.Tensor] = []
        carry_i: list[np.ndarray] = []
        n_carry = 0
        given = start
        burst = 1  # the first batch as soon as it is cut, then bursts twice as long up to ``_burst``

        for _e, win in windows:
            if win is None:  # the epoch's end
                break
            try:
                src = self._tensor(win.rows)
                ids = win.ids
                m = src.shape[0]
                at, skip = skip, 0
                if n_carry and at < m:  # the rest of the batch begun in the window before
                    take = min(bs - n_carry, m - at)
                    x = src[at : at + take]
                    carry_x.append(x.to(dtype) if x.dtype != dtype else x.clone())
                    if ids is not None:
                        carry_i.append(ids[at : at + take])
                    at += take
                    n_carry += take
                    if n_carry == bs:
                        given += bs
                        self.epoch, self.position = epoch, given
                        yield self._joined(carry_x, carry_i)
                        carry_x, carry_i, n_carry = [], [], 0
                while m - at >= bs:  # whole batches, cut a burst at a time (in one tight loop)
                    k = min((m - at) // bs, burst)
                    burst = min(2 * burst, self._burst)
                    xs = [src[a : a + bs] for a in range(at, at + k * bs, bs)]
                    xs = [x.to(dtype) for x in xs] if src.dtype != dtype else [x.clone() for x in xs]
                    for x in xs:
                        given += bs
                        self.epoch, self.position = epoch, given
                        yield (torch.from_numpy(ids[at : at + bs].copy()), x) if ids is not None else x
                        at += bs
                if at < m:  # the window's last rows begin a batch
                    x = src[at:m]
                    carry_x.append(x.to(dtype) if x.dtype != dtype else x.clone())
                    if ids is not None:
                        carry_i.append(ids[at:m])
                    n_carry += m - at
            finally:
                win.release()
        if n_carry:
            given += n_carry
            self.epoch, self.position = epoch, given
            yield self._joined(carry_x, carry_i)
        if given >= total:
            self.epoch, self.position = epoch + 1, 0

    def _joined(self, xs: list[torch.Tensor], ids: list[np.ndarray]) -> Any:
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        if not self.with_ids:
            return x
        return torch.from_numpy(ids[0].copy() if len(ids) == 1 else np.concatenate(ids)), x

    def __repr__(self) -> str:
        return (
            f"<ActivationLoader {self.spec.kind} layers={list(self.spec.layers)}: {self.n_rows} rows in "
            f"{self.n_units} units, rank {self.rank}/{self.world_size}, batch {self.batch_size}, "
            f"buffer {self.buffer_rows}, shuffle={self.shuffle} seed={self.seed}, epochs={self.epochs}, epoch {self.epoch} "
            f"at row {self.position}>"
        )
