"""What the tests share besides fixtures (those are in conftest.py): data paths, skips that become
failures in CI, and small stores built with tiny random models.

Data.  Every code path is tested on small fixtures the project wrote itself (``tests/data/``,
same formats as the public data sets, see its README).  Tests that need the *full* public data
sets carry the ``real_data`` marker and read them from ``$ACTSTORE_DATA`` (default
``../shared/data`` beside the repository).  Without the data they skip with one line saying how
to get it; with ``ACTSTORE_REQUIRE_REAL=1`` (set by ``.ci/run``) missing data, a missing
Chromium or a missing model package is a failure instead of a skip.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data"
REAL_DATA = Path(os.environ.get("ACTSTORE_DATA") or REPO.parent / "shared" / "data")
REQUIRE_REAL = os.environ.get("ACTSTORE_REQUIRE_REAL", "") not in ("", "0")
# A small store of invented known_1000 facts (two relations, 5 facts each): trace, lens and methods tests.
KNOWN_STORE_KW: dict[str, Any] = {
    "dataset": f"known1000:{FIXTURES / 'known_1000' / 'known_1000.json'}",
    "limit": 5,
    "relations": ("P30", "P103"),
}
# The device and model dtype of the capture exactness tests (test_exactness, test_oracles_capture):
# CPU and float32 unless set; benchmarks/gpu.sh runs them again with ACTSTORE_TEST_DEVICE=cuda, in float32
# and in bfloat16 (ACTSTORE_TEST_DTYPE).  Their tolerance (docs/testing.md, "Tolerances"): relative to the
# largest entry of the compared array, 1e-4 for a float32 model (rounding only), 2^-3 for a bfloat16 model
# (the batched, padded capture and the one-prompt oracle each round every layer's output to 8 significant
# bits, and the differences grow through the layers and sharp softmaxes: measured on the CPU, 0.064 for the
# unscaled GPT-2 (near one-hot attention), 0.041 for Gemma 3's attn_prob, most below 0.02).  An indexing
# error (a wrong head, source, position or neuron group) is of the order of the values themselves.
TEST_DEVICE = os.environ.get("ACTSTORE_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("ACTSTORE_TEST_DTYPE", "float32")
CAPTURE_RTOL = {"float32": 1e-4, "bfloat16": 2.0**-3}[TEST_DTYPE]
GET_DATA = (
    "set ACTSTORE_DATA to a folder holding the public data sets "
    "(fewrel/, lre_relations/, maps/, known_1000/, codex_m/; see tests/data/README.md for their sources)"
)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The peer tools' own warnings and progress bars silenced (pytest turns warnings into errors)."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def missing(what: str, how: str) -> None:
    """Skip the test (one line naming ``what`` is missing and ``how`` to get it), or fail under
    ``ACTSTORE_REQUIRE_REAL=1`` (CI), where every real-data, browser and model-package test must run."""
    msg = f"{what} is missing: {how}"
    if REQUIRE_REAL:
        pytest.fail(f"{msg} (ACTSTORE_REQUIRE_REAL=1: required here)", pytrace=False)
    pytest.skip(msg)


def real_data(relative: str) -> Path:
    """The path of ``relative`` inside ``$ACTSTORE_DATA``; skips (fails in CI) when it is absent.
    Call it from tests marked ``@pytest.mark.real_data``."""
    path = REAL_DATA / relative
    if not path.exists():
        missing(f"real data {path}", GET_DATA)
    return path


def require_chromium() -> str:
    """Path of a Chromium binary; skips (fails in CI) when none is installed."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        missing("chromium", "apt-get install -y chromium")
    assert exe is not None
    return exe


