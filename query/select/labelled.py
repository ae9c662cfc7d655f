"""Features with names: labelled ``xarray.DataArray``s and lazy ``dask`` arrays of a selection.

Dimensions per kind (n rows, l layers, h heads or groups, S the selection's longest source):

    z               row, layer, head, d_head
    attn_head       row, layer, head, d_model
    attn            row, layer, d_model
    attn_head_token row, layer, head, source, d_model
    attn_entity     row, layer, head, d_model
    attn_prob       row, layer, head, source
    mlp             row, layer, d_model
    mlp_group       row, layer, group, d_model
    resid           row, layer, d_model       (layer 0 = embeddings, l + 1 = after layer l)

Coordinates: ``example_id`` and ``relation_id`` on ``row``; ``layer``, ``head`` / ``group`` (the
numbers chosen); ``source`` (0 .. S-1) and ``mask`` [row, source], True where the row has that
source token (the features are zero on the padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from actstore.core.dependencies import dask, dask_array, dask_base
from actstore.core.errors import QueryError
from actstore.query.select.features import SOURCE_KINDS, FeatureSpec, RowBlock, compute_block

if TYPE_CHECKING:
    import dask.array as dask_arrays
    import xarray

    from actstore.core.store import StoreReader


DIMS: dict[str, tuple[str, ...]] = {
    "z": ("row", "layer", "head", "d_head"),
    "attn_head": ("row", "layer", "head", "d_model"),
    "attn": ("row", "layer", "d_model"),
    "attn_head_token": ("row", "layer", "head", "source", "d_model"),
    "attn_entity": ("row", "layer", "head", "d_model"),
    "attn_prob": ("row", "layer", "head", "source"),
    "mlp": ("row", "layer", "d_model"),
    "mlp_group": ("row", "layer", "group", "d_model"),
    "resid": ("row", "layer", "d_model"),
}


def units(store: StoreReader, spec: FeatureSpec) -> list[int]:
    """The head (or, for ``mlp_group``, group) numbers of ``spec``'s features, in order."""
    if spec.heads is not None:
        return list(spec.heads)
    g = store.geometry
    return list(range((spec.groups or g.n_heads) if spec.kind == "mlp_group" else g.n_heads))


def labelled_shape(store: StoreReader, spec: FeatureSpec, n_sources: int) -> tuple[int, ...]:
    """The shape of one row's features (everything after ``row`` in :data:`DIMS`)."""
    g = store.geometry
    size = {
        "layer": len(spec.layers),
        "head": len(units(store, spec)),
        "group": len(units(store, spec)),
        "source": n_sources,
        "d_model": g.d_model,
        "d_head": g.d_head,
    }
    return tuple(size[d] for d in DIMS[spec.kind][1:])


def to_dataarray(
    store: StoreReader,
    spec: FeatureSpec,
    x: Any,
    example_ids: np.ndarray,
    relation_ids: Sequence[Any],
    mask: np.ndarray | None = None,
) -> xarray.DataArray:
    """``x`` (numpy or dask, [n, ...] as ``Selection.features`` returns for ``spec``) labelled with the
    dimensions of :data:`DIMS`; ``example_ids`` and ``relation_ids`` [n] of the rows; ``mask`` [n, S]
    (True on the rows' real sources) for the source kinds."""

    dims = DIMS[spec.kind]
    if x.ndim != len(dims) or x.shape[0] != len(example_ids):
        raise QueryError(
            f"features of shape {tuple(x.shape)} do not fit {spec.kind} over {len(example_ids)} rows"
        )
    coords: dict[str, Any] = {
        "example_id": ("row", np.asarray(example_ids)),
        "relation_id": ("row", np.asarray(list(relation_ids), dtype=object)),
        "layer": ("layer", np.asarray(spec.layers, dtype=np.int64)),
    }
    unit = "group" if spec.kind == "mlp_group" else "head"
    if unit in dims:
        coords[unit] = (unit, np.asarray(units(store, spec), dtype=np.int64))
    if "source" in dims:
        if mask is None or mask.shape != (x.shape[0], x.shape[dims.index("source")]):
            raise QueryError(f"{spec.kind} needs a source mask of shape [rows, sources]")
        coords["source"] = ("source", np.arange(mask.shape[1], dtype=np.int64))
        coords["mask"] = (("row", "source"), mask)
    attrs = {"kind": spec.kind, "store": store.url, "model": str(store.manifest.model.get("name") or "")}
    return xr.DataArray(x, dims=dims, coords=coords, name=spec.kind, attrs=attrs)


def pad_sources(x: np.ndarray, S: int) -> np.ndarray:
    """``x`` [n, l, h, s, ...] zero-padded to ``S`` sources (``x`` itself when ``s == S``)."""
    if x.shape[3] == S:
        return x
    out = np.zeros((*x.shape[:3], S, *x.shape[4:]), dtype=x.dtype)
    out[:, :, :, : x.shape[3]] = x
    return out


def block_features(store: StoreReader, spec: FeatureSpec, block: RowBlock, n_sources: int) -> np.ndarray:
    """:func:`actstore.query.select.features.compute_block`, the source axis (if any) zero-padded to ``n_sources``."""
    x = compute_block(store, spec, block)
    return pad_sources(x, n_sources) if spec.kind in SOURCE_KINDS else x


def blocks_features(
    store: StoreReader, spec: FeatureSpec, blocks: list[RowBlock], n_sources: int
) -> np.ndarray:
    """:func:`block_features` of consecutive ``blocks``, concatenated (one coarser dask chunk)."""
    parts = [block_features(store, spec, b, n_sources) for b in blocks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def dask_features(
    store: StoreReader,
    spec: FeatureSpec,
    blocks: Sequence[tuple[int, RowBlock]],
    n_sources: int,
    chunk_rows: int | None = None,
) -> dask_arrays.Array:
    """A lazy dask array of ``spec``'s features [n, ...], one chunk per ``(rows, block)`` of ``blocks``
    (in order), or with ``chunk_rows`` per run of consecutive blocks of at most that many rows (a block
    larger than that is a chunk of its own: fewer, larger tasks, whose overhead a full scan amortises),
    each computed by :func:`blocks_features` when dask asks for it; source kinds padded to
    ``n_sources``.  The store travels with the tasks (it pickles: a process or distributed scheduler
    reopens it by URL)."""
    da = dask_array.load()  # Selection.to_dask needs dask: one line naming the extra when it is missing
    if not blocks:
        raise QueryError("the selection is empty")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or chunk_rows < 1):
        raise QueryError(f"chunk_rows must be at least 1 or None (got {chunk_rows!r})")
    rest = labelled_shape(store, spec, n_sources if spec.kind in SOURCE_KINDS else 0)
    token = dask_base.tokenize(
        store.url, spec, n_sources, chunk_rows, [(n, b.segment, b.seg_rows) for n, b in blocks]
    )
    runs: list[tuple[int, list[RowBlock]]] = []
    for n, block in blocks:
        if runs and chunk_rows is not None and runs[-1][0] + n <= chunk_rows:
            runs[-1] = (runs[-1][0] + n, [*runs[-1][1], block])
        else:
            runs.append((n, [block]))
    chunks = []
    for i, (n, run) in enumerate(runs):
        task = dask.delayed(blocks_features, pure=True)(
            store, spec, run, n_sources, dask_key_name=f"actstore-{token}-{i}"
        )
        chunks.append(da.from_delayed(task, shape=(n, *rest), dtype=np.float32))
    return da.concatenate(chunks, axis=0)
