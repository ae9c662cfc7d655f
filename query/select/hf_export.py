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
order.

``context_size=N`` writes instead what SAELens's ``CacheActivationsRunner`` writes for the same
model, hook and context: one row per whole window of N positions of a corpus store ingested with
``--positions all --pack --keep-special --context-length N``, columns ``{hook}``
(``Array2D((N, d_in), dtype)``) and ``token_ids`` (``Sequence(int32, length=N)``), nothing else; the
column named as SAELens hooks the model (:func:`module_path`: the transformers module path for
``model_class_name="AutoModelForCausalLM"``, residual index i = the output of ``model.layers.{i-1}``;
the TransformerLens hook name when TransformerLens knows the model's name; or ``hook_name=``).
Rows in window (generation) order, as the runner writes them (it does not shuffle what it saves);
``shuffle=True`` writes them in the order of ``Dataset.shuffle(seed=seed)``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypedDict

import numpy as np

from actstore.core.errors import QueryError
from actstore.query.select.features import FeatureSpec, RowBlock, compute_block, row_shape
from actstore.query.select.hf_arrow import (
    SHARD,
    Layout,
    Writer,
    free_core,
    opened,
    saved,
    staging,
    window_layout,
)
from actstore.query.select.labelled import SOURCE_KINDS
from actstore.query.select.loader_args import Selected
from actstore.query.select.tl_cache import MODULES, kind_names


class Exported(Selected, Protocol):
    """What the export reads of a selection (:class:`actstore.query.select.selection.Selection` is one):
    its rows, and their blocks (example ids and :class:`RowBlock`, of at most ``batch_rows`` rows)."""

    def __len__(self) -> int: ...

    def blocks(self, batch_rows: int | None = None) -> Iterator[tuple[np.ndarray, RowBlock]]: ...


HF_DTYPES = ("float32", "float16")


def hook_name_of(kind: str, layer: int, n_layers: int) -> str:
    """The TransformerLens hook name SAELens would cache ``kind`` at ``layer`` under (the store's
    TransformerLens names, :func:`~actstore.query.select.tl_cache.kind_names`)."""
    if kind in ("resid", "mlp", "attn", "z", "attn_head"):
        return kind_names(kind, layer, n_layers)["hook"]
    return f"blocks.{layer}.actstore.{kind}"


def module_path(kind: str, layer: int, architecture: str) -> str:
    """The transformers module whose output SAELens caches for ``kind`` at ``layer`` (its hook name
    with ``model_class_name="AutoModelForCausalLM"``): residual index i is the output of block i-1
    (index 0 the token embeddings), ``mlp`` and ``attn`` the outputs of a block's MLP and attention."""
    mods = MODULES.get(architecture)  # the store's one table of module names
    fix = "name the column with hook_name="
    if mods is None:
        raise QueryError(f"to_hf_dataset: no SAELens naming known for architecture {architecture!r}; {fix}")
    if kind == "resid":
        if layer == 0:
            if mods.export_embed is None:
                raise QueryError(
                    f"to_hf_dataset: residual index 0 of {architecture} is no module's output; {fix}"
                )
            return mods.export_embed
        return mods.block.format(l=layer - 1)
    if kind in ("mlp", "attn"):
        return f"{mods.block.format(l=layer)}.{mods.mlp if kind == 'mlp' else mods.attn}"
    raise QueryError(f"to_hf_dataset: no module of the model outputs {kind} as stored; {fix}")


def _tlens_knows(name: str) -> bool:
    """Whether TransformerLens knows the model ``name`` (SAELens then hooks it by TL hook names): its
    ``OFFICIAL_MODEL_NAMES``, read from its source file where it is a literal (importing
    TransformerLens to look up a name took 4 s here), else from the imported module."""
    if "transformer_lens" in sys.modules and sys.modules["transformer_lens"] is None:
        return False  # blocked
    loaded = sys.modules.get("transformer_lens.supported_models")
    if loaded is not None:
        return name in getattr(loaded, "OFFICIAL_MODEL_NAMES", ())
    for folder in _tlens_folders():
        names = _literal_names(os.path.join(folder, "supported_models.py"))
        if names is not None:
            return name in names
    try:  # another layout of TransformerLens: ask it
        from transformer_lens.loading_from_pretrained import OFFICIAL_MODEL_NAMES
    except Exception:  # TransformerLens absent or broken: SAELens could not load it by TL either
        return False
    return name in OFFICIAL_MODEL_NAMES


@lru_cache(maxsize=1)
def _tlens_folders() -> tuple[str, ...]:
    """Where the package ``transformer_lens`` would be imported from (none: it is not installed)."""
    try:
        spec = importlib.util.find_spec("transformer_lens")
    except (ImportError, ValueError):
        return ()
    return tuple(spec.submodule_search_locations or ()) if spec is not None else ()


@lru_cache(maxsize=4)
def _literal_names(path: str) -> frozenset[str] | None:
    """The literal list ``OFFICIAL_MODEL_NAMES`` of the Python file ``path`` (None: no such list)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        target: ast.expr
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "OFFICIAL_MODEL_NAMES" and value is not None:
            try:
                return frozenset(ast.literal_eval(value))
            except ValueError:
                return None
    return None


class ExportOptions(TypedDict, total=False):
    """The keyword options of :func:`to_hf_dataset` (and :meth:`Selection.to_hf_dataset`), for type
    checkers; their defaults are written once, in :func:`to_hf_dataset`."""

    layers: Sequence[int] | None
    heads: Sequence[int] | None
    groups: int | None
    dtype: str
    batch_rows: int
    overwrite: bool
    context_size: int | None
    hook_name: str | None
    shuffle: bool
    seed: int


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
    context_size: int | None = None,
    hook_name: str | None = None,
    shuffle: bool = False,
    seed: int = 0,
) -> Any:
    """Write the features of ``selection`` to ``path`` (a local folder, made by ``save_to_disk``) and
    return the ``datasets.Dataset`` read back from it (memory-mapped).  Needs the ``hf`` extra.
    ``context_size=N``: SAELens's ``CacheActivationsRunner`` layout (module docstring)."""
    try:
        import datasets
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
    windows = None
    if context_size is not None:
        windows = _windows(selection, spec, int(context_size))
        arch = str(store.manifest.model.get("architecture", ""))
        name = str(store.manifest.model.get("name", ""))
        if hook_name is not None:
            names = [str(hook_name)]
        elif _tlens_knows(name):
            names = [hook_name_of(kind, spec.layers[0], store.geometry.n_layers)]
        else:
            names = [module_path(kind, spec.layers[0], arch)]
    elif hook_name is not None or shuffle:
        raise QueryError("to_hf_dataset: hook_name and shuffle go with context_size (SAELens's cache layout)")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise QueryError(f"to_hf_dataset: {out} exists and is not empty (overwrite=True replaces it)")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
    n_layers = store.geometry.n_layers
    first = FeatureSpec.parse(store, kind, [spec.layers[0]], heads, groups)
    d_in = int(np.prod(row_shape(store, first)[1:]))  # one layer's row (no source axis: refused above)
    if windows is not None:
        return _write_windows(selection, spec, out, names[0], d_in, dtype, batch_rows, windows, shuffle, seed)
    names = [hook_name_of(kind, layer, n_layers) for layer in spec.layers]
    if len(set(names)) != len(names):
        raise QueryError("to_hf_dataset: a layer is given twice")
    features = datasets.Features(
        {
            **{name: datasets.Array2D(shape=(1, d_in), dtype=dtype) for name in names},
            "row": datasets.Value("int64"),
            "example_id": datasets.Value("int64"),
        }
    )
    layout = Layout(features)
    tmp = staging(out)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a library call prints nothing (restored below)
    try:
        arrow = tmp / SHARD
        rows = selection.rows.column("row").to_numpy()
        at = 0
        # the file's bytes at least (values, offsets, row and example ids: the schema and headers
        # come on top), preallocated (nothing to cut back at the end)
        size = len(selection) * (len(names) * (d_in * np.dtype(dtype).itemsize + 8) + 16)
        with Writer(layout, arrow, len(selection) > batch_rows and free_core(), size) as writer:
            for k, (ids, block) in enumerate(selection.blocks(batch_rows)):
                x = compute_block(store, spec, block)  # a new array a block: written as it is
                b = x.shape[0]
                x = x.reshape(b, len(names), 1, d_in).astype(dtype, copy=False)
                batch: dict[str, Any] = {name: x[:, j] for j, name in enumerate(names)}
                batch["row"] = rows[at : at + b]
                batch["example_id"] = ids
                writer.write(batch, slot=k % 2)  # at most two blocks held
                at += b
        fingerprint = saved(tmp, layout)
        os.replace(tmp, out)
        return opened(out, features, fingerprint)
    finally:
        if tmp.exists():  # a failed export (or the shuffled one's first file)
            shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()


Buffers = list[tuple[np.ndarray, np.ndarray]]
_SPARE: list[Buffers] = []  # the last export's two buffers (their pages mapped already), for the next
SPARE_BYTES = 8 << 20  # kept where each holds at most this many bytes of values


def _buffers(cap: int, d_in: int, dtype: str) -> Buffers:
    """Two buffers of ``cap`` rows (values, token ids): the last export's where they fit, else new
    ones (8.4 MB of fresh pages cost 2.2-2.6 ms to fault in and zero; reused, 0.35 ms)."""
    spare = _SPARE.pop() if _SPARE else None  # (one list op: a concurrent export takes it or not)
    if spare is not None and spare[0][0].shape == (cap, d_in) and spare[0][0].dtype == np.dtype(dtype):
        return spare
    return [(np.empty((cap, d_in), dtype=dtype), np.empty(cap, dtype=np.int32)) for _ in range(2)]


def _flush(writer: Writer, column: str, bufs: Buffers, cur: int, held: int, n: int) -> int:
    """Hand the whole windows of the ``held`` rows at the start of buffer ``cur`` (values, token ids)
    to the writer (one record batch), and move the rest (the start of a window cut by a block's end)
    to the front of the other buffer once its own batch is written; the rows left there."""
    (xs, ts), (nx, nt) = bufs[cur], bufs[1 - cur]
    k = held // n * n
    writer.wait(1 - cur)
    nx[: held - k], nt[: held - k] = xs[k:held], ts[k:held]
    batch = {column: xs[:k].reshape(-1, n, xs.shape[1]), "token_ids": ts[:k].reshape(-1, n)}
    writer.write(batch, cur)
    return held - k


READ_BYTES = 4 << 20  # the export's read blocks and record batches: up to 4 MiB of values, or batch_rows

PACK_HINT = "actstore ingest --positions all --pack --keep-special --context-length {n}"


def _windows(selection: Exported, spec: FeatureSpec, n: int) -> tuple[np.ndarray, np.ndarray]:
    """For each selected row (in selection order) whether it belongs to a whole window of ``n`` kept
    positions, and each row's token id (int32); refused with one line where the store's windows are
    not ``n`` kept positions."""
    store = selection.store
    if isinstance(n, bool) or n < 1:
        raise QueryError(f"to_hf_dataset: context_size must be a positive integer (got {n!r})")
    if len(spec.layers) != 1:
        raise QueryError("to_hf_dataset: context_size writes SAELens's cache of one hook: give one layer")
    ing = store.manifest.ingest
    hint = PACK_HINT.format(n=n)
    if ing.get("positions") != "all":
        raise QueryError(f"to_hf_dataset: context_size needs a corpus store of whole windows: {hint}")
    got = (ing.get("context_length"), bool(ing.get("pack")), ing.get("special"))
    if got != (n, True, "kept"):
        raise QueryError(
            f"to_hf_dataset: the store's windows are not {n} kept positions (context_length={got[0]}, "
            f"pack={got[1]}, special={got[2]}): ingest with {hint}"
        )
    rows = selection.rows.column("row").to_numpy()
    win, wpos, tok = _positions(store, rows)
    whole = _whole(win, wpos, n)
    if not whole.any():
        raise QueryError(f"to_hf_dataset: the selection holds no whole window of {n} positions ({hint})")
    return whole, tok


POSITIONS = ["row", "window_index", "window_position", "token_id"]


def _positions(store: Any, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """The window index, window position and token id of each of ``rows``, read from the positions
    table's files of their segments (no SQL statement: DuckDB's own cost was most of a 10^4-position
    export).  The table's rows ``min(rows)..max(rows)`` are cut out first (a file holds 16 segments);
    when they are ``rows`` themselves (a run of rows, as ``limit`` gives), they are taken as they are,
    else each row is looked up."""
    size = store.manifest.segment_size
    lo, hi = int(rows.min()), int(rows.max())
    pos = store.segments_table("positions", lo // size, hi // size, POSITIONS)
    part = _row_range(pos, lo, hi)
    if part.num_rows == rows.size and np.array_equal(part.column("row").to_numpy(), rows):
        return tuple(part.column(name).to_numpy() for name in POSITIONS[1:])
    prow = pos.column("row").to_numpy()
    order = None
    if prow.size > 1 and not (prow[1:] > prow[:-1]).all():
        order = np.argsort(prow, kind="stable")
        prow = prow[order]
    at = np.minimum(np.searchsorted(prow, rows), max(prow.size - 1, 0))
    if prow.size == 0 or not np.array_equal(prow[at], rows):
        raise QueryError(
            "to_hf_dataset: selected rows missing from the positions table (run actstore verify)"
        )
    if order is not None:
        at = order[at]
    return tuple(pos.column(name).to_numpy()[at] for name in POSITIONS[1:])


def _row_range(pos: Any, lo: int, hi: int) -> Any:
    """The rows of ``pos`` (an Arrow table) from the first ``row`` >= ``lo`` to the last <= ``hi``,
    found by bisection, each file's chunk taken as sorted (the caller checks what it gets)."""
    start = stop = None
    off = 0
    for chunk in pos.column("row").chunks:
        r = chunk.to_numpy()
        if r.size:
            if start is None and r[-1] >= lo:
                start = off + int(np.searchsorted(r, lo))
            if r[0] <= hi:
                stop = off + int(np.searchsorted(r, hi, "right"))
        off += r.size
    if start is None or stop is None or stop <= start:
        return pos.slice(0, 0)
    return pos.slice(start, stop - start)


def _whole(win: np.ndarray, wpos: np.ndarray, n: int) -> np.ndarray:
    """Whether each row belongs to a whole window: ``n`` rows of one window, at window positions
    0 .. n-1, consecutive in selection order."""
    m = win.size
    if m % n == 0:  # every run of n rows one whole window, and no two neighbours one window
        w, p = win.reshape(-1, n), wpos.reshape(-1, n)
        if (p == np.arange(n)).all() and (w == w[:, :1]).all() and (w[1:, 0] != w[:-1, 0]).all():
            return np.ones(m, dtype=bool)
    starts = np.flatnonzero(np.r_[True, win[1:] != win[:-1]])
    sizes = np.diff(np.r_[starts, m])
    in_run = np.arange(m) - np.repeat(starts, sizes)  # each row's place in its run of one window
    return np.repeat((sizes == n) & np.logical_and.reduceat(wpos == in_run, starts), sizes)


def _write_windows(
    selection: Exported,
    spec: FeatureSpec,
    out: Path,
    column: str,
    d_in: int,
    dtype: str,
    batch_rows: int,
    windows: tuple[np.ndarray, np.ndarray],
    shuffle: bool,
    seed: int,
) -> Any:
    """Write SAELens's cache layout: a row of ``[n, d_in]`` and ``n`` token ids per whole window."""
    import datasets

    store = selection.store
    whole, tok = windows
    n = int(store.manifest.ingest["context_length"])
    layout = window_layout(column, n, d_in, dtype)
    tmp = staging(out)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        arrow = tmp / SHARD
        at = held = cur = 0
        step = max(n, batch_rows // n * n)  # positions a read and record batch, at least
        # rows of whole windows gathered in the export's dtype (converted as they are placed: no
        # concatenation), read in blocks of up to READ_BYTES of values, at least batch_rows positions
        # (a store read and a file write cost less a row in larger blocks), each handed to the writer
        # as one record batch; two buffers, one filled while the other is written
        read = max(step, READ_BYTES // (d_in * np.dtype(dtype).itemsize) // n * n)
        cap = read + n
        bufs = _buffers(cap, d_in, dtype)
        direct, shape = bufs[0][0].dtype == np.float32, row_shape(store, spec)
        # the file's bytes at least: each window's values, token ids and two levels of offsets (the
        # schema and the batches' headers come on top), preallocated (nothing to cut back at the end)
        size = int(whole.sum()) // n * (n * (d_in * np.dtype(dtype).itemsize + 8) + 4)
        with Writer(layout, arrow, len(selection) > read and free_core(), size) as writer:
            for _ids, block in selection.blocks(read):
                b = len(_ids)
                keep = whole[at : at + b]
                if held + b > cap:  # (held < read, so it holds a whole window)
                    held, cur = _flush(writer, column, bufs, cur, held, n), 1 - cur
                xs, ts = bufs[cur]
                if direct and keep.all():  # computed straight into the buffer (float32)
                    compute_block(store, spec, block, out=xs[held : held + b].reshape(b, *shape))
                    ts[held : held + b] = tok[at : at + b]
                    held += b
                elif keep.any():
                    x = compute_block(store, spec, block).reshape(b, d_in)
                    x = x if keep.all() else x[keep]
                    xs[held : held + x.shape[0]] = x
                    ts[held : held + x.shape[0]] = tok[at : at + b][keep]
                    held += x.shape[0]
                at += b
                if held >= read:
                    held, cur = _flush(writer, column, bufs, cur, held, n), 1 - cur
            if held >= n:
                _flush(writer, column, bufs, cur, held, n)
        if bufs[0][0].nbytes <= SPARE_BYTES:  # every batch written: kept for the next export
            _SPARE[:] = [bufs]
        if shuffle:  # datasets' own shuffle and save (a second copy of the values)
            ds = datasets.Dataset.from_file(str(arrow)).shuffle(seed=seed).flatten_indices()
            ds.save_to_disk(str(tmp / "shuffled"))
            del ds
            os.replace(tmp / "shuffled", out)
            return datasets.Dataset.load_from_disk(str(out))
        fingerprint = saved(tmp, layout)
        os.replace(tmp, out)
        return opened(out, layout.features, fingerprint)
    finally:
        if tmp.exists():  # a failed export (or the shuffled one's first file)
            shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()
