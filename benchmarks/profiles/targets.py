"""What the profiles in this folder record (run under py-spy, see README.md here).

    python benchmarks/profiles/targets.py first-query STORE [N]        # N x (actstore.open + first query)
    python benchmarks/profiles/targets.py features STORE KIND [THREADS] [N]
    python benchmarks/profiles/targets.py load-features STORE KIND [N]

``features`` of ``attn_head_token`` select the store's largest relation (as bench_query.py does).
The checkout this file lies in is imported first, so the same file profiles an older checkout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    what, path = sys.argv[1], sys.argv[2]
    import torch

    import actstore

    if what == "first-query":
        n = int(sys.argv[3]) if len(sys.argv) > 3 else 30
        actstore.open(path).sql("SELECT count(*) FROM examples")  # imports outside the loop
        t = time.perf_counter()
        for _ in range(n):
            actstore.open(path).sql("SELECT count(*) FROM examples")
        print(f"first-query: {(time.perf_counter() - t) / n * 1000:.1f} ms per open + query")
        return
    kind = sys.argv[3]
    store = actstore.open(path)
    if what == "features":
        torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
        n = int(sys.argv[5]) if len(sys.argv) > 5 else 3
        if kind == "attn_head_token":
            rel = (
                store.sql("SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY n DESC, 1")
                .column(0)[0]
                .as_py()
            )
            sel = store.select("relation_id = $r", params={"r": rel})
        else:
            sel = store.select()
        sel.features(kind)
        for _ in range(n):
            t = time.perf_counter()
            sel.features(kind)
            print(f"{kind}: {time.perf_counter() - t:.3f} s")
        return
    from actstore.query.analyses.probe_features import load_features

    torch.set_num_threads(1)
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    for _ in range(n):
        t = time.perf_counter()
        load_features(store, kind)
        print(f"load_features {kind}: {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
