"""Restore interventions (method effectiveness, ``site_effects`` in restore mode): computed from the
corrupted run against full forward passes, side by side in one run.

* ``incremental``  ``EffectConfig()`` default: a restore of a site at layer l runs layers l..L-1 on the
                   positions from the subject's first token on, from the corrupted run's input of layer l
                   and its cached keys and values
* ``full``         ``EffectConfig(incremental=False)``: every (noise sample, site) a full forward pass of the
                   corrupted prompt with the clean output written back

Both run the same facts, noise samples and sites (``--draws`` random layers per component, the study's
default 4 plus the 6 or so located sites it adds, as ``--draws 7``).  Rounds are interleaved (the mode
order alternates each round, so a load change on this shared machine does not favour one mode), the best
round of each mode is kept, and every round's effects are checked against the first full round (max abs
difference of P(o) restored).  Facts: the first ``--facts`` facts of ``--store`` (answered or not), or of a
small known_1000 store the script ingests with ``--model``.

    python benchmarks/bench_restore.py [--store S] [--model smollm2-135m] [--facts 4] [--samples 10]
                                       [--draws 7] [--rounds 2] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tracing import make_store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, help="an existing store (default: ingest a small known_1000 store)")
    ap.add_argument("--model", default="smollm2-135m", help="model of the store the script ingests")
    ap.add_argument("--facts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=10, help="noise samples per restore (the study's 10)")
    ap.add_argument("--draws", type=int, default=7, help="random layers per fact and component")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (part of the measurement)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import numpy as np
    import torch

    import actstore
    from actstore.interventions.effectiveness import EffectConfig, noise_std_for, site_effects
    from actstore.interventions.facts import stored_facts
    from actstore.interventions.runner import InterventionRunner
    from actstore.jobs.model import load_store_model, model_for_store

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.store or make_store(args.model, Path(tmp), 2)
        store = actstore.open(path)
        facts = stored_facts(store, correct_only=False, limit=args.facts)
        loaded = load_store_model(store, model_for_store(store, None), quiet=True)
        runner = InterventionRunner(loaded.model)
        cfg = EffectConfig(mode="restore", samples=args.samples, random_draws=args.draws)
        std = noise_std_for(loaded.model, store, runner, cfg.noise_scale)
        modes = {"incremental": cfg, "full": replace(cfg, incremental=False)}
        load_before = os.getloadavg()
        best: dict[str, float] = {}
        results: list[tuple[str, np.ndarray]] = []
        n_rows = 0
        for r in range(args.rounds):
            for name in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                t0 = time.perf_counter()
                table = site_effects(runner, facts, {}, modes[name], std)
                dt = time.perf_counter() - t0
                best[name] = min(best.get(name, dt), dt)
                results.append(
                    (
                        name,
                        np.asarray(
                            table.column("p_intervened").to_pylist() + table.column("p_base").to_pylist()
                        ),
                    )
                )
                n_rows = table.num_rows
        ref = next(p for name, p in results if name == "full")
        diff = max(float(np.abs(p - ref).max()) for _, p in results)
        out: dict[str, Any] = {
            "model": store.manifest.model.get("name"),
            "facts": len(facts),
            "n_tokens": [f.n_tokens for f in facts],
            "samples": args.samples,
            "site_effects": n_rows,
            "threads": args.threads,
            "rounds": args.rounds,
            "seconds_best": best,
            "facts_per_min": {k: 60 * len(facts) / v for k, v in best.items()},
            "speedup": best["full"] / best["incremental"],
            "max_abs_diff": diff,
            "load_before": load_before,
            "load_after": os.getloadavg(),
        }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
