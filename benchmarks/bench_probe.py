"""Probe benchmark: the batched episode trainer against the one-episode-at-a-time reference.

One run, on one store and one feature matrix (loaded once, outside every timing):

* ``batched``    :func:`actstore.query.analyses.probe.run_probe` over all ``seeds x episodes`` episodes
                 (RelSpec selection, standardisation, training, evaluation, HeadScores);
* ``subset``     the same, on the first ``--reference-episodes`` of those episodes;
* ``reference``  :func:`actstore.query.analyses.probe.run_reference` (``nn.Linear`` + ``torch.optim.Adam``, one
                 episode at a time, same selection) on that subset.

The ratio is reference / subset on the same episodes, measured back to back; the predictions
of the two must be identical, and the script says so.  Threads: 1 (``--threads`` to change).

    python benchmarks/bench_probe.py STORE [--kind attn_head] [--episodes 500] [--seeds 5]
    python benchmarks/bench_probe.py STORE --quick        # 1 seed x 50 episodes, reference on 10
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch

import actstore
from actstore.query.analyses.episodes import EpisodeSet, sample_seeds
from actstore.query.analyses.probe import ProbeConfig, run_probe, run_reference
from actstore.query.analyses.probe_features import load_features
from actstore.query.select.selection import Selection


def subset(ep: EpisodeSet, n: int) -> EpisodeSet:
    """The first ``n`` episodes of ``ep``."""
    return EpisodeSet(
        ep.relations,
        ep.n_way,
        ep.k_shot,
        ep.queries,
        ep.seed[:n],
        ep.index[:n],
        ep.classes[:n],
        ep.support[:n],
        ep.query[:n],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--kind", default="attn_head")
    ap.add_argument("--where", default=None)
    ap.add_argument("--n-way", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--reference-episodes", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--feature-dtype", default="float16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.episodes, a.seeds, a.reference_episodes = 50, 1, 10
    torch.set_num_threads(a.threads)
    store = actstore.open(a.store)
    t0 = time.perf_counter()
    fm = load_features(store, a.kind, rows=Selection.from_sql(store, a.where), dtype=a.feature_dtype)
    load_s = time.perf_counter() - t0
    cfg = ProbeConfig(
        kind=a.kind,
        n_way=a.n_way,
        k_shot=5,
        queries=5,
        episodes=a.episodes,
        seeds=tuple(range(a.seeds)),
        token_scores="none",
        threads=a.threads,
        feature_dtype=a.feature_dtype,
    )
    ep = sample_seeds(
        fm.labels, n_way=a.n_way, k_shot=5, queries=5, episodes=a.episodes, seeds=list(range(a.seeds))
    )
    sub = subset(ep, min(a.reference_episodes, len(ep)))
    print(
        f"{store.url}: {len(fm.example_ids)} rows, {fm.n_features} {a.kind} features "
        f"(loaded in {load_s:.1f}s); {len(ep)} episodes {a.n_way}-way 5-shot, reference on {len(sub)}",
        flush=True,
    )

    t0, c0 = time.perf_counter(), time.process_time()
    full = run_probe(store, cfg, features=fm, episodes=ep)
    full_s, full_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"batched   {len(ep):>5} episodes: {full_s:8.1f} s wall, {full_cpu:8.1f} s CPU "
        f"({full_s / len(ep):.3f} s/episode); accuracy {full.accuracy:.4f} "
        f"(95% CI {full.ci95[0]:.4f}-{full.ci95[1]:.4f})",
        flush=True,
    )

    t0 = time.perf_counter()
    part = run_probe(store, replace(cfg, episodes=len(sub)), features=fm, episodes=sub)
    part_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    acc, pred, _ = run_reference(fm, sub, cfg)
    ref_s = time.perf_counter() - t0
    same = bool(np.array_equal(part.pred, pred))
    agree = float((part.pred == pred).mean())
    ratio = ref_s / part_s
    print(f"subset    {len(sub):>5} episodes: {part_s:8.1f} s wall ({part_s / len(sub):.3f} s/episode)")
    print(f"reference {len(sub):>5} episodes: {ref_s:8.1f} s wall ({ref_s / len(sub):.3f} s/episode)")
    print(
        f"reference / batched on the same episodes: {ratio:.2f}x; predictions identical: {same} "
        f"({100 * agree:.2f}% of {pred.size} agree); accuracy {part.accuracy:.4f} vs {float(np.mean(acc)):.4f}"
    )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(
                {
                    "store": store.url,
                    "kind": a.kind,
                    "rows": len(fm.example_ids),
                    "features": fm.n_features,
                    "episodes": len(ep),
                    "batched_s": full_s,
                    "batched_cpu_s": full_cpu,
                    "accuracy": full.accuracy,
                    "ci95": list(full.ci95),
                    "subset_episodes": len(sub),
                    "subset_s": part_s,
                    "reference_s": ref_s,
                    "ratio": ratio,
                    "identical": same,
                    "agreement": agree,
                    "threads": a.threads,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
