"""The feature matrix a probe trains on: a selection's features streamed into one preallocated
[N, F] matrix (float32, or float16 to halve memory), with what attribution needs to name them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actstore.core.errors import QueryError
from actstore.core.progress import progress_bar
from actstore.core.store import StoreReader
from actstore.query.analyses.probe_config import PROBE_KINDS
from actstore.query.select.features import FeatureSpec, compute_block, row_shape
from actstore.query.select.selection import Selection


# ----------------------------------------------------------------------------------- features
@dataclass(frozen=True)
class FeatureMatrix:
    """Flattened features of selected rows, with what attribution needs to name them."""

    kind: str
    layers: tuple[int, ...]
    heads: tuple[int, ...] | None
    groups: int | None
    example_ids: np.ndarray  # [N]
    labels: list[str]  # relation_id per row
    data: torch.Tensor  # [N, F]
    unit_shape: tuple[int, ...]  # per-row shape: (L', H', d) or (L', d)

    @property
    def n_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def unit_size(self) -> int:
        return self.unit_shape[-1]

    @property
    def n_units(self) -> int:
        return self.n_features // self.unit_size

    def unit_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """(layer, head) of each unit; head is -1 for per-layer kinds.  For ``resid`` the layer is
        the residual index (0 = embeddings)."""
        layers = np.asarray(self.layers, dtype=np.int32)
        if len(self.unit_shape) == 2:
            return layers, np.full(layers.size, -1, dtype=np.int32)
        n_h = self.unit_shape[1]
        heads = np.asarray(self.heads if self.heads is not None else range(n_h), dtype=np.int32)
        return np.repeat(layers, n_h), np.tile(heads, layers.size)


def load_features(
    store: StoreReader,
    kind: str,
    *,
    rows: Selection | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    groups: int | None = None,
    dtype: str = "float32",
    batch_rows: int = 64,
    progress: bool = False,
) -> FeatureMatrix:
    """Stream the features of ``rows`` (every row of the store when None) into one preallocated
    ``[N, F]`` matrix of ``dtype``.

    float32: each block of at most ``batch_rows`` rows is computed straight into its rows of the
    matrix (:func:`actstore.query.select.features.compute_block` with ``out``), with no intermediate array; float16:
    into one reused float32 block buffer, then converted into the matrix's rows.  Memory: the matrix
    plus one block (and that block's factors), whatever N.  ``progress``: a bar of the rows on stderr."""

    if kind not in PROBE_KINDS:
        raise QueryError(f"feature kind {kind!r} cannot be probed (one of {', '.join(PROBE_KINDS)})")
    if dtype not in ("float32", "float16"):
        raise QueryError(f"feature dtype must be float32 or float16, not {dtype!r}")
    spec = FeatureSpec.parse(store, kind, layers, heads, groups)
    sel = rows if rows is not None else Selection.from_sql(store)
    if len(sel) == 0:
        raise QueryError("the selection is empty")
    ids = sel.example_ids
    rels = sel.rows.column("relation_id").to_pylist()  # the selection's rows carry each relation
    shape = row_shape(store, spec)
    width = int(np.prod(shape))
    data = torch.empty((len(ids), width), dtype=getattr(torch, dtype))
    matrix = data.numpy()
    scratch = np.empty((batch_rows, *shape), dtype=np.float32) if dtype != "float32" else None
    i = 0
    bar = progress_bar(total=len(ids), desc=f"features {kind}", unit="row", enabled=progress)
    for _, block in sel.blocks(batch_rows):
        n = len(block.seg_rows)
        bar.update(n)
        if scratch is None:
            compute_block(store, spec, block, out=matrix[i : i + n].reshape(n, *shape))
        else:
            x = compute_block(store, spec, block, out=scratch[:n])
            data[i : i + n].copy_(
                torch.from_numpy(x.reshape(n, width))
            )  # torch's float16 conversion: ~10x numpy's
        i += n
    bar.close()
    if i != len(ids):
        raise QueryError(f"the selection's blocks hold {i} rows, not {len(ids)}")
    return FeatureMatrix(kind, spec.layers, spec.heads, groups, ids, rels, data, shape)
