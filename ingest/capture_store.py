"""The capture both modes run (target prompts, :mod:`actstore.ingest.pipeline`; corpus positions,
:mod:`actstore.ingest.corpus`) and the store it writes: its manifest, the tokenizer files it keeps,
its writer (created, or resumed), the loop over the segments, the ingest's ``runs`` row and the report.

Every row and segment is fixed before the model runs (the prompts are tokenized, the corpus planned).
Each segment is captured (by the mode, batch by batch); its host arrays go to a writer thread that
compresses, writes and commits them while the next segment runs.  At most two segments wait for the
writer, so memory is bounded by the segment size, not the corpus size.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core._version import __version__
from actstore.core.compact import compact_held, compacted_fully
from actstore.core.errors import InvalidSetting, RankError
from actstore.core.layout import TOKENIZER_DIR
from actstore.core.lock import holding
from actstore.core.manifest import Manifest
from actstore.core.progress import progress_bar
from actstore.core.runs import new_run_id, write_run
from actstore.core.segments import tokenizer_file_name_ok
from actstore.core.storage.base import StoreLocation
from actstore.core.tables import sha256
from actstore.core.writer import StoreWriter
from actstore.ingest.capture.architectures import Architecture, architecture_for, weights_key
from actstore.ingest.capture.fused import FusedCapture
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

        def create() -> StoreWriter:  # the weights extracted only when the cache's index lacks the model
            key = weights_key(model, arch, str(manifest.model.get("weight_hash") or ""))
            return StoreWriter.create(
                loc,
                manifest,
                lambda: arch.weights(model),
                overwrite=cfg.overwrite,
                files=files,
                weights_mode=cfg.weights,
                weights_key=key,
            )

        writer = rank_zero_first(
            create, lambda: StoreWriter.resume(loc, manifest), cfg.rank, cfg.world_size, loc
        )
    done = writer.committed()
    mine = [s for s in range(manifest.n_segments) if s % cfg.world_size == cfg.rank]
    return writer, done, mine, [s for s in mine if s not in done]


def quiet(message: str) -> None:
    """A log that says nothing (for the compactions the capture runs)."""


@dataclass(frozen=True)
class CapturedSegment:
    """A segment as its mode captured it: the arrays and tables the writer thread writes, and the
    seconds its forward passes took."""

    arrays: dict[str, np.ndarray]
    tables: dict[str, pa.Table | bytes]  # (or their Parquet bytes: StoreWriter.write_segment)
    forward_seconds: float


@dataclass(frozen=True)
class CaptureMode:
    """What a mode brings to :func:`capture_segments`: the store's rows, its own ``ingest`` settings for the
    manifest, the unit the progress bar counts, and ``capture_segment(capture, seg, n_before, bar)``:
    segment ``seg`` captured (``n_before``: the segments committed before it, by earlier ingests and this
    one); ``check``: run once the manifest is made, before the store is touched; ``values_checked``:
    ``capture_segment`` checked every value (the writer thread does not test float16 arrays for
    infinity again).  A corpus store's arrays hold its kept layers only (the writer writes the others
    as zeros: :meth:`~actstore.core.writer.StoreWriter.write_segment`)."""

    n_rows: int
    ingest: dict[str, Any]
    unit: str
    capture_segment: Callable[[FusedCapture, int, int, Any], CapturedSegment]
    check: Callable[[], None] | None = None
    values_checked: bool = False
    desc: str = "ingest"  # the progress bar's name


def require_lock(loc: StoreLocation) -> None:
    """Refuse a store whose writer lock this process does not hold."""
    if not holding(loc.url):
        raise RankError(
            f"the writer lock of {loc.url} is not held (take it with actstore.core.lock.writer_lock)"
        )


def capture_segments(
    loc: StoreLocation,
    model: torch.nn.Module,
    tokenizer: Any,
    model_info: dict[str, Any],
    cfg: IngestConfig,
    mode: CaptureMode,
    *,
    on_segment: Callable[[int], None] | None = None,
) -> IngestReport:
    """Capture the ``mode.n_rows`` rows of the store at ``loc`` (writer lock held: :func:`require_lock`):
    this rank's segments not yet committed, each by ``mode.capture_segment``, written and committed by a
    writer thread (``on_segment`` is told each one committed)."""
    arch = architecture_for(model)
    tok_files = tokenizer_files(tokenizer)
    model_info = with_tokenizer(model_info, tok_files)
    n_rows = mode.n_rows
    manifest = store_manifest(model, arch, model_info, n_rows, mode.ingest, cfg)
    if mode.check is not None:
        mode.check()
    files = {f"{TOKENIZER_DIR}/{name}": data for name, data in tok_files.items()}
    writer, done, mine, todo = open_writer(loc, manifest, model, arch, files, cfg)
    started = time.time()
    forward_s = 0.0
    pending: list[Future[Any]] = []
    S = cfg.segment_size
    n_todo = sum(min(S, n_rows - s * S) for s in todo)
    bar = progress_bar(total=n_todo, unit=mode.unit, desc=mode.desc, enabled=cfg.progress and cfg.rank == 0)
    with FusedCapture(model, arch, cfg.storage_dtype) as capture, ThreadPoolExecutor(max_workers=1) as pool:
        for k, seg in enumerate(todo):
            part = mode.capture_segment(capture, seg, len(done) + k, bar)
            forward_s += part.forward_seconds
            while len(pending) >= 2:  # backpressure: bounded host memory
                pending.pop(0).result()
            pending.append(pool.submit(_write, writer, seg, seg * S, part, on_segment, mode.values_checked))
            if cfg.world_size == 1 and cfg.compact_every and (k + 1) % cfg.compact_every == 0:
                # (the pool's one thread runs it after the writes before it: a snapshot of committed segments)
                pending.append(pool.submit(compact_held, loc, full=False, log=quiet))
        for f in pending:
            f.result()
    bar.close()
    record_ingest_run(writer, cfg, manifest, started, len(todo))
    # ranks: rank 0 compacts once every rank is done (actstore.jobs.ingest); a resume that wrote nothing,
    # of a store whose final snapshot is current already (killed as it exited), has nothing to compact
    # (asked only then: a run that wrote segments compacts without reading the commits twice)
    if cfg.world_size == 1 and (todo or not compacted_fully(loc)):
        compact_held(loc, full=True, log=quiet)
    return IngestReport(cfg.out, n_rows, len(todo), len(mine) - len(todo), time.time() - started, forward_s)


#: The largest magnitude float16 holds; a larger value is stored as infinity.
FLOAT16_MAX = float(np.finfo(np.float16).max)


def finite16(a: np.ndarray) -> bool:
    """Every value of float16 ``a`` finite: no exponent field of all ones (infinity, NaN), tested on
    the bits (numpy's ``isfinite`` converts float16 one value at a time: 3-4x longer)."""
    bits = np.ascontiguousarray(a).view(np.uint16)
    return not bool(np.any((bits & 0x7C00) == 0x7C00))


def _write(
    writer: StoreWriter,
    seg: int,
    lo: int,
    part: CapturedSegment,
    on_segment: Callable[[int], None] | None,
    checked: bool = False,
) -> None:
    """Write and commit segment ``seg`` (its first row ``lo``), then tell ``on_segment``; a float16
    array holding infinity (an activation past float16's 65504, or one the model made infinite) is
    refused before anything of the segment is written (unless ``checked``: by the capture already)."""
    for name, a in part.arrays.items():
        if not checked and a.dtype == np.float16 and a.size and not finite16(a):
            raise InvalidSetting(
                "storage_dtype",
                f"segment {seg}: {name} holds values past float16's range ({FLOAT16_MAX:g}), stored as infinity: "
                "ingest this model with --dtype bfloat16 or float32",
            )
    writer.write_segment(seg, lo, part.arrays, part.tables)
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
