"""Benchmark: MAPS static scores of every head on every MAPS relation, from a store's weights.

    python benchmarks/maps_static.py STORE [--pairs ../shared/data/maps/datasets] [--salient]

Prints one JSON object: pairs and heads scored, seconds for the static scores (and for the
salient operations of every head with --salient), and the process's peak resident memory
next to the size a single |V| x |V| float32 matrix would take.  The store only needs its
weights (any ingest of the model will do, e.g. of the demo corpus).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

import actstore
from actstore.api import tokenizer_for_store
from actstore.query.maps.pairs import load_pair_files, tokenize_pairs
from actstore.query.maps.projection import VocabProjection
from actstore.query.maps.static import salient_operations, static_scores

REPO = Path(__file__).resolve().parents[1]


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument(
        "--pairs",
        default=str(
            Path(os.environ.get("ACTSTORE_DATA") or REPO.parent / "shared" / "data") / "maps" / "datasets"
        ),
    )
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--salient", action="store_true", help="also time salient operations of every head")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s = actstore.open(args.store)
    g = s.geometry
    tok = tokenizer_for_store(s)
    rels = load_pair_files([args.pairs])
    pairs = [tokenize_pairs(r, tok, vocab_size=g.vocab_size) for r in rels]
    t0 = time.perf_counter()
    proj = VocabProjection(s)
    t_load = time.perf_counter() - t0
    rss_before = peak_rss_bytes()
    t0 = time.perf_counter()
    scores = static_scores(proj, pairs, k_max=args.k)
    t_static = time.perf_counter() - t0
    rss_static = peak_rss_bytes()
    out = {
        "store": s.url,
        "model": s.manifest.model.get("name"),
        "layers": g.n_layers,
        "heads": g.n_heads,
        "kv_heads": g.n_kv_heads,
        "vocab": proj.vocab_size,
        "relations": len(pairs),
        "pairs": int(sum(p.n_used for p in pairs)),
        "distinct_sources": int(len({int(x) for p in pairs for x in p.src})),
        "torch_threads": torch.get_num_threads(),
        "weights_seconds": round(t_load, 2),
        "static_seconds": round(t_static, 2),
        "heads_implementing_total": int(sum((sc.score(args.k) >= 0.15).sum() for sc in scores.values())),
        "peak_rss_mb_before": round(rss_before / 2**20, 1),
        "peak_rss_mb_after_static": round(rss_static / 2**20, 1),
        "one_VxV_float32_mb": round(proj.vocab_size**2 * 4 / 2**20, 1),
    }
    if args.salient:
        t0 = time.perf_counter()
        salient_operations(proj, None, vocab_limit=len(tok))
        out["salient_seconds_all_heads"] = round(time.perf_counter() - t0, 2)
        out["peak_rss_mb_after_salient"] = round(peak_rss_bytes() / 2**20, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
