"""The order of the training feed's epochs (:mod:`actstore.query.select.loader`, steps 1 to 3 of its
docstring): the units of whole storage chunks, this rank's share of their rows, and the windows that
share is cut into, computed without reading any activations."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Piece:
    """Rows ``lo .. hi`` (selection positions, consecutive in store order, one storage chunk) that
    land at window positions ``at .. at + (hi - lo)`` before the window's permutation."""

    window: int
    at: int
    lo: int
    hi: int


@dataclass(frozen=True)
class EpochOrder:
    """The units (``unit_start[u] .. unit_stop[u]``: positions in the selection of the rows of unit
    ``u``) and the settings the order of an epoch depends on."""

    unit_start: np.ndarray
    unit_stop: np.ndarray
    batch_size: int
    buffer_rows: int
    shuffle: bool
    seed: int
    rank: int
    world_size: int
    drop_last: bool

    @staticmethod
    def units(segment: np.ndarray, seg_row: np.ndarray, rows_per_unit: int) -> tuple[np.ndarray, np.ndarray]:
        """The first position and the end of each unit of rows (``segment`` and ``seg_row`` of each
        selected row, in store order): runs of one segment within one block of ``rows_per_unit``."""
        unit = seg_row // rows_per_unit
        change = np.flatnonzero((np.diff(segment) != 0) | (np.diff(unit) != 0)) + 1
        start = np.concatenate([[0], change]).astype(np.int64)  # [U] first position of each unit
        return start, np.concatenate([change, [segment.size]]).astype(np.int64)

    @property
    def n_rows(self) -> int:
        return int(self.unit_stop[-1])

    @property
    def n_units(self) -> int:
        return int(self.unit_start.size)

    def share(self) -> tuple[int, int]:
        """This rank's positions ``lo .. hi`` in the epoch's unit-ordered sequence of rows."""
        N, W, r = self.n_rows, self.world_size, self.rank
        if self.drop_last:
            each = (N // W) // self.batch_size * self.batch_size
            return r * (N // W), r * (N // W) + each
        return r * N // W, (r + 1) * N // W

    def unit_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_units)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_units)

    def window_perm(self, epoch: int, window: int, m: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch, self.rank, window]).permutation(m)

    def pieces(self, epoch: int, start: int) -> list[Piece]:
        """The pieces of this rank's windows from the one holding share position ``start`` on."""
        lo, hi = self.share()
        B = self.buffer_rows
        order = self.unit_order(epoch)
        sizes = (self.unit_stop - self.unit_start)[order]
        ends = np.cumsum(sizes)  # sequence position after each ordered unit
        first_window = start // B
        a = lo + first_window * B  # sequence position where reading begins
        if a >= hi:
            return []
        k = int(np.searchsorted(ends, a, side="right"))
        out: list[Piece] = []
        pos = a
        while pos < hi:
            u = int(order[k])
            u_begin = int(ends[k] - sizes[k])  # sequence position of the unit's first row
            take_to = min(int(ends[k]), hi, lo + ((pos - lo) // B + 1) * B)  # unit, share or window end
            w = (pos - lo) // B
            s0 = int(self.unit_start[u]) + (pos - u_begin)
            out.append(Piece(w, pos - lo - w * B, s0, s0 + (take_to - pos)))
            pos = take_to
            if pos >= ends[k]:
                k += 1
        return out

    def epoch_rows(self, row: np.ndarray, epoch: int) -> np.ndarray:
        """The ids ``row`` (one per selected row) of every row this rank gives in ``epoch``, in order."""
        ids: list[np.ndarray] = []
        for w, pieces in by_window(self.pieces(epoch, 0)):
            win = np.concatenate([row[p.lo : p.hi] for p in pieces])
            perm = self.window_perm(epoch, w, win.size)
            ids.append(win if perm is None else win[perm])
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def by_window(pieces: list[Piece]) -> Iterator[tuple[int, list[Piece]]]:
    """``pieces`` grouped by their window (consecutive), with the window's number."""
    cur: list[Piece] = []
    for p in pieces:
        if cur and p.window != cur[0].window:
            yield cur[0].window, cur
            cur = []
        cur.append(p)
    if cur:
        yield cur[0].window, cur
