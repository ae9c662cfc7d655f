"""Shared fixtures: real data paths, tiny models of each architecture, small stores built from them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FEWREL = SHARED_DATA / "fewrel" / "val_wiki.json"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread for the test: small ops are far faster so when the cores are shared.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """A Dask client on a real 2-worker LocalCluster (processes), one per test module."""
    from dask.distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                           silence_logs=logging.ERROR)
    with Client(cluster) as c:
        yield c
    cluster.close()


def build_store(
    out: Path,
    arch: str = "llama",
    *,
    dataset: str = "demo",
    limit: int = 3,
    storage_dtype: str = "float32",
    batch_size: int = 4,
    segment_size: int = 8,
    padding_side: str = "right",
    **options: Any,
) -> Path:
    """Ingest a few prompts with a tiny random model into ``out`` and return the path."""
    from ingest.align import tokenize_records
    from ingest.datasets import load_dataset
    from ingest.models import tiny_model
    from ingest.pipeline import IngestConfig, run_ingest

    loaded = tiny_model(arch)
    records = load_dataset(dataset, limit_per_relation=limit, **options).records
    prompts = tokenize_records(records, loaded.tokenizer)
    cfg = IngestConfig(out=str(out), batch_size=batch_size, storage_dtype=storage_dtype, segment_size=segment_size,
                       chunk_rows=4, chunk_flat=64, padding_side=padding_side, progress=False)
    info = {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash}
    run_ingest(loaded.model, loaded.tokenizer, info, prompts, cfg)
    return out


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 store of the demo corpus (3 facts per relation) written by tiny Llama."""
    return build_store(tmp_path_factory.mktemp("stores") / "tiny-llama")


@pytest.fixture(scope="session")
def store_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def make(arch: str = "llama", **kw: Any) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_store(tmp_path_factory.mktemp("stores") / f"{arch}", arch, **kw)
        return cache[key]

    return make
