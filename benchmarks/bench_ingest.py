"""Ingest benchmark: capture + compression + writes against a plain forward pass, side by side.

One run measures, on the same batches of FewRel prompts and the same loaded model:

* ``plain``    the model's own forward (``model(input_ids, attention_mask)``, logits for every position)
* ``backbone`` the decoder stack alone (no LM head): the strictest floor
* ``ingest``   ``ingest_prompts`` end to end: fused capture, device-to-host copy, compression and
               Zarr/Parquet writes on the writer thread, commits

Rounds alternate the three in a shuffled order and the ratios are medians over rounds, so
load from other processes on this shared machine hits all three alike.  Peak memory is
measured in fresh subprocesses for a corpus and a corpus 4x (``--quick``) or 10x larger.

    python benchmarks/bench_ingest.py [--quick] [--json OUT]
    python benchmarks/bench_ingest.py --memory-only --memory-prompts 64,640 [--segment-size 32]
    python benchmarks/bench_ingest.py --length-batching --prompts 256 [--rounds 3]

``--length-batching``: ingest (``ingest_prompts`` end to end) with batches in corpus order against
batches sorted by prompt length within each segment (``IngestConfig(length_batching=True)``),
shuffled interleaved rounds, with the padded token counts and a check that both stores hold the
same rows (tables identical, values within float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import DATA, emit  # noqa: E402

FEWREL = DATA / "fewrel" / "val_wiki.json"


def load(n_prompts: int) -> tuple[Any, list[Any]]:
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.models.registry import load_model

    loaded = load_model("smollm2-135m")
    per_rel = max(1, n_prompts // 16 + 1)
    records = load_dataset(f"fewrel:{FEWREL}", limit_per_relation=per_rel).records[:n_prompts]
    return loaded, tokenize_records(records, loaded.tokenizer)


def time_plain(loaded: Any, prompts: list[Any], batch: int, backbone_only: bool) -> float:
    import torch

    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.capture.batches import pad_batch

    arch = architecture_for(loaded.model)
    fn = arch.backbone(loaded.model) if backbone_only else loaded.model
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            b = pad_batch(prompts[i : i + batch], loaded.tokenizer.pad_token_id, "right", torch.device("cpu"))
            fn(
                input_ids=b.input_ids,
                attention_mask=b.attention_mask,
                position_ids=b.position_ids,
                use_cache=False,
            )
    return time.perf_counter() - t0


def time_ingest(
    loaded: Any,
    prompts: list[Any],
    batch: int,
    out: str,
    dtype: str,
    segment_size: int = 256,
    length_batching: bool = False,
    chunk_layers: int = 1,
) -> float:
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    shutil.rmtree(out, ignore_errors=True)
    cfg = IngestConfig(
        out=out,
        batch_size=batch,
        storage_dtype=dtype,
        progress=False,
        segment_size=segment_size,
        length_batching=length_batching,
        chunk_layers=chunk_layers,
    )
    t0 = time.perf_counter()
    ingest_prompts(
        loaded.model, loaded.tokenizer, {"name": loaded.name, "weight_hash": loaded.weight_hash}, prompts, cfg
    )
    return time.perf_counter() - t0


def padded_tokens(prompts: list[Any], batch: int, segment_size: int, by_length: bool) -> int:
    """Tokens the forward passes run, padding included (each batch padded to its longest prompt)."""
    from actstore.ingest.pipeline import forward_order

    total = 0
    for lo in range(0, len(prompts), segment_size):
        seg = prompts[lo : lo + segment_size]
        order = forward_order(seg, by_length)
        for b in range(0, len(seg), batch):
            members = order[b : b + batch]
            total += len(members) * max(seg[i].target_position + 1 for i in members)
    return total


def compare_length_batching(
    loaded: Any, prompts: list[Any], batch: int, dtype: str, rounds: int, segment_size: int
) -> dict[str, Any]:
    """Ingest in corpus-order batches against length batching, shuffled interleaved rounds; the two
    stores' arrays checked equal (within float32 rounding) and their tables identical."""
    import numpy as np

    import actstore

    tmp = tempfile.mkdtemp(prefix="actstore-lenbatch-")
    outs = {False: os.path.join(tmp, "corpus"), True: os.path.join(tmp, "sorted")}
    times: dict[bool, list[float]] = {False: [], True: []}
    rng = random.Random(0)
    for _ in range(rounds):
        order = [False, True]
        rng.shuffle(order)
        for by_len in order:
            times[by_len].append(
                time_ingest(loaded, prompts, batch, outs[by_len], dtype, segment_size, by_len)
            )
    a, b = actstore.open(outs[False]), actstore.open(outs[True])
    worst = 0.0
    for seg in a.commits:
        for name in ("z", "resid", "mlp"):
            x = a.read_segment_rows(seg, name, np.arange(a.commits[seg].n_rows))
            y = b.read_segment_rows(seg, name, np.arange(b.commits[seg].n_rows))
            worst = max(worst, float(np.abs(x - y).max() / np.abs(x).max()))
    for name in ("examples", "tokens"):
        if not a.table(name).equals(b.table(name)):
            raise AssertionError(f"length batching changed the {name} table")
    if worst > 1e-2:
        raise AssertionError(f"length batching changed the stored values (max rel. difference {worst:.2e})")
    shutil.rmtree(tmp, ignore_errors=True)
    real = sum(p.target_position + 1 for p in prompts)
    med = {("length_batching" if k else "corpus_order"): statistics.median(v) for k, v in times.items()}
    return {
        "prompts": len(prompts),
        "batch": batch,
        "segment_size": segment_size,
        "rounds": rounds,
        "seconds_median": med,
        "corpus_over_length_batching": med["corpus_order"] / med["length_batching"],
        "tokens": real,
        "padded_tokens": {
            "corpus_order": padded_tokens(prompts, batch, segment_size, False),
            "length_batching": padded_tokens(prompts, batch, segment_size, True),
        },
        "max_rel_difference_stored": worst,
        "load_average": os.getloadavg(),
    }


