"""The training feed's reads (:mod:`actstore.query.select.loader`, "Reads"): a piece of a window, rows of
one storage chunk run, decoded straight into the window's buffer when its chunks hold exactly the
chosen layers, else read and copied; and the pool of window buffers reused across windows and epochs."""

from __future__ import annotations

import threading

import numpy as np

from actstore.core.arrays import axis1_plan, take1
from actstore.core.chunks import LocalChunks, local_chunks
from actstore.core.errors import CorruptStoreError, MissingChunkError
from actstore.core.segments import segment_name
from actstore.core.store import StoreReader
from actstore.query.select.features import FeatureSpec, RowBlock
from actstore.query.select.labelled import block_features
from actstore.query.select.loader_order import Piece

DirectPlan = tuple[LocalChunks, list[int] | None, list[int] | None]


def chunk_error(where: str, lo: int, hi: int, e: Exception) -> CorruptStoreError:
    """The one-line error of a failed chunk read of rows ``lo:hi`` (a missing chunk says so; a checksum
    or Blosc frame that does not match names its exception)."""
    why = str(e) if isinstance(e, MissingChunkError) else f"{type(e).__name__}: {e}"
    return CorruptStoreError(f"{where}: chunk read failed for rows {lo}:{hi} ({why})")


class Buffers:
    """Window buffers kept for reuse, across windows and epochs: a fresh window of tens of MB is
    mapped afresh by the allocator, and its page faults cost about as much as the reads into it.
    At most ``keep`` idle buffers are kept (an iteration uses at most three at a time)."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            while self._idle:
                buf = self._idle.pop()
                if buf.shape == shape and buf.dtype == dtype:
                    return buf
        return np.empty(shape, dtype=dtype)

    def reserve(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> None:
        """At least ``count`` (at most ``keep``) idle buffers of this shape, allocated by the calling
        thread where missing (untouched: memory only as they are written)."""
        with self._lock:
            self._idle = [b for b in self._idle if b.shape == shape and b.dtype == dtype]
            while len(self._idle) < min(count, self.keep):
                self._idle.append(np.empty(shape, dtype=dtype))

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buf)


class PieceReader:
    """Reads pieces of the selected rows (``cols``: ``segment``, ``seg_row``, ``src_start``, ``n_src``,
    ``subject_start``, ``subject_end`` per selected row) of the features ``spec``; ``stored``: the kind
    is read as stored (``resid``, or ``z`` of every head), in the storage dtype."""

    def __init__(
        self,
        store: StoreReader,
        spec: FeatureSpec,
        cols: dict[str, np.ndarray],
        n_sources: int,
        stored: bool,
    ) -> None:
        self.store = store
        self.spec = spec
        self.cols = cols
        self.n_sources = n_sources
        self.stored = stored
        self._direct_plans: dict[int, DirectPlan | None] = {}

    def fill(self, p: Piece, dest: np.ndarray) -> None:
        """Piece ``p``'s rows into ``dest``: decoded there, or read and copied."""
        if not self._read_into(p, dest):
            dest[...] = self._read(p)

    def _direct(self, seg: int) -> DirectPlan | None:
        """How to read segment ``seg``'s stored chunks of the kind without zarr (a local store with the
        default codecs: :func:`actstore.core.chunks.local_chunks`), with the layer plan; None: not so."""
        if seg not in self._direct_plans:
            arr = self.store.array(seg, self.spec.kind)
            lc = local_chunks(arr)
            self._direct_plans[seg] = (
                None if lc is None else (lc, *axis1_plan(arr.shape, arr.chunks, list(self.spec.layers)))
            )
        return self._direct_plans[seg]

    def _read(self, p: Piece) -> np.ndarray:
        c = self.cols
        sl = slice(p.lo, p.hi)
        seg = int(c["segment"][p.lo])
        seg_rows = c["seg_row"][sl]
        if self.stored:
            s0, s1 = int(seg_rows[0]), int(seg_rows[-1]) + 1
            direct = self._direct(seg) if s1 - s0 == seg_rows.size else None
            if direct is not None:  # a run of consecutive rows of a local store: its chunks decoded directly
                return self._read_direct(seg, s0, s1, *direct)
            return self.store.read_segment_rows(
                seg, self.spec.kind, seg_rows, list(self.spec.layers), stored=True
            )
        block = RowBlock(
            segment=seg,
            seg_rows=seg_rows,
            src_start=c["src_start"][sl],
            n_src=c["n_src"][sl],
            subject_start=c["subject_start"][sl],
            subject_end=c["subject_end"][sl],
        )
        return block_features(self.store, self.spec, block, self.n_sources)

    def _read_into(self, p: Piece, dest: np.ndarray) -> bool:
        """Decode piece ``p`` straight into ``dest`` (its rows of the window) when its rows are a run of
        a local store whose chunks hold exactly the selected layers (one layer of a sharded array,
        or every layer of an unsharded one): no intermediate array, no copy.  False: not so (nothing
        written; the caller reads the piece with :meth:`_read`)."""
        if not self.stored:
            return False
        c = self.cols
        seg = int(c["segment"][p.lo])
        s0, s1 = int(c["seg_row"][p.lo]), int(c["seg_row"][p.hi - 1]) + 1
        direct = self._direct(seg) if s1 - s0 == p.hi - p.lo else None
        if direct is None:
            return False
        lc, blocks, positions = direct
        k = lc.inner1 or int(lc.shape[1])  # positions of axis 1 in one (inner) chunk
        if blocks is None:
            blocks = list(range(lc.n_inner))
        if (
            len(blocks) != 1
            or (positions is not None and positions != list(range(k)))
            or not dest.flags.c_contiguous
        ):
            return False
        if s0 < 0 or s1 > lc.shape[0]:
            self._read_direct(seg, s0, s1, *direct)  # raises its one-line error
        n, b = int(lc.chunks[0]), blocks[0]
        where = f"{self.store.url}/segments/{segment_name(seg)}/{self.spec.kind}"
        tmp: np.ndarray | None = None
        try:
            # LocalChunks's per-chunk read (its bytes read, checked and decoded into a given array),
            # as its read() runs it for one block, with the window as destination.
            for ci in range(s0 // n, -(-s1 // n)):
                a, z = max(s0, ci * n), min(s1, (ci + 1) * n)
                if a == ci * n and z == (ci + 1) * n:  # a whole chunk: decoded in place
                    lc.read_chunk_into(ci, b, dest[a - s0 : z - s0].reshape(-1).view(np.uint8))
                    continue
                if tmp is None:
                    tmp = np.empty((n, *dest.shape[1:]), dtype=dest.dtype)
                lc.read_chunk_into(ci, b, tmp.reshape(-1).view(np.uint8))
                dest[a - s0 : z - s0] = tmp[a - ci * n : z - ci * n]
        except Exception as e:
            raise chunk_error(where, s0, s1, e) from None
        return True

    def _read_direct(
        self,
        seg: int,
        s0: int,
        s1: int,
        lc: LocalChunks,
        blocks: list[int] | None,
        positions: list[int] | None,
    ) -> np.ndarray:
        """Rows ``s0 .. s1`` of segment ``seg`` (storage dtype, the selected layers), as
        :meth:`StoreReader.read_segment_rows` reads them (the same checks and errors) less its
        per-call planning: the whole chunks that hold them decoded by ``lc``."""
        where = f"{self.store.url}/segments/{segment_name(seg)}/{self.spec.kind}"
        if s0 < 0 or s1 > lc.shape[0]:
            raise CorruptStoreError(
                f"{where}: rows {s0}..{s1 - 1} asked for, the array has {lc.shape[0]} (the targets table "
                "disagrees with the arrays; run actstore verify)"
            )
        n = int(lc.chunks[0])
        c0 = s0 // n
        try:
            block = lc.read(c0, -(-s1 // n), blocks)
        except Exception as e:
            raise chunk_error(where, c0 * n, s1, e) from None
        return take1(block[s0 - c0 * n : s1 - c0 * n], positions)
