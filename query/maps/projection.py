"""MAPS vocabulary projections: the store's weights arranged to read a head's map row by row.

For head h of layer l the vocabulary map is M = E W_VO U with W_VO = W_V[l, kv(h)] W_O[l, h]
(see :mod:`actstore.query.maps.static`).  We never build the |V| x |V| matrix: a row is ``x_s B_h`` with
``x_s = e_s W_V[l, kv(h)]`` and ``B_h = W_O[l, h] U`` (or ``(x_s W_O[l, h]) U`` for few rows,
:class:`HeadMap`), and only the ranks of the wanted targets are kept (:func:`target_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from actstore.core.errors import MapsError
from actstore.core.manifest import Geometry
from actstore.core.store import StoreReader
from actstore.query.maps.defaults import ROW_CHUNK

SourceTransform = Callable[[torch.Tensor], torch.Tensor]


def check_head(g: Geometry, layer: int, head: int) -> None:
    """One error line for a head outside the store's geometry."""
    if not (0 <= layer < g.n_layers and 0 <= head < g.n_heads):
        raise MapsError(
            f"head {layer}.{head} is out of range: layers 0..{g.n_layers - 1}, heads 0..{g.n_heads - 1}"
        )


class VocabProjection:
    """The store's weights arranged for vocabulary projections of heads (float32 torch)."""

    def __init__(
        self, store: StoreReader, *, final_norm: bool = True, first_mlp: SourceTransform | None = None
    ) -> None:
        g = store.geometry
        self.geometry = g
        self.final_norm = final_norm
        self.first_mlp = first_mlp
        self._sources: tuple[bytes, torch.Tensor] | None = None
        attrs = store.weight_attrs
        self.W_V = torch.from_numpy(store.weight("W_V"))  # [L, Hkv, d, dh]
        self.W_O = torch.from_numpy(store.weight("W_O"))  # [L, H, dh, d]
        scale = float(attrs.get("embed_scale") or 1.0)
        self.embed = torch.from_numpy(store.weight("embed")) * scale  # [V_in, d]
        U = torch.from_numpy(store.weight("unembed"))  # [V, d]
        if final_norm and store.has_weight("final_norm_weight"):
            U = U * torch.from_numpy(store.weight("final_norm_weight"))[None, :]
        self.U_T = U.T.contiguous()  # [d, V]

    @property
    def vocab_size(self) -> int:
        return int(self.U_T.shape[1])

    def check_head(self, layer: int, head: int) -> None:
        check_head(self.geometry, layer, head)

    def kv(self, head: int) -> int:
        return head // self.geometry.kv_group

    def readout(self, layer: int, head: int, n_rows: int) -> HeadMap:
        """The map x -> x W_O[l, h] U' for about ``n_rows`` vectors x (see :class:`HeadMap`)."""
        return HeadMap(self.W_O[layer, head], self.U_T, n_rows)

    def sources(self, layer: int, token_ids: torch.Tensor) -> torch.Tensor:
        """The source vectors layer ``layer`` reads: the embeddings, or with ``first_mlp``
        (the paper's option) the first MLP's output on them for layers >= 1.  [n, d_model]."""
        e = self.embed[token_ids]
        if self.first_mlp is None or layer == 0:
            return e
        key = token_ids.numpy().tobytes()
        if self._sources is None or self._sources[0] != key:
            with torch.inference_mode():
                out = torch.cat([self.first_mlp(e[i : i + 4096]).float() for i in range(0, e.shape[0], 4096)])
            self._sources = (key, out)
        return self._sources[1]

    def values(self, layer: int, kv: int, token_ids: torch.Tensor) -> torch.Tensor:
        """x_s = src_s W_V[l, kv] for the given source tokens (see :meth:`sources`): [n, d_head]."""
        return self.sources(layer, token_ids) @ self.W_V[layer, kv]


