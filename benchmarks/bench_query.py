"""Query benchmark: features served from the stored factors against a materialised array on disk.

On one real store (SmolLM2-135M over FewRel, ingested once if no ``--store`` is given):

* ``attn_head`` for every row and layer, rebuilt from the factors
  (``actstore.open(path).select().features("attn_head")``, i.e. z W_O per head) against reading
  the same array, written once beforehand (outside the timing), from a numpy memmap: as float32
  (the exact result) and as float16 widened to float32 (the size a materialised store would use);
  (for a store kept open with the selection made, and for a fresh store: open + SQL + features);
* a selective read (one relation, a few layers) against the full scan, for both.

Every case runs warm (files in the page cache, as right after writing) and cold: before each
cold read the store's segment files and the memmap file are evicted from the page cache with
``posix_fadvise(DONTNEED)`` (only these files; nothing else on the machine is touched).  Cases
alternate in a shuffled order per round; times are medians over rounds.

    python benchmarks/bench_query.py [--quick] [--store PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit  # noqa: E402


def make_store(path: str, n_prompts: int, batch: int = 16) -> None:
    from benchmarks.bench_ingest import load, time_ingest

    loaded, prompts = load(n_prompts)
    time_ingest(loaded, prompts, batch, path, "float16")


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (clean pages only; they are all fsynced first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(path: str) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    x = fn()
    return time.perf_counter() - t0, x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 128-prompt store (when none is given), 3 rounds")
    ap.add_argument("--store", default=None, help="an existing store (else one is ingested into a temp dir)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts to ingest without --store (512; 128 quick)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--layers", default="10,11,12", help="layers of the selective read")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)

    import torch

    import actstore

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="actstore-query-")
    path = args.store
    if path is None:
        path = os.path.join(tmp, "store")
        make_store(path, args.prompts or (128 if args.quick else 512))
    store = actstore.open(path)
    g = store.geometry
    layers = [int(x) for x in args.layers.split(",")]
    rel = store.sql("SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY n DESC, 1").to_pylist()[0]
    where = f"relation_id = '{rel['relation_id']}'"
    sel_rows = store.sql(f"SELECT example_id FROM examples WHERE {where} ORDER BY example_id").column(0).to_numpy()
    n = store.n_rows

    # Materialise once, outside the timing: float32 (exact) and float16 memmaps.
    full = store.select().features("attn_head")  # [n, L, H, d_model]
    mm_paths = {}
    for dt in ("float32", "float16"):
        p = os.path.join(tmp, f"attn_head_{dt}.npy")
        mm = np.lib.format.open_memmap(p, mode="w+", dtype=dt, shape=full.shape)
        mm[...] = full
        mm.flush()
        del mm
        mm_paths[dt] = p
    store_files = files_under(path)
    # ``factors``: one Store kept open (as in a notebook) and the Selection already made (the memmap
    # reads get their row numbers from the same SQL, outside the timing); ``factorsfresh``: a new
    # Store per read, so the timing includes opening it, the SQL selection and reading W_O.

    def fresh_full() -> np.ndarray:
        return actstore.open(path).select().features("attn_head")

    def fresh_sel() -> np.ndarray:
        return actstore.open(path).select(where).features("attn_head", layers=layers)

    opened = actstore.open(path)
    sel_all, sel_rel = opened.select(), opened.select(where)
    sel_all.features("z", layers=[0])  # its tables and segment arrays are open, W_O in memory

    def factors_full() -> np.ndarray:
        return sel_all.features("attn_head")

    def factors_sel() -> np.ndarray:
        return sel_rel.features("attn_head", layers=layers)

    def memmap_full(dt: str) -> Callable[[], np.ndarray]:
        def f() -> np.ndarray:
            return np.load(mm_paths[dt], mmap_mode="r").astype(np.float32)  # astype copies: the read
        return f

    def memmap_sel(dt: str) -> Callable[[], np.ndarray]:
        def f() -> np.ndarray:
            mm = np.load(mm_paths[dt], mmap_mode="r")
            return mm[sel_rows[:, None], np.asarray(layers)[None, :]].astype(np.float32)
        return f

    cases: dict[str, Callable[[], np.ndarray]] = {
        "factors_full": factors_full, "factors_selective": factors_sel,
        "factorsfresh_full": fresh_full, "factorsfresh_selective": fresh_sel,
        "memmap32_full": memmap_full("float32"), "memmap32_selective": memmap_sel("float32"),
        "memmap16_full": memmap_full("float16"), "memmap16_selective": memmap_sel("float16"),
    }
    # Check once that every case returns the same numbers.
    sel_ref = full[sel_rows][:, layers]
    for name, fn in cases.items():
        x = fn()
        ref = sel_ref if name.endswith("selective") else full
        tol = 1e-3 if "16" in name else 1e-5
        err = float(np.abs(x - ref).max() / np.abs(ref).max())
        if x.shape != ref.shape or err > tol:
            raise AssertionError(f"{name}: shape {x.shape} vs {ref.shape}, max rel. error {err:.2e}")
    times: dict[str, list[float]] = {f"{c}_{w}": [] for c in cases for w in ("warm", "cold")}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(times)
        rng.shuffle(order)
        for key in order:
            name, state = key.rsplit("_", 1)
            if state == "cold":
                evict(store_files if name.startswith("factors") else [mm_paths["float32" if "32" in name else "float16"]])
            else:
                cases[name]()  # make sure its files are in the page cache
            times[key].append(timed(cases[name])[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    sql_s = statistics.median(timed(lambda: opened.select(where))[0] for _ in range(rounds))

    def sizes(p: str) -> int:
        return sum(os.path.getsize(f) for f in files_under(p)) if os.path.isdir(p) else os.path.getsize(p)

    result: dict[str, Any] = {
        "store": path, "rows": n, "rounds": rounds, "threads": args.threads,
        "geometry": {"L": g.n_layers, "H": g.n_heads, "d_head": g.d_head, "d_model": g.d_model},
        "selective": {"where": where, "rows": int(sel_rows.size), "layers": layers},
        "seconds_median": med,
        "factors_over_memmap32": {w: med[f"factors_full_{w}"] / med[f"memmap32_full_{w}"] for w in ("warm", "cold")},
        "fresh_factors_over_memmap32": {w: med[f"factorsfresh_full_{w}"] / med[f"memmap32_full_{w}"]
                                        for w in ("warm", "cold")},
        "sql_select_seconds": sql_s,
        "factors_over_memmap16": {w: med[f"factors_full_{w}"] / med[f"memmap16_full_{w}"] for w in ("warm", "cold")},
        "full_over_selective_factors": {w: med[f"factors_full_{w}"] / med[f"factors_selective_{w}"]
                                        for w in ("warm", "cold")},
        "full_over_selective_memmap32": {w: med[f"memmap32_full_{w}"] / med[f"memmap32_selective_{w}"]
                                         for w in ("warm", "cold")},
        "bytes": {"store_segments": sizes(os.path.join(path, "segments")),
                  "z_arrays": sum(os.path.getsize(f) for f in store_files if f"{os.sep}z{os.sep}" in f),
                  "memmap32": os.path.getsize(mm_paths["float32"]), "memmap16": os.path.getsize(mm_paths["float16"])},
        "load_average": os.getloadavg(),
    }
    shutil.rmtree(tmp, ignore_errors=True)
    emit(result, args.json_out)


if __name__ == "__main__":
    main()
