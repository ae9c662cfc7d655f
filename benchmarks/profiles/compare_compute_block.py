"""Before/after of the feature arithmetic alone: an older checkout's ``compute_block`` against this one's.

    python benchmarks/profiles/compare_compute_block.py STORE OLD_CHECKOUT [--rounds 7] [--threads 1]

Both compute every block of the whole store (``attn_head_token``: the largest relation) on the same
Store object (reads through this checkout's store), in shuffled interleaved rounds, assembled as a
selection does: old = the blocks concatenated (``np.concatenate``, what ``Selection.features``
did), new = each block written into its rows of one preallocated array (``compute_block(out=)``).
Reported: median CPU seconds (``time.process_time``: less sensitive than wall time to the other
jobs on a shared machine) and wall seconds per kind, and the largest relative difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KINDS = ("attn_head", "attn", "mlp", "mlp_group", "attn_entity", "resid", "z", "attn_head_token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("old")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import numpy as np
    import torch

    import actstore
    from actstore.query.select.features import FeatureSpec, compute_block, row_shape

    torch.set_num_threads(a.threads)
    spec_ = importlib.util.spec_from_file_location("old_features", Path(a.old) / "query" / "features.py")
    assert spec_ is not None and spec_.loader is not None
    old = importlib.util.module_from_spec(spec_)
    sys.modules["old_features"] = old  # dataclasses look their module up
    spec_.loader.exec_module(old)
    store = actstore.open(a.store)
    rel = store.sql("SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY n DESC, 1").column(
        0
    )[0]
    sel_all, sel_rel = store.select(), store.select("relation_id = $r", params={"r": rel.as_py()})

    def cases(kind: str) -> dict[str, Any]:
        sel = sel_rel if kind == "attn_head_token" else sel_all
        blocks = [b for _, b in sel.blocks()]
        spec = FeatureSpec.parse(store, kind, None, None)
        S = max(int(b.n_src.max()) for b in blocks)

        def run_old() -> np.ndarray:
            parts = [
                old.compute_block(store, old.FeatureSpec.parse(store, kind, None, None), b) for b in blocks
            ]
            if kind == "attn_head_token":
                parts = [np.pad(p, [(0, 0)] * 3 + [(0, S - p.shape[3]), (0, 0)]) for p in parts]
            return np.concatenate(parts)

        def run_new() -> np.ndarray:
            out = np.empty((len(sel), *row_shape(store, spec, S)), dtype=np.float32)
            at = 0
            for b in blocks:
                compute_block(store, spec, b, out=out[at : at + len(b.seg_rows)])
                at += len(b.seg_rows)
            return out

        return {"old": run_old, "new": run_new}

    result: dict[str, Any] = {"threads": a.threads, "rounds": a.rounds}
    for kind in KINDS:
        c = cases(kind)
        x, y = c["old"](), c["new"]()
        err = float(np.abs(x - y).max() / max(float(np.abs(x).max()), 1e-12))
        del x, y
        cpu: dict[str, list[float]] = {"old": [], "new": []}
        wall: dict[str, list[float]] = {"old": [], "new": []}
        rng = random.Random(0)
        for _ in range(a.rounds):
            order = ["old", "new"]
            rng.shuffle(order)
            for name in order:
                c0, w0 = time.process_time(), time.perf_counter()
                c[name]()
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
        med_c = {k: statistics.median(v) for k, v in cpu.items()}
        med_w = {k: statistics.median(v) for k, v in wall.items()}
        result[kind] = {
            "cpu_s": med_c,
            "wall_s": med_w,
            "old_over_new_cpu": med_c["old"] / med_c["new"],
            "max_rel_difference": err,
        }
        print(kind, json.dumps(result[kind]), flush=True)
    import os

    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
