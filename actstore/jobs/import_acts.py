"""``actstore.write_corpus`` / ``actstore import``: activations captured elsewhere (a TransformerLens cache,
nnsight saves, vLLM ``extract_hidden_states`` files) written into a corpus store
(:mod:`actstore.ingest.external`; docs/interop.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actstore.core.errors import InvalidSetting
from actstore.core.lock import LOCK_ENV
from actstore.core.ownership import check_root, discard_created
from actstore.core.storage import locate
from actstore.ingest.capture_store import IngestReport
from actstore.ingest.external import ExternalWindow, windows_from_mapping, windows_from_vllm, write_windows
from actstore.ingest.models.registry import load_model
from actstore.ingest.ranks import barrier, compact_after_ranks, join_process_group, ranks_writer_lock
from actstore.ingest.settings import IngestConfig


def source_windows(
    source: Any, tokens: Any = None, layer_ids: Sequence[int] | None = None
) -> tuple[list[ExternalWindow], str]:
    """The windows of ``source`` and its kind: a folder or list of vLLM safetensors files (with
    ``layer_ids``), or a mapping (TransformerLens cache, nnsight saves) with the ``tokens`` it ran on."""
    if isinstance(source, (str, os.PathLike)) or (
        isinstance(source, (list, tuple)) and source and isinstance(source[0], (str, os.PathLike))
    ):
        paths = [Path(source)] if isinstance(source, (str, os.PathLike)) else [Path(p) for p in source]
        files = [f for p in paths for f in (sorted(p.glob("*.safetensors")) if p.is_dir() else [p])]
        if not files:
            raise InvalidSetting("source", f"no .safetensors file in {', '.join(map(str, paths))}")
        if not layer_ids:
            raise InvalidSetting(
                "layer_ids", "vLLM files need the eagle_aux_hidden_state_layer_ids they were written with"
            )
        return windows_from_vllm(files, layer_ids), "import:vllm"
    if isinstance(source, (list, tuple)) and source and all(isinstance(w, ExternalWindow) for w in source):
        return list(source), "import:windows"
    if isinstance(source, (list, tuple)) and source and hasattr(source[0], "keys"):  # one cache a run
        if not isinstance(tokens, (list, tuple)) or len(tokens) != len(source):
            raise InvalidSetting("tokens", f"{len(source)} caches need a list of as many token-id tensors")
        parts = [source_windows(c, t) for c, t in zip(source, tokens)]
        return [w for ws, _ in parts for w in ws], parts[0][1]
    if isinstance(source, Mapping) or hasattr(source, "keys"):
        if tokens is None:
            raise InvalidSetting(
                "tokens", "a cache or saves need the token ids [batch, pos] they were run on"
            )
        kind = "tlens" if type(source).__module__.startswith("transformer_lens") else "mapping"
        return windows_from_mapping(source, tokens), f"import:{kind}"
    raise InvalidSetting("source", f"cannot read a {type(source).__name__} (a cache, saves, or vLLM files)")


def read_source(paths: Sequence[str]) -> tuple[Any, Any]:
    """The command line's SOURCE: vLLM files (a folder, or files holding ``hidden_states`` and
    ``token_ids``), returned as paths; or one saved cache (``.safetensors`` or ``torch.save``'d ``.pt``
    of name -> tensor with the token ids under ``tokens``), returned as (mapping, tokens)."""
    first = Path(paths[0])
    if first.is_dir() or len(paths) > 1:
        return list(paths), None
    if not first.is_file():
        raise InvalidSetting("source", f"{first}: no such file or folder")
    if first.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(first), "pt") as f:
            keys = set(f.keys())
            if keys == {"hidden_states", "token_ids"}:
                return list(paths), None
            data = {k: f.get_tensor(k) for k in keys}
    else:
        try:
            data = torch.load(first, map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle that is not plain tensors, or not a torch file
            raise InvalidSetting("source", f"{first}: not a saved cache ({type(e).__name__})") from None
        if not isinstance(data, Mapping):
            raise InvalidSetting("source", f"{first}: holds a {type(data).__name__}, not name -> tensor")
    if "tokens" not in data:
        raise InvalidSetting("source", f"{first}: a saved cache needs its token ids under 'tokens'")
    data = dict(data)
    return data, data.pop("tokens")


# Rows per chunk file of an import's arrays (the ingest's 32 made a file of a few KB per layer chunk:
# creating the files cost more than writing their bytes); a read of a few rows reads 256-row chunks.
IMPORT_CHUNK_ROWS = 256
SEGMENT_BYTES = 16 << 20  # stored residual bytes a segment, about: one commit (marker, tables, digests) each


def segment_rows(n_layers: int, d_model: int, storage_dtype: str) -> int:
    """Positions a segment of an import: about :data:`SEGMENT_BYTES` of stored residuals (``n_layers``
    layers of ``d_model``), a multiple of 256, at least 256: a commit's fixed cost (its marker, tables,
    digests and directory) is then small beside its bytes, and the host holds a few segments at most
    (at most 16,384 positions: an interrupted import loses little)."""
    row = max(1, n_layers) * d_model * (4 if storage_dtype == "float32" else 2)
    return min(16384, max(256, SEGMENT_BYTES // row // 256 * 256))


def write_corpus(
    out: str | os.PathLike[str],
    source: Any,
    *,
    model: str = "tiny-llama",
    tokens: Any = None,
    layer_ids: Sequence[int] | None = None,
    storage_dtype: str = "float32",
    segment_size: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    predict: bool = True,
    weights: str = "shared",
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    progress: bool = False,
) -> IngestReport:
    """Write ``source`` (see :func:`source_windows`) into a corpus store at ``out``; ``model``: the model
    it was captured from (an alias, hub name or folder: its weights, tokenizer and geometry go in the
    store and every shape is checked against it before anything is written); ``predict=False``: no
    predictions from the last residual (its logits over the vocabulary cost more than the import);
    ``segment_size``: positions per commit (None: :func:`segment_rows`, about 16 MiB of stored
    residuals a segment); ``weights``: shared, copy or none, as ``actstore ingest --weights``
    (docs/storage.md); ``rank``, ``world_size``: this process's place among ranks that write one store
    together (``actstore import --procs N``, or torchrun: :mod:`actstore.ingest.ranks`), each the
    segments ``s % world_size == rank``, rank 0 creating the store and compacting it at the end;
    ``device``: where the model computes the predictions (``cuda``: the head's logits over the
    vocabulary on the GPU; the activations are read, checked and written on the host); ``progress``: a
    bar of the positions written on stderr (rank 0's)."""
    windows, spec = source_windows(source, tokens, layer_ids)
    loc = locate(os.fspath(out))
    if not resume:  # a store there without --overwrite: refused before the model loads
        check_root(loc, overwrite=overwrite)
    launched = bool(os.environ.get(LOCK_ENV))  # under --procs, whose launcher removes a failed new store
    loaded = load_model(model, device=device, dtype=torch.float32)
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.external import check_windows

    g = architecture_for(loaded.model).geometry(loaded.model)
    check_windows(windows, g, storage_dtype, values=False)  # the shapes, before the store is touched
    if segment_size is None:
        segment_size = segment_rows(len(windows[0].resid), g.d_model, storage_dtype)
    grouped = join_process_group(rank, world_size)
    with ranks_writer_lock(loc, rank, world_size, grouped, lambda m: None, "actstore import"):
        # a new store (the root missing or empty): the values are checked as each segment is cast, one
        # read of the files, and a store that meets a bad one is removed (by --procs's launcher when
        # ranks write it); else (a store to overwrite, a resume, ranks under a bare torchrun) they are
        # checked first, each rank its own segments' windows, so that nothing stored is lost to a bad file
        fresh = not resume and check_root(loc, overwrite=overwrite) is None
        cast_check = fresh and (world_size == 1 or launched)
        if not cast_check:
            mine = None if world_size == 1 else rank_windows(windows, segment_size, rank, world_size)
            check_windows(windows, g, storage_dtype, only=mine)
        if grouped:
            barrier()  # every rank has looked and checked before rank 0 can create (or overwrite) the store
        model_info = {
            "name": loaded.name,
            "source": loaded.source,
            "architecture": loaded.architecture,
            "weight_hash": loaded.weight_hash,
            "dtype": "float32",
        }
        cfg = IngestConfig(
            out=loc.url,
            batch_size=1,
            storage_dtype=storage_dtype,
            segment_size=segment_size,
            chunk_rows=min(IMPORT_CHUNK_ROWS, segment_size),
            resume=resume,
            overwrite=overwrite,
            progress=progress,
            weights=weights,
            rank=rank,
            world_size=world_size,
            extra={"dataset": spec, "kinds": ["resid"]},
        )
        try:
            report = write_windows(
                loc, loaded.model, loaded.tokenizer, model_info, windows, spec, cfg, predict, cast_check
            )
        except InvalidSetting:
            if fresh and world_size == 1:
                discard_created(loc)
            raise
        compact_after_ranks(loc, rank, grouped)  # one snapshot of every rank's segments, by rank 0
        return report


def rank_windows(windows: Sequence[ExternalWindow], segment_size: int, rank: int, world: int) -> set[int]:
    """The windows holding rows of the segments ``s % world == rank`` (one after another, in order)."""
    ends = np.cumsum([w.ids.size for w in windows])
    starts = ends - np.array([w.ids.size for w in windows])
    return {
        k
        for k in range(len(windows))
        if any(
            s % world == rank
            for s in range(int(starts[k]) // segment_size, (int(ends[k]) - 1) // segment_size + 1)
        )
    }