class HeadMap:
    """x [n, d_head] -> rows x W_O U' [n, |V|], in the cheaper of two orders.

    Through B = W_O U' ([d_head, |V|], made once) a row costs d_head*|V|; directly, (x W_O) U'
    costs d_model*|V| per row but nothing up front.  B pays off from about
    d_head*d_model / (d_model - d_head) rows: 72 for SmolLM2 (64, 576), 427 for Gemma-3-270M
    (256, 640, whose |V| = 262144 makes B cost as much as 640 direct rows).
    """

    def __init__(self, W_O: torch.Tensor, U_T: torch.Tensor, n_rows: int) -> None:
        dh, d = W_O.shape
        self.W_O = W_O
        self.U_T = U_T
        self.B = W_O @ U_T if n_rows * (d - dh) >= dh * d else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.B if self.B is not None else (x @ self.W_O) @ self.U_T


def target_ranks(
    rows: torch.Tensor, targets: torch.Tensor, k_max: int, local: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks of each target in its row, censored at ``k_max``: ([p], [p]) int32.

    ``rank_up`` counts the row's entries strictly greater than the target's value, ``rank_down``
    those strictly smaller; either is reported as ``k_max`` when it is ``k_max`` or more.  Only
    the ``k_max`` largest and smallest entries of each row are kept (``torch.topk``), which is
    exact: fewer than k entries exceed v  <=>  the k-th largest entry is <= v.  ``local`` maps
    each target to its row (default: target i is in row i); the target's value is read from
    the same computed row, so the comparison is free of rounding differences.
    """
    idx = torch.arange(rows.shape[0]) if local is None else local
    val = rows[idx, targets][:, None]
    K = min(int(k_max), int(rows.shape[1]))
    hi = torch.topk(rows, K, dim=1, largest=True, sorted=False).values[idx]
    lo = torch.topk(rows, K, dim=1, largest=False, sorted=False).values[idx]
    return (hi > val).sum(1, dtype=torch.int32), (lo < val).sum(1, dtype=torch.int32)


def projected_ranks(
    x: torch.Tensor, readout: HeadMap, targets: torch.Tensor, k_max: int, rows_per_chunk: int = ROW_CHUNK
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`target_ranks` of the rows ``readout(x)`` (x: [n, d_head]), in chunks."""
    n = int(x.shape[0])
    up = np.empty(n, np.int32)
    down = np.empty(n, np.int32)
    for lo in range(0, n, rows_per_chunk):
        hi = min(n, lo + rows_per_chunk)
        u, d = target_ranks(readout(x[lo:hi]), targets[lo:hi], k_max)
        up[lo:hi] = u.numpy()
        down[lo:hi] = d.numpy()
    return up, down


def head_list(proj: VocabProjection, heads: Iterable[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """``heads`` as (layer, head) int pairs, each checked against the geometry; every head for None."""
    g = proj.geometry
    if heads is None:
        return [(layer, h) for layer in range(g.n_layers) for h in range(g.n_heads)]
    out = []
    for layer, h in heads:
        proj.check_head(int(layer), int(h))
        out.append((int(layer), int(h)))
    return out


def parse_heads(text: str | None, n_layers: int, n_heads: int) -> list[tuple[int, int]] | None:
    """``"3.5,10.2,7.*"`` -> [(3, 5), (10, 2), (7, 0), ...]; None for empty text or ``all``."""
    if text is None or not text.strip() or text.strip().lower() == "all":
        return None
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        layer_s, sep, head_s = part.partition(".")
        try:
            layer = int(layer_s)
            heads = list(range(n_heads)) if head_s == "*" else [int(head_s)] if sep else []
        except ValueError:
            heads = []
        if not heads:
            raise MapsError(f"heads: {part!r} is not LAYER.HEAD (e.g. 12.3, or 12.* for a whole layer)")
        for h in heads:
            if not (0 <= layer < n_layers and 0 <= h < n_heads):
                raise MapsError(
                    f"head {layer}.{h} is out of range: layers 0..{n_layers - 1}, heads 0..{n_heads - 1}"
                )
            out.append((layer, h))
    return out