def du(path: str, sub: str = "") -> int:
    total = 0
    for root, _, files in os.walk(os.path.join(path, sub)):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def peak_rss_mb(n_prompts: int, batch: int, segment_size: int = 256) -> float:
    """Peak RSS of a fresh process that loads the model and ingests ``n_prompts``."""
    code = (
        f"import resource, shutil, sys, tempfile; sys.path.insert(0, {str(REPO)!r})\n"
        "from benchmarks.bench_ingest import load, time_ingest\n"
        f"l, p = load({n_prompts})\n"
        "d = tempfile.mkdtemp()\n"
        f"time_ingest(l, p, {batch}, d + '/s', 'float16', {segment_size})\n"
        "shutil.rmtree(d)\n"
        "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True
    ).stdout
    peak_kib = int(next(line for line in out.splitlines() if line.startswith("PEAK")).split()[1])
    return peak_kib / 1024  # ru_maxrss is in KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 prompts, 3 rounds, memory at 64 vs 256 prompts")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="only the peak-memory measurement")
    ap.add_argument(
        "--memory-prompts",
        default=None,
        help="corpus sizes for peak memory, e.g. 64,640 (default: 16,64 with --quick, N,10N)",
    )
    ap.add_argument("--segment-size", type=int, default=256, help="segment size of the peak-memory ingests")
    ap.add_argument(
        "--length-batching",
        action="store_true",
        help="only: ingest with batches in corpus order vs sorted by length within each segment",
    )
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    n = args.prompts or (64 if args.quick else 256)
    rounds = args.rounds or (3 if args.quick else 5)

    import torch

    if args.memory_only:
        sizes = [int(x) for x in args.memory_prompts.split(",")] if args.memory_prompts else [n, 10 * n]
        mem = {
            "segment_size": args.segment_size,
            "batch": args.batch,
            "threads": torch.get_num_threads(),
            "peak_rss_mb": {str(k): peak_rss_mb(k, args.batch, args.segment_size) for k in sizes},
        }
        print(json.dumps(mem, indent=2))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(mem, indent=2))
        return
    loaded, prompts = load(n)
    if args.length_batching:
        emit(
            compare_length_batching(loaded, prompts, args.batch, args.dtype, rounds, args.segment_size),
            args.json_out,
        )
        return
    tmp = tempfile.mkdtemp(prefix="actstore-bench-")
    out = os.path.join(tmp, "store")
    time_plain(loaded, prompts[: args.batch], args.batch, False)  # warm-up
    times: dict[str, list[float]] = {"plain": [], "backbone": [], "ingest": []}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(times)
        rng.shuffle(order)
        for name in order:
            if name == "ingest":
                times[name].append(time_ingest(loaded, prompts, args.batch, out, args.dtype))
            else:
                times[name].append(time_plain(loaded, prompts, args.batch, name == "backbone"))
    ratio_plain = statistics.median(i / p for i, p in zip(times["ingest"], times["plain"]))
    ratio_backbone = statistics.median(i / p for i, p in zip(times["ingest"], times["backbone"]))

    import actstore

    s = actstore.open(out)
    g = s.geometry
    n_tok = int(s.sql("SELECT sum(n_tokens) AS t FROM examples").to_pylist()[0]["t"])
    data_bytes = du(out, "segments") + du(out, "tables")
    # A materialised per-(head, source token) array: L * H * tokens * d_model float16 numbers per target.
    materialised = g.n_layers * g.n_heads * n_tok * g.d_model * 2
    result: dict[str, Any] = {
        "model": "smollm2-135m",
        "prompts": n,
        "batch": args.batch,
        "rounds": rounds,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "mean_tokens": n_tok / n,
        "seconds_median": {k: statistics.median(v) for k, v in times.items()},
        "ingest_over_plain": ratio_plain,
        "ingest_over_backbone": ratio_backbone,
        "store_bytes_per_target": data_bytes / n,
        "weights_bytes": du(out, "weights"),
        "materialised_bytes_per_target": materialised / n,
        "size_ratio_materialised_over_store": materialised / data_bytes,
    }
    if not args.no_memory:
        small = max(16, n // 4) if args.quick else n
        sizes = (
            [int(x) for x in args.memory_prompts.split(",")]
            if args.memory_prompts
            else [small, small * (4 if args.quick else 10)]
        )
        result["peak_rss_mb"] = {str(k): peak_rss_mb(k, args.batch, args.segment_size) for k in sizes}
        result["peak_rss_segment_size"] = args.segment_size
    shutil.rmtree(tmp, ignore_errors=True)
    emit(result, args.json_out)


if __name__ == "__main__":
    main()
