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

import json
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypedDict

import numpy as np

from actstore.core.errors import QueryError
from actstore.query.select.features import FeatureSpec, RowBlock, compute_block, row_shape
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
    """Whether TransformerLens knows the model ``name`` (SAELens then hooks it by TL hook names)."""
    try:
        from transformer_lens.loading_from_pretrained import OFFICIAL_MODEL_NAMES
    except Exception:  # TransformerLens absent or broken: SAELens could not load it by TL either
        return False
    return name in OFFICIAL_MODEL_NAMES


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
    tmp = _staging(out)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a library call prints nothing (restored below)
    try:
        arrow = tmp / SHARD
        rows = selection.rows.column("row").to_numpy()
        at = 0
        with _Writer(features, arrow) as writer:
            for ids, block in selection.blocks(batch_rows):
                x = compute_block(store, spec, block)
                b = x.shape[0]
                x = x.reshape(b, len(names), 1, d_in).astype(dtype, copy=False)
                batch: dict[str, Any] = {name: x[:, j] for j, name in enumerate(names)}
                batch["row"] = rows[at : at + b]
                batch["example_id"] = ids
                writer.write_batch(batch)
                at += b
        fingerprint = _saved(tmp, features)
        os.replace(tmp, out)
        return _opened(out, features, fingerprint)
    finally:
        if tmp.exists():  # a failed export (or the shuffled one's first file)
            shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()


SHARD = "data-00000-of-00001.arrow"  # save_to_disk's file of a dataset of one shard


def _staging(out: Path) -> Path:
    """A new empty folder beside ``out`` (hidden, a random name, the umask's permissions) that the
    export fills and then renames to ``out``: nothing is left to remove after a complete export (an
    empty temporary folder's ``rmdir`` took 0.3-3 ms here)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = out.parent / f".hf-export-{secrets.token_hex(8)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _opened(folder: Path, features: Any, fingerprint: str) -> Any:
    """The dataset ``Dataset.load_from_disk(folder)`` gives for a folder :func:`_saved` wrote (one
    file, memory-mapped unless datasets' ``IN_MEMORY_MAX_SIZE`` says it is small, no format, its
    fingerprint), made from what the export already knows: load_from_disk's reading of the JSON files
    back, its thread pool and its format copy were a fixed 3-5 ms (a test compares the two)."""
    import datasets
    from datasets.table import InMemoryTable, MemoryMappedTable
    from datasets.utils.info_utils import is_small_dataset

    path = folder / SHARD
    table = (InMemoryTable if is_small_dataset(path.stat().st_size) else MemoryMappedTable).from_file(
        str(path)
    )
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)


def _saved(folder: Path, features: Any) -> str:
    """Make ``folder``, which holds the Arrow stream file :data:`SHARD` of ``features``, what
    ``Dataset.save_to_disk`` writes for the dataset of that file: its ``state.json`` (a dataset of
    one file, no format, a random fingerprint) and ``dataset_info.json``, written as save_to_disk
    (datasets 5) writes them, without save_to_disk's second copy of every value (a test compares
    them with save_to_disk's).  One shard at any size (``load_from_disk`` reads any number)."""
    import datasets

    state: dict[str, Any] = {
        "_data_files": [{"filename": SHARD}],
        "_fingerprint": os.urandom(8).hex(),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    # save_to_disk's asdict (it leaves out the fields at their defaults)
    info = datasets.utils.py_utils.asdict(datasets.DatasetInfo(features=features))
    with open(folder / "state.json", "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    with open(folder / "dataset_info.json", "w", encoding="utf-8") as f:
        json.dump({key: info[key] for key in sorted(info)}, f, indent=2)
    return str(state["_fingerprint"])


class _Writer:
    """An Arrow stream file of ``features`` (what ``datasets.arrow_writer.ArrowWriter`` writes: the schema
    with its ``huggingface`` metadata, then record batches), its batches built from the numpy blocks
    without a copy: an ``Array2D`` column's storage is two levels of list offsets over the values, a
    ``Sequence(length=n)`` a fixed-size list (ArrowWriter converts them value by value, which took more
    than the store's read)."""

    def __init__(self, features: Any, path: Path) -> None:
        import pyarrow as pa

        self.pa = pa
        self.schema = features.arrow_schema
        self.fields = [(f.name, f.type) for f in self.schema]  # (an extension type is rebuilt at each access)
        self.sink = pa.OSFile(str(path), "wb")
        self.writer = pa.ipc.new_stream(self.sink, self.schema)
        self._offsets: dict[tuple[int, int], Any] = {}

    def offsets(self, n: int, step: int) -> Any:
        """List offsets ``0, step, .., n * step`` (int32), made once a size."""
        key = (n, step)
        if key not in self._offsets:
            self._offsets[key] = self.pa.array(np.arange(0, n * step + 1, step, dtype=np.int32))
        return self._offsets[key]

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.writer.close()
        self.sink.close()

    def write_batch(self, batch: dict[str, np.ndarray]) -> None:
        pa = self.pa
        cols = []
        for name, typ in self.fields:
            x = np.ascontiguousarray(batch[name])
            if isinstance(typ, pa.ExtensionType):  # Array2D: [rows, a, b]
                rows, a, b = x.shape
                inner = pa.ListArray.from_arrays(self.offsets(rows * a, b), pa.array(x.reshape(-1)))
                outer = pa.ListArray.from_arrays(self.offsets(rows, a), inner)
                cols.append(pa.ExtensionArray.from_storage(typ, outer))
            elif pa.types.is_fixed_size_list(typ):
                cols.append(pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]))
            else:
                cols.append(pa.array(x, type=typ))
        self.writer.write_batch(pa.RecordBatch.from_arrays(cols, schema=self.schema))


