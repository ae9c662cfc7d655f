"""Per-source factors of a corpus store ingested with ``--sources K`` (``--positions all``).

At every position (row ``r``), for each kept layer ``l`` and head ``h``, the store holds the ``K``
largest attention probabilities ``A_h(t, j)`` over the window's kept positions, with the sources'
rows, and ``V`` at every row; ``z`` is stored as in any corpus store.  With ``S_K(t, h)`` the kept
sources, exactly (the remainder is defined so):

    Delta_att,h(t)      = sum_{j in S_K} A_h(t, j) V_kv(h)(j) W_O,h  +  rem_h(t) W_O,h
    rem_h(t)            = z_h(t) - sum_{j in S_K} A_h(t, j) V_kv(h)(j)            [d_head]
    mass_h(t)           = sum_{j in S_K} A_h(t, j)                                 (kept attention mass)

Layout (docs/format.md, "Corpus stores with sources"): segment-local row ``r``'s entries of the flat
``attn`` array are ``2K`` rows ``r*2K ..``: K weights, then K row offsets (the source's store row is
``row - offset``; an empty slot has weight 0 and offset 0); its ``v`` entry is ``r``.  A source is
always a row of the same window (special tokens that are not kept are no sources: their share is in
the remainder).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from actstore.core.errors import QueryError
from actstore.query.select.weights import weights

if TYPE_CHECKING:
    from actstore.core.store import StoreReader


def corpus_sources(store: StoreReader) -> int:
    """K of a corpus store ingested with ``--sources K`` (0 for any other store)."""
    ingest = store.manifest.ingest
    if ingest.get("positions") != "all":
        return 0
    k = ingest.get("sources") or 0
    return int(k) if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0


def require_sources(store: StoreReader, layers: Sequence[int]) -> int:
    """K, or one line naming the ingest option when the store has no sources at ``layers``."""
    K = corpus_sources(store)
    if not K:
        if store.manifest.ingest.get("positions") == "all":
            raise QueryError(
                "this corpus store keeps no per-source factors; ingest it with --positions all --sources K "
                "(or --sources all) for them"
            )
        raise QueryError("per-source terms at every position need a corpus store ingested with --sources K")
    have = (store.manifest.ingest.get("kept") or {}).get("z") or []
    missing = [x for x in layers if x not in have]
    if missing:
        raise QueryError(
            f"layer {missing[0]} has no sources in this store (kept attention layers: "
            f"{', '.join(map(str, have)) or 'none'}; --kinds and --layers choose them)"
        )
    return K


@dataclass(frozen=True)
class SourceFactors:
    """The factors of ``n`` rows (all float32 but ``source_row``): ``weight`` [n, l, h, K],
    ``source_row`` [n, l, h, K] (store rows; -1 in an empty slot), ``av`` [n, l, h, K, d_head]
    (``A V`` of each kept source), ``rem`` [n, l, h, d_head] (``z`` minus their sum)."""

    rows: np.ndarray
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    weight: np.ndarray
    source_row: np.ndarray
    av: np.ndarray
    rem: np.ndarray

    @property
    def mass(self) -> np.ndarray:
        """[n, l, h] the kept attention mass."""
        return self.weight.sum(-1)


def _by_segment(store: StoreReader, rows: np.ndarray):  # type: ignore[no-untyped-def]
    """(segment, positions in ``rows``, segment-local rows) for each segment ``rows`` touch."""
    S = store.manifest.segment_size
    seg = rows // S
    for s in np.unique(seg):
        at = np.flatnonzero(seg == s)
        yield int(s), at, rows[at] - int(s) * S


def read_rows(store: StoreReader, name: str, rows: np.ndarray, layers: list[int], per: int = 1) -> np.ndarray:
    """Entries of per-row array ``name`` (``per`` flat entries a row) at global ``rows`` (any order,
    repeats allowed), read a segment at a time, each distinct row once: [n, per, ...]."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= store.manifest.n_examples):
        raise QueryError(
            f"row {int(rows.max())} out of range (the store has {store.manifest.n_examples} rows)"
        )
    out: np.ndarray | None = None
    for seg, at, local in _by_segment(store, rows):
        if local.size and local[-1] - local[0] + 1 == local.size and bool(np.all(local[1:] > local[:-1])):
            uniq, inv = local, None  # consecutive rows (a block of a scan): one range, no gather
        else:
            uniq, inv = np.unique(local, return_inverse=True)
        if per == 1:
            got = store.read_segment_rows(seg, name, uniq, layers)[:, None]
        else:
            first, count = np.array([uniq[0] * per]), np.array([uniq.size * per])
            got = (
                store.read_segment_ranges(seg, name, first, count, layers)
                if inv is None
                else store.read_segment_ranges(seg, name, uniq * per, np.full(uniq.size, per), layers)
            )
            got = got.reshape(uniq.size, per, *got.shape[1:])
        if inv is None and at.size == rows.size:
            return got  # one segment, rows in order
        if out is None:
            out = np.empty((rows.size, *got.shape[1:]), dtype=np.float32)
        out[at] = got if inv is None else got[inv]
    if out is None:
        raise QueryError("no rows asked for")
    return out


