"""Bytes on disk of ten small stores of one model: each with its own copy of the weights (``--weights
copy``, what every store carried before) against one shared copy (``--weights shared``, the default).

The model is loaded once; each store is ``--prompts`` demo prompts ingested through
``actstore.ingest.pipeline.ingest_prompts`` (the library's way in, as ``actstore ingest`` writes), into
a fresh folder, with a fresh weights cache per mode. Bytes are every regular file's ``os.stat`` size
(stores, plus the shared cache for ``shared``); the ingest time of each mode is measured side by side
in the same run (the stores alternate copy, shared)::

    python benchmarks/bench_weights.py --model tiny-llama --stores 10
    python benchmarks/bench_weights.py --model smollm2-135m --stores 10 --prompts 24
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402


def du(root: Path) -> int:
    total = 0
    for here, _, files in os.walk(root):
        for f in files:
            total += os.stat(os.path.join(here, f)).st_size
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--stores", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=12, help="demo prompts a store (2 per relation: 12)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="storage dtype")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the stores (printed folder)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.models.registry import load_model
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    t0 = time.perf_counter()
    loaded = load_model(a.model, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    per_relation = max(1, -(-a.prompts // 6))
    records = load_dataset("demo", limit_per_relation=per_relation).records[: a.prompts]
    prompts = tokenize_records(records, loaded.tokenizer)
    info = {
        "name": loaded.name,
        "source": loaded.source,
        "architecture": loaded.architecture,
        "weight_hash": loaded.weight_hash,
        "dtype": "float32",
    }
    root = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    seconds: dict[str, list[float]] = {"copy": [], "shared": []}
    for i in range(a.stores):
        for mode in ("copy", "shared"):  # alternated: the machine's load falls on both alike
            os.environ["ACTSTORE_WEIGHTS_DIR"] = str(root / f"cache-{mode}")
            cfg = IngestConfig(
                out=str(root / mode / f"s{i}"),
                batch_size=4,
                segment_size=len(prompts) + (-len(prompts)) % 4,
                storage_dtype=a.dtype,
                progress=False,
                weights=mode,
            )
            t = time.perf_counter()
            ingest_prompts(loaded.model, loaded.tokenizer, info, prompts, cfg)
            seconds[mode].append(time.perf_counter() - t)
    copy_bytes = du(root / "copy") + du(root / "cache-copy")
    shared_stores, shared_cache = du(root / "shared"), du(root / "cache-shared")
    shared_bytes = shared_stores + shared_cache
    one_store_weights = du(root / "copy" / "s0" / "weights")
    result = {
        "model": a.model,
        "model_load_s": round(load_s, 1),
        "stores": a.stores,
        "prompts_a_store": len(prompts),
        "storage_dtype": a.dtype,
        "copy_bytes": copy_bytes,
        "shared_bytes": shared_bytes,
        "shared_stores_bytes": shared_stores,
        "shared_cache_bytes": shared_cache,
        "cache_folders": len([p for p in (root / "cache-shared").iterdir() if p.is_dir()]),
        "weights_bytes_a_copy": one_store_weights,
        "copy_over_shared": round(copy_bytes / shared_bytes, 2),
        "ingest_s_median": {m: round(statistics.median(v), 3) for m, v in seconds.items()},
        "folder": str(root) if a.keep else None,
    }
    emit(result, a.json)
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
