"""The training feed's windows (:mod:`actstore.query.select.loader`, "Reads"): each window of an epoch
read into a buffer in store order, then permuted as a whole into a second buffer (the order the
batches are cut in), epoch after epoch, by a background thread one window ahead of the consumer; and
the resident window that holds a whole one-window selection after its first read.

The consumer cuts its batches as consecutive slices of a permuted window (one copy each, converted to
the feed's dtype), so the gather by the window's permutation is one pass over the window here, not one
random-access gather a batch in the training loop.  At most three window buffers are in use at a time
(counted by one semaphore an iteration): the one the consumer cuts from, one ready, and one being read
or permuted; a store-order buffer is handed back as soon as its window is permuted."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actstore.query.select.loader_order import EpochOrder, Piece
from actstore.query.select.loader_reads import Buffers, PieceReader

IN_USE = 3  # window buffers one iteration holds at most (the resident window apart)


class Gate:
    """One iteration's hand-over between the thread that assembles the windows and the consumer: the
    window buffers in use (at most ``IN_USE``), one item in passing, and the stop that wakes every
    wait on either (an abandoned iteration ends at once, not at a polling interval)."""

    def __init__(self, slots: int = IN_USE) -> None:
        self._cond = threading.Condition()
        self._free = slots
        self._item: deque[tuple[str, Any]] = deque()
        self.stopped = False

    def acquire(self, wait: bool = True, spare: int = 0) -> bool:
        """A buffer's place (False: stopped, or not ``wait`` and no more than ``spare`` free)."""
        with self._cond:
            while self._free <= (0 if wait else spare):
                if not wait or self.stopped:
                    return False
                self._cond.wait()
            self._free -= 1
            return True

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify_all()

    def put(self, item: tuple[str, Any]) -> bool:
        """Hand ``item`` over once the one before is taken (False: stopped)."""
        with self._cond:
            while self._item and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return False
            self._item.append(item)
            self._cond.notify_all()
            return True

    def get(self) -> tuple[str, Any]:
        with self._cond:
            while not self._item:
                self._cond.wait()
            item = self._item.popleft()
            self._cond.notify_all()
            return item

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


@dataclass(frozen=True)
class Window:
    """A window's rows in output order (a view of a buffer, storage dtype), their store row ids in that
    order (None unless the feed gives ids), and how to hand its buffer back once every row is given."""

    rows: np.ndarray
    ids: np.ndarray | None
    release: Callable[[], None]


@dataclass(frozen=True)
class Resident:
    """The whole selection's rows in the order its one window was read (``rows``: a buffer kept by the
    loader), their store row ids, and for each selection position its row in ``rows``."""

    rows: np.ndarray
    ids: np.ndarray
    at: np.ndarray


def permute(src: np.ndarray, perm: np.ndarray, out: np.ndarray) -> None:
    """``out[q] = src[perm[q]]`` for ``q < perm.size``: one torch gather of the rows' bytes (it releases
    the GIL; any dtype, bfloat16 bits included)."""
    m, bits = perm.size, np.dtype(f"i{src.dtype.itemsize}")
    a = torch.from_numpy(src[:m].reshape(m, -1).view(bits))
    torch.index_select(a, 0, torch.from_numpy(perm), out=torch.from_numpy(out[:m].reshape(m, -1).view(bits)))