def _flush(writer: _Writer, column: str, xs: np.ndarray, ts: np.ndarray, held: int, n: int) -> int:
    """Write the whole windows of the ``held`` rows at the start of ``xs`` (their token ids ``ts``) and
    move the rest (the start of a window cut by a block's end) to the front; the rows left."""
    k = held // n * n
    writer.write_batch({column: xs[:k].reshape(-1, n, xs.shape[1]), "token_ids": ts[:k].reshape(-1, n)})
    xs[: held - k], ts[: held - k] = xs[k:held], ts[k:held]  # written out already: the buffers are free
    return held - k


PACK_HINT = "actstore ingest --positions all --pack --keep-special --context-length {n}"


def _windows(selection: Exported, spec: FeatureSpec, n: int) -> tuple[np.ndarray, np.ndarray]:
    """For each selected row (in selection order) whether it belongs to a whole window of ``n`` kept
    positions, and each row's token id; refused with one line where the store's windows are not
    ``n`` kept positions."""
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
    # the positions of the selected rows' segments, read from the table's files (no SQL statement:
    # DuckDB's own cost was most of a 10^4-position export)
    size = store.manifest.segment_size
    pos = store.segments_table(
        "positions",
        int(rows.min()) // size,
        int(rows.max()) // size,
        ["row", "window_index", "window_position", "token_id"],
    )
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

    def column(name: str) -> np.ndarray:
        return pos.column(name).to_numpy()[at].astype(np.int64)

    win, wpos, tok = column("window_index"), column("window_position"), column("token_id")
    # a whole window: n selected rows of one window, at positions 0 .. n-1, consecutive in store order
    starts = np.flatnonzero(np.r_[True, win[1:] != win[:-1]])
    sizes = np.diff(np.r_[starts, win.size])
    in_run = np.arange(win.size) - np.repeat(starts, sizes)  # each row's place in its run of one window
    whole = np.repeat((sizes == n) & np.logical_and.reduceat(wpos == in_run, starts), sizes)
    if not whole.any():
        raise QueryError(f"to_hf_dataset: the selection holds no whole window of {n} positions ({hint})")
    return whole, tok


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
    features = datasets.Features(
        {
            column: datasets.Array2D(shape=(n, d_in), dtype=dtype),
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=n),
        }
    )
    tmp = _staging(out)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        arrow = tmp / SHARD
        at = 0
        held = 0
        step = max(n, batch_rows // n * n)
        # rows of whole windows gathered in the export's dtype (converted as they are placed: no
        # concatenation), written a record batch of about batch_rows positions at a time
        xs = np.empty((2 * step, d_in), dtype=dtype)
        ts = np.empty(2 * step, dtype=np.int32)
        direct, shape = xs.dtype == np.float32, row_shape(store, spec)
        with _Writer(features, arrow) as writer:
            for _ids, block in selection.blocks(step):
                b = len(_ids)
                keep = whole[at : at + b]
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
                if held >= step:
                    held = _flush(writer, column, xs, ts, held, n)
            if held >= n:
                _flush(writer, column, xs, ts, held, n)
        if shuffle:  # datasets' own shuffle and save (a second copy of the values)
            ds = datasets.Dataset.from_file(str(arrow)).shuffle(seed=seed).flatten_indices()
            ds.save_to_disk(str(tmp / "shuffled"))
            del ds
            os.replace(tmp / "shuffled", out)
            return datasets.Dataset.load_from_disk(str(out))
        fingerprint = _saved(tmp, features)
        os.replace(tmp, out)
        return _opened(out, features, fingerprint)
    finally:
        if tmp.exists():  # a failed export (or the shuffled one's first file)
            shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()
