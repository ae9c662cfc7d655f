"""How a selection's bound example ids filter a table, at 10^4 / 10^5 / 10^6 rows (half selected):
``list_contains($rows, id)`` vs ``id IN (SELECT unnest($rows))`` (what actstore.query.select.rows uses) vs a
predicate evaluated in SQL.  Medians of 5, one process, DuckDB over an Arrow table.

    python benchmarks/bench_rows_condition.py
"""

import time

import duckdb
import numpy as np
import pyarrow as pa

con = duckdb.connect()
for n in (10_000, 100_000, 1_000_000):
    t = pa.table({"example_id": np.arange(n, dtype=np.int64), "x": np.random.default_rng(0).random(n)})
    con.register("examples", t)
    ids = [int(i) for i in range(0, n, 2)]
    res = {}
    for name, q, p in (
        (
            "list_contains",
            "SELECT count(*) FROM examples WHERE list_contains($rows, example_id)",
            {"rows": ids},
        ),
        (
            "IN unnest",
            "SELECT count(*) FROM examples WHERE example_id IN (SELECT unnest($rows::BIGINT[]))",
            {"rows": ids},
        ),
        ("pasted predicate", "SELECT count(*) FROM examples WHERE example_id % 2 = 0", None),
    ):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            con.execute(q, p).fetchall()
            ts.append(time.perf_counter() - t0)
        res[name] = sorted(ts)[2]
    print(n, {k: f"{v * 1000:.1f} ms" for k, v in res.items()})