def source_factors(
    store: StoreReader,
    rows: Sequence[int] | np.ndarray,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> SourceFactors:
    """The kept sources of ``rows`` (global store rows) in factor space (see the module docstring)."""
    g = store.geometry
    L = list(range(g.n_layers)) if layers is None else [int(x) for x in layers]
    Hs = list(range(g.n_heads)) if heads is None else [int(x) for x in heads]
    K = require_sources(store, L)
    if any(not 0 <= h < g.n_heads for h in Hs):
        raise QueryError(f"head out of range: valid 0..{g.n_heads - 1}")
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    a = read_rows(store, "attn", rows, L, per=2 * K)  # [n, 2K, l, H]
    weight = np.ascontiguousarray(a[:, :K][..., Hs].transpose(0, 2, 3, 1))  # [n, l, h, K]
    offset = a[:, K:][..., Hs].transpose(0, 2, 3, 1).astype(np.int64)
    src = rows[:, None, None, None] - offset
    src = np.where(weight > 0, src, -1)
    kv = np.array([h // g.kv_group for h in Hs])
    z = read_rows(store, "z", rows, L)[:, 0][:, :, Hs]  # [n, l, h, dh]
    av = np.zeros((*weight.shape, g.d_head), dtype=np.float32)
    used = np.unique(src[src >= 0])
    if used.size:
        V = read_rows(store, "v", used, L)[:, 0]  # [u, l, Hkv, dh]
        pos = np.searchsorted(used, np.maximum(src, 0))  # [n, l, h, K]
        li = np.arange(len(L))[None, :, None, None]
        got = V[pos, li, kv[None, None, :, None]]  # [n, l, h, K, dh]
        av = got * weight[..., None]
    rem = z - av.sum(3)
    return SourceFactors(rows, tuple(L), tuple(Hs), weight, src, av, rem)


def contributions(store: StoreReader, f: SourceFactors) -> tuple[np.ndarray, np.ndarray]:
    """``Delta_att,h(t, j)`` of the kept sources [n, l, h, K, d_model] and the remainder's
    ``rem_h(t) W_O,h`` [n, l, h, d_model] (their sum over the sources plus the remainder is
    ``attn_head``)."""

    WO = weights(store).layers("W_O", list(f.layers))[:, list(f.heads)]  # [l, h, dh, d]
    av = torch.from_numpy(f.av)
    contrib = torch.einsum("nlhkd,lhde->nlhke", av, WO).numpy()
    rem = torch.einsum("nlhd,lhde->nlhe", torch.from_numpy(f.rem), WO).numpy()
    return contrib, rem


def source_sum(
    store: StoreReader,
    rows: Sequence[int] | np.ndarray,
    sources: Sequence[int] | np.ndarray,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> np.ndarray:
    """attn_entity-style sums: per row, ``sum_{j in sources, j kept}`` of ``Delta_att,h(t, j)`` for a
    set of store rows ``sources`` (e.g. an entity's tokens) [n, l, h, d_model]; a source outside a
    row's top K is in its remainder, not here."""
    f = source_factors(store, rows, layers, heads)
    inside = np.isin(f.source_row, np.asarray(sources, dtype=np.int64))
    z = (f.av * inside[..., None]).sum(3)

    WO = weights(store).layers("W_O", list(f.layers))[:, list(f.heads)]
    return torch.einsum("nlhd,lhde->nlhe", torch.from_numpy(z), WO).numpy()
