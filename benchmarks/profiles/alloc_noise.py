"""Where the time of ``features("attn_head_token")`` goes, call by call: wall, user and system time and
the page faults of each call (``getrusage``), alternating warm calls and cold ones (the store's segment
files evicted from the page cache first, as bench_query.py does).

    python benchmarks/profiles/alloc_noise.py STORE [--threads 1] [--calls 4]

STORE: a store such as bench_query.py's (its largest relation is selected).  Used for the
benchmarks/README.md row on the 1-thread cold ``attn_head_token`` outlier.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import actstore
from benchmarks.bench_query import evict, files_under


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4, help="warm/cold pairs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = actstore.open(args.store)
    rel = store.sql(
        "SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY n DESC, 1"
    ).to_pylist()[0]
    sel = store.select("relation_id = $rel", params={"rel": rel["relation_id"]})
    files = [f for f in files_under(args.store) if "/segments/" in f]
    for _ in range(args.calls):
        for state in ("warm", "cold"):
            sel.features("attn_head_token")
            if state == "cold":
                evict(files)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            x = sel.features("attn_head_token")
            wall = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            del x
            print(
                f"{state}: {wall * 1e3:.0f} ms wall, user {(r1.ru_utime - r0.ru_utime) * 1e3:.0f} ms, "
                f"system {(r1.ru_stime - r0.ru_stime) * 1e3:.0f} ms, minor faults {r1.ru_minflt - r0.ru_minflt}, "
                f"major {r1.ru_majflt - r0.ru_majflt}"
            )


if __name__ == "__main__":
    main()
