"""MAPS dynamic ranks in one process vs on a local Dask cluster, side by side in one run.

    python benchmarks/dask_maps_dynamic.py --store STORE --relations a,b,c --workers 2

Runs ``dynamic_ranks`` once in this process (one task, the single pass) and once on a
``LocalCluster`` of ``--workers`` single-threaded processes (one task per worker by default),
then checks that every rank array is identical and prints both wall times and their ratio.
The store is only read.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np
import torch

import actstore
from actstore.query.maps.dynamic import dynamic_ranks

RANKS = ("static_up", "static_down", "w_up", "w_down", "wo_up", "wo_down", "example_ids")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--relations", default=None, help="comma-separated relation ids (default: all)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts-per-task", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dask.distributed import Client, LocalCluster

    store = actstore.open(args.store)
    rels = [r for r in args.relations.split(",") if r] if args.relations else None
    t = time.perf_counter()
    here = dynamic_ranks(store, relations=rels)
    t_here = time.perf_counter() - t
    cluster = LocalCluster(
        n_workers=args.workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    with Client(cluster) as client:
        t = time.perf_counter()
        there = dynamic_ranks(
            store,
            relations=rels,
            client=client,
            prompts_per_task=args.prompts_per_task,
            log=lambda m: print(m, flush=True),
        )
        t_there = time.perf_counter() - t
    cluster.close()
    same = list(here) == list(there) and all(
        np.array_equal(getattr(here[r], k), getattr(there[r], k)) for r in here for k in RANKS
    )
    print(
        json.dumps(
            {
                "store": store.url,
                "prompts": int(sum(d.group.size for d in here.values())),
                "workers": args.workers,
                "in_process_s": round(t_here, 1),
                "cluster_s": round(t_there, 1),
                "speedup": round(t_here / t_there, 2),
                "ranks_identical": same,
            }
        )
    )


if __name__ == "__main__":
    main()
