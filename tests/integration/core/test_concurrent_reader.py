"""Readers opened while an ingest runs see whole committed segments only, and nothing else."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

import actstore
from actstore.core.verify import verify_store


def test_readers_during_ingest_see_only_committed_rows(tmp_path: Path) -> None:
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.models.tiny import tiny_model
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    out = tmp_path / "store"
    loaded = tiny_model("llama")
    prompts = tokenize_records(load_dataset("demo", limit_per_relation=5).records, loaded.tokenizer)
    cfg = IngestConfig(
        out=str(out),
        batch_size=4,
        segment_size=4,
        chunk_rows=2,
        chunk_flat=32,
        storage_dtype="float16",
        progress=False,
    )
    info = {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash}
    errors: list[BaseException] = []

    def ingest() -> None:
        try:  # a pause after each commit widens the windows a reader can land in
            ingest_prompts(
                loaded.model, loaded.tokenizer, info, prompts, cfg, on_segment=lambda s: time.sleep(0.05)
            )
        except BaseException as e:  # surfaced below
            errors.append(e)

    writer = threading.Thread(target=ingest)
    writer.start()
    seen: list[int] = []
    while writer.is_alive() or not seen:
        if not (out / "manifest.json").exists():
            time.sleep(0.01)
            continue
        s = actstore.open(out)
        committed = set(s.commits)
        n = s.sql(
            "SELECT (SELECT count(*) FROM examples) AS e, (SELECT count(*) FROM targets) AS t, "
            "(SELECT count(DISTINCT example_id) FROM tokens) AS k"
        ).to_pylist()[0]
        assert n["e"] == n["t"] == n["k"] == s.n_rows
        segs = set(s.sql("SELECT DISTINCT segment FROM targets").column("segment").to_pylist())
        assert segs == committed
        if s.n_rows:
            z = s.select().features("z")
            assert z.shape[0] == s.n_rows and np.isfinite(z).all()
        assert not seen or s.n_rows >= seen[-1]
        seen.append(s.n_rows)
        time.sleep(0.02)
    writer.join()
    assert not errors, errors
    final = actstore.open(out)
    assert final.complete and verify_store(final).ok
    assert len(set(seen)) >= 3, seen  # the reader really saw the store grow
    assert any(0 < n < final.n_rows for n in seen)
