"""Per-fact lens key layers of a fact store read through the logit lens and through a tuned lens trained
on a text corpus (``actstore corpus-lens``), each with the three key definitions of issue 36:

- ``plateau``: the comparison's key (the middle of the run of layers within ``--plateau`` of the peak
  of the per-layer jump in P(object); ``actstore.query.methods.readings.key_layers``);
- ``top10``: the first block after which the object is among the ten most probable tokens;
- ``half``: the first block after which P(object) reaches half its value at the output.

For each lens and key: how many facts have a key, how many distinct keys, the median and the share of
the most common key (a key that never moves says nothing per fact), then the agreement of the two
lenses' keys per definition against the within-relation permutation null
(``actstore.query.methods.chance.pair_chance``: observed share within the tolerance, chance, excess,
kappa).  Reads the store only; no model::

    python benchmarks/lens_keys.py FACTS_STORE --tuned corpus:CORPUS_STORE --json OUT.json

Facts: those the model answers correctly (``object_rank = 0``), as ``actstore agree`` reads them
without trace or patch runs; ``--all-facts`` takes every fact with an object token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def describe(keys: Any) -> dict[str, Any]:
    import numpy as np

    k = np.asarray(keys)
    k = k[k >= 0]
    if k.size == 0:
        return {"facts_with_key": 0}
    mode, count = Counter(k.tolist()).most_common(1)[0]
    return {
        "facts_with_key": int(k.size),
        "distinct": int(np.unique(k).size),
        "median": float(np.median(k)),
        "mode": int(mode),
        "mode_share": round(count / k.size, 4),
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    from actstore.api import open_store
    from actstore.query.analyses.corpus_lens import load_corpus_lens
    from actstore.query.methods.agreement import default_tolerance
    from actstore.query.methods.chance import pair_chance
    from actstore.query.methods.keys import lens_variant_readings
    from actstore.query.methods.readings import PLATEAU, fact_ids, lens_reading, stored_outputs
    from actstore.query.methods.study import store_strata

    t0 = time.time()
    store = open_store(a.store)
    ids = fact_ids(store, None, correct_only=not a.all_facts)
    if a.limit:
        ids = ids[: a.limit]
    out = stored_outputs(store, ids)
    logit = lens_reading(store, out, plateau=PLATEAU)
    lens = load_corpus_lens(a.tuned, store)  # read once: the reading and the variants use it
    tuned = lens_reading(store, out, lens, PLATEAU)
    tuned.info = {"source": lens.info["source"], "run_id": lens.info["run_id"]}
    readings = {"logit_lens": logit, "tuned_lens": tuned}
    readings.update(lens_variant_readings(store, out, logit))
    readings.update(lens_variant_readings(store, out, tuned, tuned=lens))
    L = store.geometry.n_layers
    tol = default_tolerance(L)
    relation = store_strata(store, ids).get("relation")
    result: dict[str, Any] = {
        "store": store.url,
        "model": store.manifest.model.get("name"),
        "n_layers": L,
        "tolerance": tol,
        "facts": int(ids.size),
        "tuned": tuned.info,
        "keys": {m: describe(r.key_layer) for m, r in readings.items()},
        "agreement": {},
    }
    for name, (x, y) in {
        "plateau": ("logit_lens", "tuned_lens"),
        "top10": ("logit_lens@top10", "tuned_lens@top10"),
        "half": ("logit_lens@half", "tuned_lens@half"),
    }.items():
        ch = pair_chance(readings[x], readings[y], tol, relation, a.permutations, a.resamples)
        result["agreement"][name] = {m: ch[m].__dict__ for m in ("key_layer", "key_layer_exact")}
    result["seconds"] = round(time.time() - t0, 1)
    return result


def table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['model']} (L={r['n_layers']}), {r['facts']} facts; tuned lens: {r['tuned']['run_id']} "
        f"on {r['tuned']['source']}",
        "",
        "| reading | facts with a key | distinct keys | median | most common key (share) |",
        "|---|---|---|---|---|",
    ]
    for m, d in r["keys"].items():
        if d.get("facts_with_key"):
            lines.append(
                f"| {m} | {d['facts_with_key']} | {d['distinct']} | {d['median']:.0f} | "
                f"{d['mode']} ({100 * d['mode_share']:.1f}%) |"
            )
    lines += [
        "",
        f"| key | logit vs tuned: within {r['tolerance']} | chance | excess | kappa | exact | chance |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, g in r["agreement"].items():
        k, e = g["key_layer"], g["key_layer_exact"]
        lines.append(
            f"| {name} | {100 * k['value']:.1f}% (n={k['n']}) | {100 * k['chance']:.1f}% | "
            f"{100 * k['excess']:+.1f} [{100 * k['excess_low']:+.1f}, {100 * k['excess_high']:+.1f}] | "
            f"{k['kappa']:.2f} | {100 * e['value']:.1f}% | {100 * e['chance']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--tuned", required=True, help="corpus:STORE[#RUN]")
    p.add_argument("--all-facts", action="store_true")
    p.add_argument("--limit", type=int, default=0, help="at most this many facts (0: all)")
    p.add_argument("--permutations", type=int, default=1000)
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = run(a)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1, default=float))
    print(table(r))


if __name__ == "__main__":
    main()
