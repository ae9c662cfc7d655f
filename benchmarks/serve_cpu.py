"""``actstore serve``'s computing views called in-process (no HTTP): the median CPU time (``process_time``,
all threads) and wall time of the first calls of K different parameters per view, after the app's
warm-up.  CPU time is steadier than wall time on a shared machine; run it from two checkouts to compare code.

    python benchmarks/serve_cpu.py STORE [K] [VIEW,VIEW]   # one JSON line (VIEWs: prompt, contributions,
                                                           # head, features, search, sql_new; all by default)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actstore.serve import console, prompt, search, views
from actstore.serve.app import warm
from actstore.serve.catalog import Catalog

page_fn = search.prompts_page
path = sys.argv[1]
k = int(sys.argv[2]) if len(sys.argv) > 2 else 7
cat = Catalog.open([path])
warm(cat)
s = next(iter(cat))
st = s.store
if "probe_episodes" in st.table_files():  # queries of the probe run, else prompts of the store
    q = "SELECT DISTINCT example_id FROM probe_episodes, unnest(query_ids) AS t(example_id) ORDER BY hash(example_id) LIMIT ?"
else:
    q = "SELECT example_id FROM examples ORDER BY hash(example_id) LIMIT ?"
exs = [r["example_id"] for r in st.sql(q, [3 * k]).to_pylist()]
g = st.geometry
heads = [(la, h) for la in range(g.n_layers) for h in range(g.n_heads)]
heads = [heads[(i * 7919) % len(heads)] for i in range(k)]
W = ["the", "city", "of", "river", "king", "music", "war", "film", "team", "church"]
LIMITS = console.ConsoleLimits()
SORTED = "SELECT example_id, relation_id, text FROM examples WHERE example_id % 97 <> {i} ORDER BY example_id"
fns = {
    "prompt": lambda i: prompt.prompt_view(st, exs[2 * k + i]),
    "contributions": lambda i: prompt.contributions(s, exs[i], None, None, None),
    "head": lambda i: views.head_view(st, *heads[i]),
    "features": lambda i: console.features_projection(st, "attn_head", i % g.n_layers, None, None, 500, i),
    "search": lambda i: page_fn(st, None, W[i % len(W)], 0, 25),
    # a statement never run before that sorts every row (each i another statement), its page 5
    "sql_new": lambda i: console.run_page(st, SORTED.format(i=i), 5, 100, LIMITS, s.cached),
}
only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set(fns)
fns = {n: f for n, f in fns.items() if n in only}
out: dict[str, object] = {}
for name, f in fns.items():
    cs, ws = [], []
    for i in range(k):
        c0 = time.process_time()
        w0 = time.perf_counter()
        f(i)
        cs.append(1000 * (time.process_time() - c0))
        ws.append(1000 * (time.perf_counter() - w0))
    out[name] = {"cpu_ms": round(statistics.median(cs), 1), "wall_ms": round(statistics.median(ws), 1)}
out["load"] = os.getloadavg()[0]
print(json.dumps(out))