class WindowSource:
    """The windows of a feed's epochs (see the module docstring); ``resident`` persists across the
    loader's iterations."""

    def __init__(
        self,
        order: EpochOrder,
        reader: PieceReader,
        buffers: Buffers,
        shape: tuple[int, ...],
        dtype: np.dtype,
        row_ids: np.ndarray,
        *,
        workers: int,
        prefetch: int,
        with_ids: bool,
        whole: bool,
    ) -> None:
        self.order, self.reader, self.buffers = order, reader, buffers
        self.shape, self.dtype, self.row_ids = shape, dtype, row_ids
        self.workers, self.prefetch, self.with_ids, self.whole = workers, prefetch, with_ids, whole
        self.resident: Resident | None = None

    # -- the stream of windows -----------------------------------------------------------------------

    def stream(
        self, epoch: int, start: int, epochs: int | None, gate: Gate, threads: int = 1
    ) -> Generator[tuple[int, Window | None], None, None]:
        """``(epoch, window)`` for each window of epoch ``epoch`` from the one holding share position
        ``start``, then of ``epochs - 1`` whole epochs after it (None: without end), each epoch followed
        by ``(epoch, None)``; stops quietly once ``gate`` is stopped."""
        done = 0
        while epochs is None or done < epochs:
            if self.resident is not None:
                yield from self._from_resident(epoch, gate)
            else:
                yield from self._read(epoch, start, gate, threads)
            if gate.stopped:
                return
            yield epoch, None
            epoch, start, done = epoch + 1, 0, done + 1

    def _take(self, gate: Gate, wait: bool = True, spare: int = 0) -> np.ndarray | None:
        """A window buffer once fewer than ``IN_USE`` are held (None: stopped, or none free and not
        ``wait``)."""
        return self.buffers.take(self.shape, self.dtype) if gate.acquire(wait, spare) else None

    def _releaser(self, gate: Gate, buf: np.ndarray | None) -> Callable[[], None]:
        def release() -> None:
            if buf is not None:
                self.buffers.give(buf)
            gate.release()

        return release

    def _window(
        self,
        rows: np.ndarray,
        ids: np.ndarray,
        perm: np.ndarray | None,
        buf: np.ndarray | None,
        gate: Gate,
    ) -> Window | None:
        """The window of ``rows`` (store order; read into ``buf``, whose place in ``gate`` it holds; None:
        the buffer is the resident one, kept) in the order ``perm``: permuted into a buffer of its own
        and ``buf`` handed back, or (no permutation) ``rows`` themselves.  None: stopped."""
        if perm is None:
            return Window(rows, ids if self.with_ids else None, self._releaser(gate, buf))
        out = self._take(gate)
        if out is None:
            return None
        permute(rows, perm, out)
        self._releaser(gate, buf)()
        return Window(out[: perm.size], ids[perm] if self.with_ids else None, self._releaser(gate, out))

    def _from_resident(self, epoch: int, gate: Gate) -> Iterator[tuple[int, Window]]:
        """Epoch ``epoch`` as one window gathered from the resident rows in its order (no read)."""
        r = self.resident
        assert r is not None
        order = r.at[self.order.epoch_rows(np.arange(r.at.size), epoch)]
        if not self.order.shuffle and order.size == r.at.size:  # store order: the rows as they are
            yield epoch, Window(r.rows, r.ids if self.with_ids else None, lambda: None)
            return
        out = self._take(gate)
        if out is None:
            return
        permute(r.rows, order, out)
        ids = r.ids[order] if self.with_ids else None
        yield epoch, Window(out[: order.size], ids, self._releaser(gate, out))

    def _read(self, epoch: int, start: int, gate: Gate, threads: int) -> Iterator[tuple[int, Window]]:
        """Each window of ``epoch`` from the one holding ``start``, read into a buffer (the pieces in
        store order), then permuted by :meth:`_window`."""
        pieces = self.order.pieces(epoch, start)
        # workers=1: the thread that assembles the windows reads them too; k >= 2: k reader threads.
        pool = (
            ThreadPoolExecutor(
                self.workers,
                thread_name_prefix="actstore-loader",
                initializer=torch.set_num_threads,
                initargs=(threads,),
            )
            if self.workers >= 2
            else None
        )
        sizes: dict[int, int] = {}  # rows of each window: its pieces cover 0 .. m
        for p in pieces:
            sizes[p.window] = max(sizes.get(p.window, 0), p.at + (p.hi - p.lo))
        bufs: dict[int, np.ndarray] = {}  # window -> its store-order buffer, from its first read on
        pending: deque[tuple[Piece, Future[None] | None]] = deque()
        nxt = 0  # the next piece to hand on

        def claim(w: int, wait: bool) -> np.ndarray | None:
            if w not in bufs:
                # a read ahead into the next window leaves a place for this one's permuted buffer
                buf = self._take(gate, wait, spare=1)
                if buf is None:
                    return None
                bufs[w] = buf
            return bufs[w]

        def dest(p: Piece) -> np.ndarray:
            return bufs[p.window][p.at : p.at + (p.hi - p.lo)]

        def top_up() -> None:
            # a piece of the next window is handed to the readers only while a buffer is free for it
            nonlocal nxt
            while len(pending) < self.prefetch and nxt < len(pieces):
                p = pieces[nxt]
                if pool is not None and claim(p.window, wait=False) is None:
                    return
                pending.append((p, pool.submit(self.reader.fill, p, dest(p)) if pool is not None else None))
                nxt += 1

        try:
            while nxt < len(pieces) or pending:
                w = pending[0][0].window if pending else pieces[nxt].window
                if claim(w, wait=True) is None:
                    return
                top_up()
                m = sizes[w]
                ids = np.empty(m, dtype=np.int64)
                pos = np.empty(m, dtype=np.int64)
                while pending and pending[0][0].window == w:  # each piece placed as it arrives
                    p, fut = pending.popleft()
                    if fut is not None:
                        fut.result()
                    else:
                        self.reader.fill(p, dest(p))
                    top_up()
                    ids[p.at : p.at + (p.hi - p.lo)] = self.row_ids[p.lo : p.hi]
                    pos[p.at : p.at + (p.hi - p.lo)] = np.arange(p.lo, p.hi)
                buf = bufs.pop(w)
                keep: np.ndarray | None = buf
                if self.whole and m == self.row_ids.size and self.resident is None:
                    at = np.empty(m, dtype=np.int64)  # selection position -> its row in the window
                    at[pos] = np.arange(m)
                    self.resident = Resident(buf[:m], ids, at)  # the loader keeps the buffer
                    keep = None
                win = self._window(buf[:m], ids, self.order.window_perm(epoch, w, m), keep, gate)
                if win is None:
                    return
                yield epoch, win
                if gate.stopped:
                    return
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    # -- in a background thread ------------------------------------------------------------------------

    def background(
        self, epoch: int, start: int, epochs: int | None
    ) -> Generator[tuple[int, Window | None], None, None]:
        """:meth:`stream`, its first window assembled in the calling thread (the consumer waits for it
        anyway: no hand-over, and the buffers come from its own arena), the rest by a background thread
        one window ahead of the consumer (``workers=0``: all in the calling thread).  An error there is
        raised here, as it was raised; closing this generator stops the thread and waits for it."""
        gate = Gate()
        threads = torch.get_num_threads()  # torch's intra-op setting is per thread (OpenMP): pass it on
        items = self.stream(epoch, start, epochs, gate, threads)
        try:
            first = next(items, None)
            if first is None:
                return
        except BaseException:
            items.close()
            raise
        if self.workers == 0:
            try:
                yield first
                yield from items
            finally:
                items.close()
            return

        def run() -> None:
            time.sleep(0)  # the GIL to the consumer first: it cuts the first batch while this one starts
            torch.set_num_threads(threads)
            try:
                for item in items:
                    if not gate.put(("item", item)):
                        return
                gate.put(("end", None))
            except BaseException as e:  # handed to the consumer, raised there
                gate.put(("error", e))
            finally:
                items.close()

        th = threading.Thread(target=run, name="actstore-loader-windows", daemon=True)
        th.start()
        try:
            yield first
            while True:
                what, item = gate.get()
                if what == "item":
                    yield item
                elif what == "error":
                    raise item
                else:
                    return
        finally:
            gate.stop()
            th.join()