def require_module(name: str, install: str) -> None:
    """Skips (fails in CI) when the importable distribution ``name`` is absent.  The module is
    located, never imported (model packages are data files)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        missing(f"package {name}", install)


def on_test_device(loaded: Any) -> Any:
    """``loaded`` (a :class:`~actstore.ingest.models.LoadedModel`) with its model moved, in place, to
    :data:`TEST_DEVICE` and :data:`TEST_DTYPE` (its ``weight_hash``, of the float32 weights, kept)."""
    from actstore.ingest.models.base import prepare

    prepare(loaded.model, TEST_DEVICE, getattr(torch, TEST_DTYPE))
    return loaded


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor of any device and dtype as a float32 numpy array."""
    return t.detach().float().cpu().numpy()


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
    chunk_layers: int = 1,
    compact_every: int = 64,
    weights: str = "copy",
    resume: bool = False,
    **options: Any,
) -> Path:
    """Ingest a few prompts with a tiny random model into ``out`` and return the path (``chunk_layers``:
    layers per chunk, 1 as ``actstore ingest`` writes by default; 0 the whole layer axis per chunk;
    ``weights``: copy, so that a test may damage or measure the store's own ``weights/``)."""
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.models.tiny import tiny_model
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    loaded = on_test_device(tiny_model(arch))
    records = load_dataset(dataset, limit_per_relation=limit, **options).records
    prompts = tokenize_records(records, loaded.tokenizer)
    cfg = IngestConfig(
        out=str(out),
        batch_size=batch_size,
        storage_dtype=storage_dtype,
        segment_size=segment_size,
        chunk_rows=4,
        chunk_flat=64,
        chunk_layers=chunk_layers,
        padding_side=padding_side,
        compact_every=compact_every,
        device=TEST_DEVICE,
        progress=False,
        weights=weights,
        resume=resume,
    )
    info = {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash}
    ingest_prompts(loaded.model, loaded.tokenizer, info, prompts, cfg)
    return out


def uncompact(store: Path) -> Path:
    """``store`` without its snapshot and compacted files: a store read from its commit markers and
    per-segment shards, as while an ingest runs (a valid store: the shards are never removed)."""
    import shutil

    shutil.rmtree(store / "snapshot", ignore_errors=True)
    from actstore.core.snapshot import is_compacted_file, is_index_file

    for f in (store / "tables").glob("*/*.parquet"):  # compacted files and relation index files only
        rel = f.relative_to(store).as_posix()
        if is_compacted_file(rel) or is_index_file(rel):
            f.unlink()
    return store


def recording_mutation_coverage() -> bool:
    """True while mutmut runs the suite once to record which tests call which functions
    (``make mutants``).  Cached stores must then be rebuilt in every test: mutmut reruns only the
    tests it saw calling a mutated function, and a store built once for many tests would count
    for the first of them alone, so the tests that check the store's values would never run."""
    return os.environ.get("MUTANT_UNDER_TEST") == "stats"


class BuildCache(dict[Any, Any]):
    """Things built once and shared by many tests (stores, oracles), rebuilt per call while
    :func:`recording_mutation_coverage`."""

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        if recording_mutation_coverage() or key not in self:
            self[key] = build()
        return self[key]


