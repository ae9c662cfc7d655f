"""A selection's features as a Hugging Face ``datasets`` Arrow dataset in SAELens's cached-activations
layout (``Selection.to_hf_dataset``).

SAELens's ``CacheActivationsRunner`` saves a ``datasets.Dataset`` (``save_to_disk``) with one column
per hook, named by its TransformerLens hook name and typed ``Array2D(shape=(context_size, d_in))``,
and its ``ActivationsStore`` reads it back with ``Dataset.load_from_disk`` (``cached_activations_path``),
slicing rows and reshaping ``[rows, context_size, d_in]`` to ``[rows * context_size, d_in]``.
A store row is one position, so here ``context_size`` is 1: each column is
``Array2D(shape=(1, d_in), dtype)`` (train SAELens with ``context_size=1``).  Columns:

======================  ================================  ================================
kind                    column (layer ``l``)              ``d_in``
======================  ================================  ================================
``resid`` index ``i``   ``blocks.{i}.hook_resid_pre``;    d_model
                        index L: ``blocks.{L-1}.hook_resid_post``
``mlp``                 ``blocks.{l}.hook_mlp_out``       d_model
``attn``                ``blocks.{l}.hook_attn_out``      d_model
``z``                   ``blocks.{l}.attn.hook_z``        H * d_head (heads flattened, as SAELens does)
``attn_head``           ``blocks.{l}.attn.hook_result``   H * d_model
``mlp_group``,          ``blocks.{l}.actstore.{kind}``    G (or H) * d_model
``attn_entity``
======================  ================================  ================================

plus ``row`` and ``example_id`` (int64: the store row and its example).  The kinds with a source
axis (``attn_head_token``, ``attn_prob``) are ragged and refused.  Rows are in selection (store)
order; SAELens shuffles a cache with ``Dataset.shuffle`` when asked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypedDict

import numpy as np

from actstore.core.errors import QueryError
from actstore.query.select.features import FeatureSpec, RowBlock, compute_block
from actstore.query.select.labelled import SOURCE_KINDS
from actstore.query.select.loader_args import Selected


class Exported(Selected, Protocol):
    """What the export reads of a selection (:class:`actstore.query.select.selection.Selection` is one):
    its rows, and their blocks (example ids and :class:`RowBlock`, of at most ``batch_rows`` rows)."""

    def __len__(self) -> int: ...

    def blocks(self, batch_rows: int | None = None) -> Iterator[tuple[np.ndarray, RowBlock]]: ...


HF_DTYPES = ("float32", "float16")


def hook_name(kind: str, layer: int, n_layers: int) -> str:
    """The TransformerLens hook name SAELens would cache ``kind`` at ``layer`` under."""
    if kind == "resid":
        return (
            f"blocks.{layer}.hook_resid_pre" if layer < n_layers else f"blocks.{n_layers - 1}.hook_resid_post"
        )
    names = {
        "mlp": "hook_mlp_out",
        "attn": "hook_attn_out",
        "z": "attn.hook_z",
        "attn_head": "attn.hook_result",
    }
    return f"blocks.{layer}.{names.get(kind, f'actstore.{kind}')}"


class ExportOptions(TypedDict, total=False):
    """The keyword options of :func:`to_hf_dataset` (and :meth:`Selection.to_hf_dataset`), for type
    checkers; their defaults are written once, in :func:`to_hf_dataset`."""

    layers: Sequence[int] | None
    heads: Sequence[int] | None
    groups: int | None
    dtype: str
    batch_rows: int
    overwrite: bool


def to_hf_dataset(
    selection: Exported,
    path: str | os.PathLike[str],
    kind: str,
    layers: Sequence[int] | None = None,
    *,
    heads: Sequence[int] | None = None,
    groups: int | None = None,
    dtype: str = "float32",
    batch_rows: int = 4096,
    overwrite: bool = False,
) -> Any:
    """Write the features of ``selection`` to ``path`` (a local folder, made by ``save_to_disk``) and
    return the ``datasets.Dataset`` read back from it (memory-mapped).  Needs the ``hf`` extra."""
    try:
        import datasets
        from datasets.arrow_writer import ArrowWriter
    except ImportError:
        raise QueryError("to_hf_dataset needs the datasets package: pip install 'actstore[hf]'") from None
    store = selection.store
    if kind in SOURCE_KINDS:
        raise QueryError(f"to_hf_dataset: {kind} has a ragged source axis; export a fixed-size kind")
    if dtype not in HF_DTYPES:
        raise QueryError(f"to_hf_dataset: dtype must be one of {', '.join(HF_DTYPES)} (got {dtype!r})")
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise QueryError(f"to_hf_dataset: batch_rows must be a positive integer (got {batch_rows!r})")
    spec = FeatureSpec.parse(store, kind, layers, heads, groups)
    if len(selection) == 0:
        raise QueryError("to_hf_dataset: the selection is empty")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise QueryError(f"to_hf_dataset: {out} exists and is not empty (overwrite=True replaces it)")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
    n_layers = store.geometry.n_layers
    names = [hook_name(kind, layer, n_layers) for layer in spec.layers]
    if len(set(names)) != len(names):
        raise QueryError("to_hf_dataset: a layer is given twice")
    first = FeatureSpec.parse(store, kind, [spec.layers[0]], heads, groups)
    probe = compute_block(store, first, next(selection.blocks(1))[1])
    d_in = int(np.prod(probe.shape[2:]))
    features = datasets.Features(
        {
            **{name: datasets.Array2D(shape=(1, d_in), dtype=dtype) for name in names},
            "row": datasets.Value("int64"),
            "example_id": datasets.Value("int64"),
        }
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".hf-export-", dir=out.parent))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a library call prints nothing (restored below)
    try:
        arrow = tmp / "data.arrow"
        rows = selection.rows.column("row").to_numpy()
        at = 0
        with ArrowWriter(features=features, path=str(arrow)) as writer:
            for ids, block in selection.blocks(batch_rows):
                x = compute_block(store, spec, block)
                b = x.shape[0]
                x = x.reshape(b, len(names), 1, d_in).astype(dtype, copy=False)
                batch: dict[str, Any] = {name: x[:, j] for j, name in enumerate(names)}
                batch["row"] = rows[at : at + b]
                batch["example_id"] = ids
                writer.write_batch(batch)
                at += b
            writer.finalize()
        ds = datasets.Dataset.from_file(str(arrow))
        ds.save_to_disk(str(out))
        del ds
        return datasets.Dataset.load_from_disk(str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()
