"""The fixtures every test module may use; the shared helpers are in helpers.py."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import BuildCache, build_store

# The shared weights cache of every store the tests write (and of the commands they run): never the user's,
# and removed when the session ends (a SmolLM2 copy is 273 MB).
if not os.environ.get("ACTSTORE_WEIGHTS_DIR"):
    os.environ["ACTSTORE_WEIGHTS_DIR"] = tempfile.mkdtemp(prefix="actstore-test-weights-")
    atexit.register(shutil.rmtree, os.environ["ACTSTORE_WEIGHTS_DIR"], ignore_errors=True)


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

    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR
    )
    with Client(cluster) as c:
        yield c
    cluster.close()


@pytest.fixture(scope="session")
def store_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache = BuildCache()

    def make(arch: str = "llama", **kw: Any) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        return cache.get_or_build(
            key, lambda: build_store(tmp_path_factory.mktemp("stores") / f"{arch}", arch, **kw)
        )

    return make


@pytest.fixture(scope="session")
def tiny_store(store_factory: Callable[..., Path]) -> Path:
    """A float32 store of the demo corpus (3 facts per relation) written by tiny Llama (shared; built
    once per session even while mutmut records coverage: use ``store_factory`` for per-test builds)."""
    return store_factory("llama")


# The numeric tests (docs/testing.md, "Tolerances"): `make test-kernels` runs them again under the plain
# and AVX2 CPU kernels, so that no tolerance depends on the machine's vector kernels.
KERNEL_MODULES = {
    "test_loader",
    "test_features_out",
    "test_features_subsets",
    "test_oracles_capture",
    "test_oracles_probe",
    "test_oracles_readout",
    "test_exactness",
    "test_length_batching",
    "test_corpus_mode",
    "test_attribution",
    "test_tuned_lens",
    "test_tolerances",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in KERNEL_MODULES:
            item.add_marker(pytest.mark.kernels)
