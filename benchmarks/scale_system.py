"""The rest of the system on a large store (issue 33): ``load_features`` for 10,000 selected rows, a
full ``to_dask`` scan on a Dask ``LocalCluster`` (real worker processes), and a full sequential scan
through ``FeatureDataset``, each against the raw read of the same chunks (every chunk file of the kind
read and decoded by the store's own reader, no arithmetic), in one run.

    python benchmarks/scale_system.py STORE [--kind resid] [--rows 10000] [--workers 2] [--json OUT]
    python benchmarks/scale_system.py STORE --parts dataset --rounds 3   # FeatureDataset rows, batches, raw
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit  # noqa: E402


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--kind", default="resid")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk-rows", type=int, default=1 << 16, help="to_dask(chunk_rows=) of the coarse scan")
    ap.add_argument("--parts", default="dataset,dask,load", help="comma list of dataset, dask, load")
    ap.add_argument("--rounds", type=int, default=1, help="raw and dataset scans, interleaved rounds")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    import torch

    import actstore
    from actstore.query.analyses.probe_features import load_features

    torch.set_num_threads(1)
    s = actstore.open(a.store)
    n = s.sql("SELECT count(*) FROM examples").column(0)[0].as_py()
    out: dict[str, Any] = {"store": str(a.store), "rows": n, "segments": len(s.commits), "kind": a.kind}

    # raw: every segment's chunks of the kind, read and decoded (the floor of a full scan)
    sel_all = s.select()
    blocks = [b for _, b in sel_all.blocks()]
    raw_read = lambda: sum(  # noqa: E731
        float(s.read_segment_rows(b.segment, a.kind, b.seg_rows, [a.layer]).sum()) for b in blocks
    )
    rows_scan = lambda: sum(  # noqa: E731  (a row at a time, collated by the DataLoader)
        float(x.sum())
        for x, _ in torch.utils.data.DataLoader(
            actstore.FeatureDataset(sel_all, a.kind, layers=[a.layer]), batch_size=256
        )
    )
    batch_scan = lambda: sum(  # noqa: E731  (batches from the dataset itself)
        float(x.sum())
        for x, _ in torch.utils.data.DataLoader(
            actstore.FeatureDataset(sel_all, a.kind, layers=[a.layer], batch_size=256), batch_size=None
        )
    )
    times: dict[str, list[float]] = {"raw": [], "rows": [], "batches": []}
    sums: dict[str, float] = {}
    for _ in range(a.rounds):
        for name, fn in (("raw", raw_read), ("rows", rows_scan), ("batches", batch_scan)):
            if name != "raw" and "dataset" not in parts:
                continue
            t, sums[name] = _timed(fn)
            times[name].append(t)
    raw_s, raw_sum = float(np.median(times["raw"])), sums["raw"]
    out["raw_read_s"] = round(raw_s, 2)
    if "dataset" in parts:
        ds_s, bt_s = float(np.median(times["rows"])), float(np.median(times["batches"]))
        out["feature_dataset_s"] = round(ds_s, 2)
        out["feature_dataset_vs_raw"] = round(raw_s / ds_s, 2)
        out["feature_dataset_batches_s"] = round(bt_s, 2)
        out["feature_dataset_batches_vs_raw"] = round(raw_s / bt_s, 2)
        assert np.isclose(sums["rows"], raw_sum, rtol=1e-4), (sums["rows"], raw_sum)
        assert np.isclose(sums["batches"], raw_sum, rtol=1e-4), (sums["batches"], raw_sum)
    if "dask" not in parts and "load" not in parts:
        emit(out, a.json)
        return

    from dask.distributed import Client, LocalCluster

    if "dask" in parts:
        out["dask_workers"] = a.workers
        cluster = LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True)
        with cluster, Client(cluster):
            # (the first scan also starts the workers and reopens the store in each: run again, last kept)
            for tag, chunk_rows in (
                ("", None),
                ("_coarse", a.chunk_rows),
                ("", None),
                ("_coarse", a.chunk_rows),
            ):
                arr = sel_all.to_dask(a.kind, layers=[a.layer], chunk_rows=chunk_rows)
                dk_s, dk_sum = _timed(lambda arr=arr: float(arr.sum().compute()))
                out[f"dask{tag}_localcluster_s"] = round(dk_s, 2)
                out[f"dask{tag}_tasks"] = len(arr.chunks[0])
                out[f"dask{tag}_vs_raw"] = round(raw_s / dk_s, 2)
                assert np.isclose(dk_sum, raw_sum, rtol=1e-4), (dk_sum, raw_sum)
    if "load" not in parts:
        emit(out, a.json)
        return

    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(n, size=min(a.rows, n), replace=False))
    sel = s.select("example_id IN (SELECT unnest($ids::BIGINT[]))", params={"ids": ids.tolist()})
    lf_s, fm = _timed(lambda: load_features(s, a.kind, rows=sel, layers=[a.layer]))
    out["load_features_rows"] = len(ids)
    out["load_features_s"] = round(lf_s, 2)
    out["load_features_rows_per_s"] = round(len(ids) / lf_s)
    emit(out, a.json)


if __name__ == "__main__":
    main()
