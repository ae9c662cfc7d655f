"""The probing paper's main table over one store: accuracy (95% interval) per feature kind and
n-way setting, with wall times.  Each kind's features are loaded once and serve every setting.
Results are also written into the store (probe_runs etc.), so ``actstore sql`` sees them.

    python benchmarks/probe_table.py STORE [--kinds attn_head,attn,mlp,mlp_group,attn_entity,resid]
        [--ways 5,16] [--episodes 500] [--seeds 5] [--no-relspec attn_head] [--json OUT]
    # --episodes-16 N: episodes per seed for the (much costlier) 16-way setting

Prints one markdown row per (kind, n-way) as it finishes, then the whole table.  Every kind named
by ``--no-relspec`` (default ``attn_head``; ``''`` for none) gets a second row, "KIND, no RelSpec": the
same episodes with every feature, the same standardisation and training, so RelSpec's effect shows.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

import actstore
from actstore.jobs.probe import record_probe
from actstore.query.analyses.probe import ProbeConfig, run_probe
from actstore.query.analyses.probe_features import load_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--kinds", default="attn_head,attn,mlp,mlp_group,attn_entity,resid")
    ap.add_argument("--ways", default="5,16")
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--episodes-16", type=int, default=None, help="Episodes per seed for n-way >= 16.")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--feature-dtype", default="float16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--token-scores",
        default="none",
        choices=["none", "errors", "all"],
        help="TokenScores for attention kinds (the shortcut analysis needs errors).",
    )
    ap.add_argument(
        "--token-scores-ways",
        default=None,
        help="Comma list of n-way settings that get --token-scores (default: all); the others get none.",
    )
    ap.add_argument(
        "--no-relspec",
        default="attn_head",
        help="Comma list of kinds that also get a row without RelSpec (all features); '' for none.",
    )
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    store = actstore.open(a.store)
    rows: list[dict[str, object]] = []
    baseline = {k.strip() for k in a.no_relspec.split(",") if k.strip()}
    print("| features | n-way | episodes | accuracy % | 95% CI | features/episode | wall s (load + probe) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for kind in [k.strip() for k in a.kinds.split(",") if k.strip()]:
        t0 = time.perf_counter()
        fm = load_features(store, kind, dtype=a.feature_dtype)
        load_s = time.perf_counter() - t0
        for n_way in [int(w) for w in a.ways.split(",")]:
            episodes = a.episodes_16 if (n_way >= 16 and a.episodes_16) else a.episodes
            ts_ways = (
                None if a.token_scores_ways is None else {int(w) for w in a.token_scores_ways.split(",")}
            )
            token_scores = a.token_scores if ts_ways is None or n_way in ts_ways else "none"
            for relspec in (True, False) if kind in baseline else (True,):
                cfg = ProbeConfig(
                    kind=kind,
                    n_way=n_way,
                    k_shot=5,
                    queries=5,
                    episodes=episodes,
                    seeds=tuple(range(a.seeds)),
                    token_scores=token_scores if relspec else "none",
                    threads=a.threads,
                    feature_dtype=a.feature_dtype,
                    relspec=relspec,
                )
                t1 = time.perf_counter()
                out = run_probe(store, cfg, features=fm)
                probe_s = time.perf_counter() - t1
                record_probe(store, out)
                lo, hi = out.ci95
                name = kind if relspec else f"{kind}, no RelSpec"
                row = {
                    "kind": kind,
                    "relspec": relspec,
                    "n_way": n_way,
                    "episodes": len(out.episodes),
                    "accuracy": out.accuracy,
                    "ci95": [lo, hi],
                    "load_s": load_s,
                    "probe_s": probe_s,
                    "features": fm.n_features,
                    "mean_selected_features": float(out.n_selected.mean()),
                    "rows": len(fm.example_ids),
                    "run_id": out.run_id,
                }
                rows.append(row)
                print(
                    f"| {name} | {n_way} | {len(out.episodes)} | {100 * out.accuracy:.1f} | "
                    f"{100 * lo:.1f}-{100 * hi:.1f} | {out.n_selected.mean():.0f} | {load_s:.0f} + {probe_s:.0f} |",
                    flush=True,
                )
                if a.json_out:
                    with open(a.json_out, "w") as f:
                        json.dump(rows, f, indent=2)
        del fm
        gc.collect()


if __name__ == "__main__":
    main()