def fewrel_store_at(store_factory: Callable[..., Path], path: Path, segment_size: int = 64) -> Path:
    """Tiny Llama (float32) over the first 10 kept instances of each relation of the FewRel file
    ``path``, built on one torch thread (the tiny model's many small ops: much faster on a busy machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return store_factory("llama", dataset=f"fewrel:{path}", limit=10, segment_size=segment_size)
    finally:
        torch.set_num_threads(old)


def agreement_row(run_id: str = "agree-test", **extra: Any) -> dict[str, Any]:
    """One invented ``method_agreement`` row (trace vs patch over 3 facts), with ``extra`` columns."""
    return {
        "run_id": run_id,
        "method_a": "trace",
        "method_b": "patch",
        "n_facts": 3,
        "key_layer_agreement": 0.67,
        "key_layer_exact": 0.33,
        "n_verdict": 3,
        "verdict_agreement": 1.0,
        "profile_correlation": 0.5,
        **extra,
    }


def tiny_text_corpus(
    out: Path, seed: int = 1, docs: int = 10, words_per_doc: int = 8, model: str = "tiny-llama"
) -> Any:
    """A tiny model's corpus store (every position, ``resid`` only, float32) of ``docs`` random sentences,
    as ``actstore corpus-lens`` reads one; returns the open store."""
    import actstore

    text = out.parent / f"{out.name}.txt"
    rng = np.random.default_rng(seed)
    words = "the river runs past an old stone bridge in a quiet town at night".split()
    lines = (" ".join(rng.choice(words, words_per_doc)) for _ in range(docs))
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return actstore.ingest_corpus(
        out,
        model=model,
        dataset=f"text:{text}",
        positions="all",
        kinds=("resid",),
        storage_dtype="float32",
        batch_size=4,
        segment_size=16,
    )


# Tolerance policy for comparisons of values (docs/testing.md, "Tolerances"):
# - stored bytes that are only copied (a chunk read, a shuffle, a storage-dtype widening) compare exactly;
# - a value computed (a matmul, a sum, a conversion) and then rounded to a narrow dtype compares within
#   one unit in the last place (ulp) of that dtype at the value's magnitude: two float32 computations that
#   differ in their last bits (the CPU's vector kernels decide which: AVX-512, AVX2 or plain) may round
#   to neighbouring float16 or bfloat16 numbers;
# - a value computed in float32 and compared in float32 uses a relative tolerance stated at the test.
_MANTISSA = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126)}


def ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype``'s numbers at the magnitude of each ``x`` (subnormals included)."""
    bits, min_exp = _MANTISSA[dtype]
    mag = np.abs(np.asarray(x, dtype=np.float64))
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    exp = np.maximum(np.where(mag > 0, exp, min_exp), min_exp)
    return np.ldexp(1.0, (exp - bits).astype(np.int64))


def assert_within_ulps(actual: Any, desired: Any, dtype: str, ulps: int = 1) -> None:
    """``actual`` and ``desired`` (both computed, then rounded to ``dtype``) differ by at most ``ulps``
    units in the last place of ``dtype`` at the larger magnitude of the two, element by element."""
    a = np.asarray(actual.float() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64)
    d = np.asarray(desired.float() if isinstance(desired, torch.Tensor) else desired, dtype=np.float64)
    assert a.shape == d.shape, (a.shape, d.shape)
    tol = ulps * ulp(np.maximum(np.abs(a), np.abs(d)), dtype)
    bad = np.abs(a - d) > tol
    if bad.any():
        i = tuple(int(k) for k in np.argwhere(bad)[0])
        raise AssertionError(
            f"{int(bad.sum())} of {a.size} values differ by more than {ulps} ulp of {dtype}; first at {i}: "
            f"{a[i]!r} vs {d[i]!r} (ulp {tol[i] / ulps!r})"
        )


def import_vllm_files(
    tmp_path: Path, name: str, layer_ids: tuple[int, ...] = (2, 0)
) -> tuple[Any, np.ndarray]:
    """Three vLLM-layout files (tiny-llama, the given residual indices) written under ``tmp_path`` and
    imported into the store ``tmp_path / name`` in segments of 8 rows; the store and the hidden states
    given ([21, len(layer_ids), 64] float32)."""
    from safetensors.torch import save_file

    import actstore
    from actstore.jobs.import_acts import write_corpus

    rng = np.random.default_rng(5)
    folder = tmp_path / f"hs-{name}"
    folder.mkdir()
    given = []
    for k, n in enumerate([7, 9, 5]):
        hidden = rng.standard_normal((n, len(layer_ids), 64)).astype(np.float32)
        ids = torch.from_numpy(rng.integers(0, 200, n).astype(np.int64))
        save_file(
            {"hidden_states": torch.from_numpy(hidden), "token_ids": ids}, str(folder / f"r{k}.safetensors")
        )
        given.append(hidden)
    out = tmp_path / name
    write_corpus(
        out, folder, layer_ids=list(layer_ids), model="tiny-llama", storage_dtype="float16", segment_size=8,
        predict=False,
    )  # fmt: skip
    return actstore.open(out), np.concatenate(given)
