"""The store a capture writes, in either mode (target prompts, :mod:`actstore.ingest.pipeline`; corpus
positions, :mod:`actstore.ingest.corpus`): its manifest, the tokenizer files it keeps and its writer
(created, or resumed), a segment's write and commit, the ingest's ``runs`` row, and the report."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core._version import __version__
from actstore.core.manifest import Manifest
from actstore.core.runs import new_run_id, write_run
from actstore.core.segments import tokenizer_file_name_ok
from actstore.core.storage.base import StoreLocation
from actstore.core.tables import sha256
from actstore.core.writer import StoreWriter
from actstore.ingest.capture.architectures import Architecture
from actstore.ingest.ranks import rank_zero_first
from actstore.ingest.settings import IngestConfig


@dataclass
class IngestReport:
    store: str
    n_examples: int
    segments_written: int
    segments_skipped: int
    seconds: float
    forward_seconds: float


def store_manifest(
    model: torch.nn.Module,
    arch: Architecture,
    model_info: dict[str, Any],
    n_examples: int,
    ingest: dict[str, Any],
    cfg: IngestConfig,
) -> Manifest:
    """A new store's manifest: the capture settings of ``cfg``, the model's dtype and ``cfg.extra``
    recorded with the mode's own ``ingest`` settings (target prompts or a corpus plan)."""
    settings = {
        "batch_size": cfg.batch_size,
        **ingest,
        "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        **cfg.extra,
    }
    return Manifest(
        geometry=arch.geometry(model),
        model=model_info,
        storage_dtype=cfg.storage_dtype,
        segment_size=cfg.segment_size,
        n_examples=n_examples,
        chunk_rows=cfg.chunk_rows,
        chunk_flat=cfg.chunk_flat,
        chunk_layers=cfg.chunk_layers,
        ingest=settings,
        architecture={"family": arch.name},
        code_version=__version__,
    )


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name ({} for an object that cannot save itself).

    The store keeps them under ``tokenizer/`` so that analyses that need only the tokenizer (MAPS)
    read it from the store (:mod:`actstore.query.select.store_tokenizer`) instead of loading the model package."""
    save = getattr(tokenizer, "save_pretrained", None)
    if save is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="actstore-tokenizer-") as tmp:
        save(tmp)
        out: dict[str, bytes] = {}
        for path in sorted(Path(tmp).iterdir()):
            if not path.is_file() or not tokenizer_file_name_ok(path.name):
                raise ValueError(f"tokenizer.save_pretrained wrote {path.name!r}, which a store cannot hold")
            out[path.name] = path.read_bytes()
    return out


def with_tokenizer(model_info: dict[str, Any], files: dict[str, bytes]) -> dict[str, Any]:
    """``model_info`` recording the tokenizer files' SHA-256 (``model.tokenizer``)."""
    if not files:
        return model_info
    return {**model_info, "tokenizer": {"files": {name: sha256(data) for name, data in files.items()}}}


def open_writer(
    loc: StoreLocation,
    manifest: Manifest,
    model: torch.nn.Module,
    arch: Architecture,
    files: dict[str, bytes],
    cfg: IngestConfig,
) -> tuple[StoreWriter, set[int], list[int], list[int]]:
    """The store's writer (resumed, or created by rank 0 with the weights and ``files`` while the other
    ranks wait: :mod:`actstore.ingest.ranks`), the committed segments, this rank's segments and those
    of them not yet committed."""
    if cfg.resume:
        writer = StoreWriter.resume(loc, manifest)
    else:

        def create() -> StoreWriter:
            weights, attrs = arch.weights(model)
            return StoreWriter.create(loc, manifest, weights, attrs, overwrite=cfg.overwrite, files=files)

        writer = rank_zero_first(
            create, lambda: StoreWriter.resume(loc, manifest), cfg.rank, cfg.world_size, loc
        )
    done = writer.committed()
    mine = [s for s in range(manifest.n_segments) if s % cfg.world_size == cfg.rank]
    return writer, done, mine, [s for s in mine if s not in done]


def quiet(message: str) -> None:
    """A log that says nothing (for the compactions the capture runs)."""


def write_segment(
    writer: StoreWriter,
    seg: int,
    lo: int,
    arrays: dict[str, np.ndarray],
    tables: dict[str, pa.Table],
    on_segment: Callable[[int], None] | None,
) -> None:
    """Write and commit segment ``seg`` (its first row ``lo``), then tell ``on_segment``."""
    writer.write_segment(seg, lo, arrays, tables)
    if on_segment is not None:
        on_segment(seg)


def record_ingest_run(
    writer: StoreWriter, cfg: IngestConfig, manifest: Manifest, started: float, n_segments: int
) -> None:
    """The ingest's ``runs`` row (this rank's, with the segments it wrote)."""
    config = {k: v for k, v in asdict(cfg).items() if k != "extra"} | {"extra": cfg.extra}
    write_run(
        writer,
        new_run_id("ingest"),
        "ingest",
        started,
        config,
        segments_written=n_segments,
        rank=cfg.rank,
        world_size=cfg.world_size,
    )
