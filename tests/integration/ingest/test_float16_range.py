"""A float16 store cannot hold an activation past float16's range (65504): the ingest stops with one
line naming --dtype before the segment is written, instead of storing infinity; a bfloat16 store of
the same model keeps the values (checked against the model's own embedding rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import actstore
from actstore.core.errors import InvalidSetting
from actstore.ingest.align import tokenize_records
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.models.tiny import tiny_model
from actstore.ingest.pipeline import ingest_prompts
from actstore.ingest.settings import IngestConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def ingest(out: Path, dtype: str) -> tuple[Path, np.ndarray, list[list[int]]]:
    loaded = tiny_model("llama")
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight.mul_(1e6)  # residual 0 is the embedding: past 65504
    prompts = tokenize_records(load_dataset("demo", limit_per_relation=2).records, loaded.tokenizer)
    cfg = IngestConfig(
        out=str(out), storage_dtype=dtype, batch_size=4, segment_size=4, progress=False, weights="none"
    )
    info = {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash}
    ingest_prompts(loaded.model, loaded.tokenizer, info, prompts, cfg)
    emb = loaded.model.get_input_embeddings().weight.detach().float().numpy()
    return out, emb, [p.input_ids for p in prompts]


def test_float16_refuses_and_bfloat16_keeps(tmp_path: Path) -> None:
    with pytest.raises(InvalidSetting, match="--dtype bfloat16 or float32") as e:
        ingest(tmp_path / "f16", "float16")
    assert "\n" not in str(e.value) and "resid" in str(e.value)
    assert not list((tmp_path / "f16").glob("segments/*/commit*"))  # no segment committed
    out, emb, ids = ingest(tmp_path / "bf16", "bfloat16")
    s = actstore.open(out)
    r0 = s.select().features("resid", layers=[0])[:, 0]  # each prompt's last token, residual 0
    want = emb[[p[-1] for p in ids]]
    assert np.abs(want).max() > 65504 and np.isfinite(r0).all()
    np.testing.assert_allclose(r0, want, rtol=2**-8)  # bfloat16's 8 significant bits
