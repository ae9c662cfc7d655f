"""Causal-tracing throughput: the batched intervention runner against one restoration per forward pass.

One run traces the same facts (same noise samples, same restorations) three ways and reports facts
per minute for each, side by side:

* ``vectorised``  :class:`ingest.tracing.GroupedEditRunner`, ``--batch-size`` corrupted copies per
                  forward pass, the edits of a hook point applied as one indexed write
* ``batched``     the shared :class:`ingest.interventions.InterventionRunner` (what the MAPS ablation
                  uses), same batches, edits applied row by row
* ``loop``        the shared runner with ``batch_size=1``: one restoration per forward pass, the way a
                  hook-per-experiment script runs causal tracing

and checks that the three give the same restored probabilities (max abs difference).  The batched
modes are timed before and after the loop and the faster of the two runs is kept, so a load change
on this shared machine during the (long) loop does not favour either side.  Facts come from a small
store of LRE factual prompts that the model answers correctly (ingested into a temporary folder, or
``--store``).

    python benchmarks/bench_tracing.py [--quick] [--model smollm2-135m] [--threads 1] [--json OUT]

``--quick``: 2 facts, 1 noise sample (the loop runs 1 fact).  Default: 3 facts, 2 noise samples
(the loop runs 1 fact).  Window 10, the three components (residual, MLP, attention) and every
position from the subject's first token on, as ``actstore trace`` runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LRE = REPO.parent / "shared" / "data" / "lre_relations" / "data" / "factual"
RELATIONS = "country_capital_city,country_language,landmark_on_continent"


def make_store(model: str, folder: Path) -> Path:
    out = folder / "store"
    cmd = [sys.executable, "-m", "actstore.cli", "ingest", "--model", model, "--dataset", f"lre:{LRE}",
           "--relations", RELATIONS, "--limit-per-relation", "12", "--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True, cwd=REPO)
    return out


def timed(tracer: Any, facts: list[Any]) -> tuple[list[Any], float]:
    t0 = time.perf_counter()
    out = tracer.trace(facts)
    return out, time.perf_counter() - t0


def max_diff(a: list[Any], b: list[Any]) -> float:
    import numpy as np

    return float(max(np.abs(x.restored[c] - y.restored[c]).max() for x, y in zip(a, b) for c in y.restored))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--store", default=None, help="Existing store of the model (default: ingest a small one).")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (part of the measurement).")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import actstore
    from ingest.interventions import InterventionRunner
    from ingest.models import load_model
    from ingest.tracing import (
        CausalTracer,
        GroupedEditRunner,
        TraceConfig,
        stored_facts,
        subject_embedding_std,
    )

    n_facts, n_loop, samples = (2, 1, 1) if args.quick else (3, 1, 2)
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        path = Path(args.store) if args.store else make_store(args.model, Path(tmp))
        store = actstore.open(str(path))
        where = "example_id IN (SELECT min(example_id) FROM examples JOIN targets USING (example_id) " \
                "WHERE object_rank = 0 GROUP BY relation_id, subject_end - subject_start)"
        facts = stored_facts(store, where, limit=n_facts)
        if len(facts) < n_facts:
            facts = stored_facts(store, limit=n_facts)
        loaded = load_model(args.model)
        std = 3 * subject_embedding_std(loaded.model, store)
        cfg = TraceConfig(samples=samples, window=10, batch_size=args.batch_size)
        vec = CausalTracer(GroupedEditRunner(loaded.model), cfg, std)
        bat = CausalTracer(InterventionRunner(loaded.model), cfg, std)
        loop = CausalTracer(InterventionRunner(loaded.model), replace(cfg, batch_size=1), std)
        rows = [vec.rows_per_fact(f) for f in facts]
        vec.trace(facts[:1])  # warm-up (allocator, kernels)
        v1, tv1 = timed(vec, facts)
        b1, tb1 = timed(bat, facts)
        lo, tl = timed(loop, facts[:n_loop])
        v2, tv2 = timed(vec, facts)
        b2, tb2 = timed(bat, facts)
        tv, tb = min(tv1, tv2), min(tb1, tb2)

    def rate(n: int, s: float) -> float:
        return 60 * n / s

    res: dict[str, Any] = {
        "model": args.model, "threads": args.threads, "samples": samples, "window": 10, "batch_size": args.batch_size,
        "facts": len(facts), "tokens_per_fact": [f.n_tokens for f in facts], "forward_rows_per_fact": rows,
        "vectorised": {"facts": len(facts), "seconds": [tv1, tv2], "facts_per_minute": rate(len(facts), tv)},
        "batched": {"facts": len(facts), "seconds": [tb1, tb2], "facts_per_minute": rate(len(facts), tb)},
        "loop": {"facts": n_loop, "seconds": tl, "facts_per_minute": rate(n_loop, tl)},
        "max_abs_diff_vectorised_vs_loop": max_diff(v1[:n_loop], lo),
        "max_abs_diff_batched_vs_loop": max_diff(b1[:n_loop], lo),
        "max_abs_diff_repeat": max_diff(v1, v2),
        "load_average": list(os.getloadavg()),
    }
    loop_rate = res["loop"]["facts_per_minute"]
    res["speedup_vectorised_vs_loop"] = res["vectorised"]["facts_per_minute"] / loop_rate
    res["speedup_batched_vs_loop"] = res["batched"]["facts_per_minute"] / loop_rate
    print(f"{args.model}, {len(facts)} facts ({sum(rows) / len(rows):.0f} forward rows each: {samples} noise "
          f"sample(s) x (1 + 3 components x layers x positions)), {args.threads} thread(s), batch {args.batch_size}")
    for k in ("vectorised", "batched", "loop"):
        print(f"  {k:<11} {res[k]['facts_per_minute']:8.2f} facts/min  ({res[k]['facts']} facts)")
    print(f"  speedup vs loop: vectorised {res['speedup_vectorised_vs_loop']:.1f}x, "
          f"batched {res['speedup_batched_vs_loop']:.1f}x; max |diff| vs loop "
          f"{res['max_abs_diff_vectorised_vs_loop']:.2e} / {res['max_abs_diff_batched_vs_loop']:.2e}; "
          f"load {res['load_average'][0]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
