"""Layer chunks (store format 2) against whole-layer chunks (format 1 layout), side by side.

The same prompts are ingested twice with SmolLM2-135M, ``chunk_layers`` 1 and 0, in alternating
rounds (ingest wall time, median), the two stores' ``z`` arrays are checked equal, and then, in
interleaved rounds on one torch thread:

* **write**: one segment's five arrays written by :func:`actstore.core.arrays.create_array` both ways
  (the host-side cost a GPU ingest pays);
* **read**: ``z`` of every row (the full scan) and of one relation's rows at three layers (the
  selective read), warm (page cache) and cold (the segment files evicted with
  ``posix_fadvise(DONTNEED)``), each timed call after an untimed one of the same case.

    python benchmarks/bench_layer_chunks.py [--prompts 128] [--rounds 3] [--json OUT]

Needs the FewRel file under $ACTSTORE_DATA (as bench_ingest.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_ms(xs: list[float]) -> float:
    return round(float(np.median(xs)) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="ingest rounds (reads and writes: 3x as many)")
    ap.add_argument("--layers", default="10,11,12")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    import torch
    import zarr

    import actstore
    from actstore.core.arrays import create_array
    from benchmarks.bench_ingest import load, time_ingest
    from benchmarks.bench_query import evict, files_under

    torch.set_num_threads(1)
    loaded, prompts = load(args.prompts)
    tmp = tempfile.mkdtemp(prefix="actstore-layer-chunks-")
    paths = {k: os.path.join(tmp, f"chunk_layers_{k}") for k in (0, 1)}
    ingest: dict[int, list[float]] = {0: [], 1: []}
    for r in range(args.rounds):
        for k in (0, 1) if r % 2 else (1, 0):
            ingest[k].append(time_ingest(loaded, prompts, 16, paths[k], "float16", chunk_layers=k))
    stores = {k: actstore.open(p) for k, p in paths.items()}
    segs = sorted(stores[0].commits)
    for seg in segs:
        a, b = (np.asarray(stores[k].array(seg, "z")[...]) for k in (0, 1))
        assert np.array_equal(a, b), f"segment {seg}: z differs between the two layouts"
    arrays = {
        name: np.asarray(stores[0].array(segs[0], name)[...]) for name in ("z", "attn", "v", "resid", "mlp")
    }
    write: dict[int, list[float]] = {0: [], 1: []}
    for r in range(3 * args.rounds):
        for k in (0, 1) if r % 2 else (1, 0):
            group = zarr.open_group(os.path.join(tmp, f"w{k}"), mode="w")
            t0 = time.perf_counter()
            for name, data in arrays.items():
                create_array(
                    group, name, data, 512 if name in ("attn", "v") else 32, logical_dtype="float16", chunk1=k
                )
            write[k].append(time.perf_counter() - t0)
    layers = [int(x) for x in args.layers.split(",")]
    rel = (
        stores[0]
        .sql(
            f"SELECT e.relation_id, count(*) AS n FROM targets t JOIN examples e USING (example_id) "
            f"WHERE t.segment = {segs[0]} GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 1"
        )
        .to_pylist()[0]
    )
    rows = (
        stores[0]
        .sql(
            f"SELECT t.seg_row FROM targets t JOIN examples e USING (example_id) WHERE e.relation_id = "
            f"'{rel['relation_id']}' AND t.segment = {segs[0]} ORDER BY 1"
        )
        .column(0)
        .to_numpy()
    )

    def full(s: Any) -> list[np.ndarray]:
        return [s.read_segment_rows(seg, "z", np.arange(s.commits[seg].n_rows)) for seg in segs]

    def selective(s: Any) -> np.ndarray:
        return s.read_segment_rows(segs[0], "z", rows, layers)

    assert np.array_equal(selective(stores[0]), selective(stores[1]))
    files = {k: files_under(os.path.join(p, "segments")) for k, p in paths.items()}
    reads: dict[str, list[float]] = {}
    for r in range(3 * args.rounds):
        for k in (0, 1) if r % 2 else (1, 0):
            for name, fn in (("full", full), ("selective", selective)):
                for state in ("warm", "cold"):
                    fn(stores[k])
                    if state == "cold":
                        evict(files[k])
                    t0 = time.perf_counter()
                    fn(stores[k])
                    reads.setdefault(f"{k}/{name}/{state}", []).append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "prompts": args.prompts,
        "rounds": args.rounds,
        "relation": rel,
        "rows_selected": int(rows.size),
        "layers": layers,
        "ingest_s": {k: round(float(np.median(v)), 3) for k, v in ingest.items()},
        "ingest_ratio_1_over_0": round(float(np.median(ingest[1]) / np.median(ingest[0])), 3),
        "write_segment_ms": {k: median_ms(v) for k, v in write.items()},
        "write_segment_MB": round(sum(a.nbytes for a in arrays.values()) / 1e6, 1),
        "read_ms": {k: median_ms(v) for k, v in reads.items()},
        "full_over_selective": {
            f"{k}/{s}": round(
                float(np.median(reads[f"{k}/full/{s}"]) / np.median(reads[f"{k}/selective/{s}"])), 1
            )
            for k in (0, 1)
            for s in ("warm", "cold")
        },
        "load_average": os.getloadavg(),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
