"""Query benchmark: every feature kind against its compute floor, the factors against a memmap, SQL latency.

On one real store (SmolLM2-135M over FewRel, 512 prompts ingested once if no ``--store`` is given),
measured side by side in one run (shuffled, interleaved rounds; medians; every result checked
equal to the others of its group), at each of ``--threads`` (torch intra-op threads):

* **kinds**: ``sel.features(kind)`` on a store kept open (selection made) for ``attn_head``,
  ``attn``, ``mlp``, ``mlp_group``, ``attn_entity``, ``resid``, ``z`` over all rows and
  ``attn_head_token`` over one relation's rows, against its floor, two parts timed separately:
  ``read`` (the stored factors the kind needs, read and widened to float32 by the store's own
  readers, per segment) and ``math`` (the einsum/matmul alone, written here, on those factors
  and the weights already in memory).  ``floor = read + math``; ratio = features / floor.
* **memmap**: ``attn_head`` from the factors against reading the materialised float32 array
  (written beforehand, outside the timing) from a numpy memmap.
* **selective**: one relation and three layers against the full scan (``attn_head``), with the
  bytes and chunks the store fetched (counted by wrapping the store's chunk reads).

Warm = files in the page cache; cold = the store's segment files (or the memmap file) evicted
with ``posix_fadvise(DONTNEED)`` just before (only these files).  Either way the timed call
follows an untimed call of the same case (in the same thread setting), so warm and cold differ
only in the page cache, not in the allocator's or the thread pool's state left by the case timed before.  Then, once:

* **sql**: a fresh ``actstore.open`` + its first query on ``--sql-store`` (read only), in this
  process (imports done) and ``actstore sql`` end to end (a subprocess per call);
* **probe**: ``actstore.query.analyses.probe.load_features`` against ``sel.features`` (rows/s) for the probe kinds,
  with the peak RSS of each call above the RSS before it (``VmHWM``, one call per fresh process).

    python benchmarks/bench_query.py [--quick] [--store PATH] [--threads 1,2] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit, evict  # noqa: E402

KINDS = ("attn_head", "attn", "mlp", "mlp_group", "attn_entity", "resid", "z", "attn_head_token")
FIRST_QUERY = "SELECT count(*) AS n FROM examples"


def make_store(path: str, n_prompts: int, batch: int = 16, chunk_layers: int = 1) -> None:
    from benchmarks.bench_ingest import load, time_ingest

    loaded, prompts = load(n_prompts)
    time_ingest(loaded, prompts, batch, path, "float16", chunk_layers=chunk_layers)


def files_under(path: str) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    x = fn()
    return time.perf_counter() - t0, x


class ReadCounter:
    """Counts the chunks and bytes the store fetches: wraps :class:`actstore.core.chunks.ChunkGuard`'s ``get``
    (reads through zarr) and :meth:`actstore.core.chunks.LocalChunks._decode` (each chunk, or inner chunk of
    a shard, of a local read without zarr's dispatch; bytes = its stored bytes, a shard's index not
    counted: 16 bytes per inner chunk)."""

    def __init__(self) -> None:
        from actstore.core.chunks import ChunkGuard, LocalChunks, is_chunk_key

        self.chunks = 0
        self.bytes = 0
        original = ChunkGuard.get
        counter = self

        async def get(guard: Any, key: str, prototype: Any, byte_range: Any = None) -> Any:
            buf = await original(guard, key, prototype, byte_range)
            if buf is not None and is_chunk_key(key):
                counter.chunks += 1
                counter.bytes += len(buf)
            return buf

        ChunkGuard.get = get  # type: ignore[method-assign,assignment]
        original_decode = LocalChunks._decode

        def decode(chunks: Any, i: int, j: int, data: bytes, dest: Any) -> None:
            original_decode(chunks, i, j, data, dest)
            counter.chunks += 1
            counter.bytes += len(data)

        LocalChunks._decode = decode  # type: ignore[method-assign,assignment]

    def count(self, fn: Callable[[], Any]) -> tuple[int, int]:
        c0, b0 = self.chunks, self.bytes
        fn()
        return self.chunks - c0, self.bytes - b0


# ------------------------------------------------------------------ the floors
def factor_reader(store: Any, kind: str, blocks: list[Any]) -> Callable[[], list[dict[str, np.ndarray]]]:
    """Reading what ``kind`` needs, segment by segment, with the store's own readers (float32)."""

    def read() -> list[dict[str, np.ndarray]]:
        out = []
        for b in blocks:
            if kind in ("z", "attn_head", "attn"):
                out.append({"z": store.read_segment_rows(b.segment, "z", b.seg_rows)})
            elif kind in ("mlp", "mlp_group"):
                out.append({"mlp": store.read_segment_rows(b.segment, "mlp", b.seg_rows)})
            elif kind == "resid":
                out.append({"resid": store.read_segment_rows(b.segment, "resid", b.seg_rows)})
            else:
                if kind == "attn_entity":
                    has = b.subject_start >= 0
                    starts = b.src_start + np.where(has, b.subject_start, 0)
                    lengths = np.where(has, b.subject_end - b.subject_start, 0)
                else:
                    starts, lengths = b.src_start, b.n_src
                out.append(
                    {
                        "attn": store.read_segment_ranges(b.segment, "attn", starts, lengths),
                        "v": store.read_segment_ranges(b.segment, "v", starts, lengths),
                        "lengths": np.asarray(lengths),
                    }
                )
        return out

    return read


def factor_math(store: Any, kind: str, factors: list[dict[str, np.ndarray]]) -> Callable[[], Any]:
    """The arithmetic of ``kind`` alone (written here, not the library's), on factors in memory."""
    import torch

    from actstore.query.select.features import group_bounds

    g = store.geometry
    W = {n: torch.from_numpy(store.weight(n)) for n in ("W_O", "b_O", "W_down", "b_down")}
    WO_flat = W["W_O"].reshape(g.n_layers, g.n_heads * g.d_head, g.d_model)
    kv = torch.arange(g.n_heads) // g.kv_group
    t = [{k: torch.from_numpy(v) for k, v in f.items()} for f in factors]
    bounds = group_bounds(g.d_mlp, g.n_heads)

    def run() -> list[Any]:
        out: list[Any] = []
        for f in t:
            if kind == "attn_head":
                out.append(torch.einsum("nlhk,lhkd->nlhd", f["z"], W["W_O"]))
            elif kind == "attn":
                z = f["z"].reshape(f["z"].shape[0], g.n_layers, -1)
                out.append(torch.baddbmm(W["b_O"][:, None], z.transpose(0, 1), WO_flat).transpose(0, 1))
            elif kind == "mlp":
                out.append(
                    torch.baddbmm(W["b_down"][:, None], f["mlp"].transpose(0, 1), W["W_down"]).transpose(0, 1)
                )
            elif kind == "mlp_group":
                a = f["mlp"].transpose(0, 1)
                out.append(
                    [
                        torch.bmm(a[:, :, lo:hi], W["W_down"][:, lo:hi])
                        for lo, hi in zip(bounds[:-1], bounds[1:])
                    ]
                )
            elif kind in ("z", "resid"):
                out.append(None)  # no arithmetic: the floor is the read
            else:
                av = f["attn"][..., None] * f["v"][:, :, kv]  # [N, L, H, dh]
                if kind == "attn_entity":
                    owner = torch.repeat_interleave(torch.arange(len(f["lengths"])), f["lengths"])
                    ze = torch.zeros((len(f["lengths"]), g.n_layers, g.n_heads, g.d_head)).index_add_(
                        0, owner, av
                    )
                    out.append(torch.einsum("nlhk,lhkd->nlhd", ze, W["W_O"]))
                else:
                    out.append(torch.einsum("slhk,lhkd->slhd", av, W["W_O"]))
        return out

    return run


def floor_result(kind: str, out: list[Any], lengths: list[np.ndarray]) -> np.ndarray | None:
    """The floor's output laid out as ``features(kind)`` (for the equality check, outside the timing)."""
    if kind in ("z", "resid"):
        return None
    if kind == "mlp_group":
        return np.concatenate(
            [np.stack([p.numpy() for p in parts], 2).transpose(1, 0, 2, 3) for parts in out]
        )
    if kind == "attn_head_token":
        rows = []
        S = max(int(x.max()) for x in lengths)
        for o, ln in zip(out, lengths):
            o = o.numpy()
            starts = np.concatenate([[0], np.cumsum(ln)[:-1]])
            for s, n in zip(starts, ln):
                r = np.zeros((S, *o.shape[1:]), np.float32)
                r[:n] = o[s : s + n]
                rows.append(r.transpose(1, 2, 0, 3))
        return np.stack(rows)
    return np.concatenate([o.numpy() for o in out])


def check_equal(name: str, x: np.ndarray, ref: np.ndarray, tol: float) -> float:
    err = float(np.abs(x - ref).max() / max(float(np.abs(ref).max()), 1e-12))
    if x.shape != ref.shape or err > tol:
        raise AssertionError(f"{name}: shape {x.shape} vs {ref.shape}, max rel. error {err:.2e}")
    return err


# ------------------------------------------------------------------ sql and probe (once)
def sql_latency(path: str, n: int) -> dict[str, Any]:
    """Fresh ``actstore.open`` + first query in this process, and ``actstore sql`` end to end."""
    import actstore
    from actstore.query.select.plan import ROWS_SQL

    actstore.open(path).sql(FIRST_QUERY)  # imports and the process's database, outside the timing
    sel_sql = ROWS_SQL.format(cond="t.example_id IN (SELECT example_id FROM examples WHERE relation_id = $r)")
    rel = actstore.open(path).sql("SELECT relation_id FROM examples LIMIT 1").column(0)[0].as_py()
    first, sel, cpu = [], [], []
    for _ in range(n):
        c0 = time.process_time()
        first.append(timed(lambda: actstore.open(path).sql(FIRST_QUERY))[0])
        cpu.append(time.process_time() - c0)
        sel.append(timed(lambda: actstore.open(path).sql(sel_sql, {"r": rel}))[0])
    # What the ``actstore`` console script runs, with this checkout's packages first on the path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cli_cmd = [
        sys.executable,
        "-c",
        "import sys; from actstore.cli import main; sys.argv[0] = 'actstore'; sys.exit(main())",
        "sql",
        path,
        FIRST_QUERY,
    ]
    cli, imp, cli_cpu = [], [], []
    for _ in range(max(3, n // 4)):
        r0 = os.times()
        t = timed(lambda: subprocess.run(cli_cmd, check=True, capture_output=True, env=env, cwd=REPO))[0]
        r1 = os.times()
        cli.append(t)
        cli_cpu.append(r1.children_user + r1.children_system - r0.children_user - r0.children_system)
        imp.append(
            timed(
                lambda: subprocess.run(
                    [sys.executable, "-c", "import actstore.cli"], check=True, env=env, cwd=REPO
                )
            )[0]
        )
    store = actstore.open(path)
    return {
        "store": path,
        "rows": store.n_rows,
        "calls": n,
        "open_first_query_s": {"median": statistics.median(first), "min": min(first)},
        "open_first_query_cpu_s": statistics.median(cpu),
        "open_selection_query_s": {"median": statistics.median(sel), "min": min(sel)},
        "cli_sql_end_to_end_s": {"median": statistics.median(cli), "min": min(cli)},
        "cli_sql_end_to_end_cpu_s": statistics.median(cli_cpu),
        "python_import_actstore_cli_s": {"median": statistics.median(imp), "min": min(imp)},
    }


_PEAK_CODE = """
import sys, numpy as np
sys.path.insert(0, {repo!r})
import actstore
from actstore.query.analyses.probe import load_features
def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024
store = actstore.open({path!r})
sel = store.select()
case, kind = {case!r}, {kind!r}
rss0 = status('VmRSS')
if case == 'raw_features':
    x = sel.features(kind)
else:
    x = load_features(store, kind, dtype=case.rsplit('_', 1)[1]).data
print('PEAK', status('VmHWM') - rss0, 'RESULT', x.nbytes if hasattr(x, 'nbytes') else x.numel() * x.element_size())
"""


def peak_rss(path: str, case: str, kind: str) -> tuple[int, int]:
    """(peak RSS above the RSS before the call, bytes of the result) of one call in a fresh process."""
    code = _PEAK_CODE.format(repo=str(REPO), path=path, case=case, kind=kind)
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout
    words = next(line for line in out.splitlines() if line.startswith("PEAK")).split()
    return int(words[1]), int(words[3])


def probe_loading(path: str, kinds: list[str], rounds: int) -> dict[str, Any]:
    """``load_features`` (float32, float16) against ``sel.features`` for the same rows, rows/s and peak RSS."""
    import actstore
    from actstore.query.analyses.probe_features import load_features

    store = actstore.open(path)
    sel = store.select()
    out: dict[str, Any] = {}
    for kind in kinds:
        cases: dict[str, Callable[[], Any]] = {
            "raw_features": partial(sel.features, kind),
            "load_features_float32": partial(lambda k: load_features(store, k).data, kind),
            "load_features_float16": partial(lambda k: load_features(store, k, dtype="float16").data, kind),
        }
        ref = cases["raw_features"]()
        for name in ("load_features_float32", "load_features_float16"):
            x = cases[name]()
            check_equal(
                f"{kind} {name}", x.float().numpy().reshape(ref.shape), ref, 1e-3 if "16" in name else 1e-6
            )
        del ref, x
        times: dict[str, list[float]] = {k: [] for k in cases}
        rng = random.Random(1)
        for _ in range(rounds):
            order = list(cases)
            rng.shuffle(order)
            for name in order:
                times[name].append(timed(cases[name])[0])
        peak = {name: peak_rss(path, name, kind) for name in cases}
        med = {k: statistics.median(v) for k, v in times.items()}
        n = len(sel)
        out[kind] = {
            "rows": n,
            "seconds_median": med,
            "rows_per_s": {k: n / v for k, v in med.items()},
            "throughput_vs_raw": {k: med["raw_features"] / med[k] for k in med if k != "raw_features"},
            "peak_rss_above_start_mb": {k: v[0] / 2**20 for k, v in peak.items()},
            "result_mb": {k: v[1] / 2**20 for k, v in peak.items()},
        }
    return out


# ------------------------------------------------------------------ main
def measure_kinds(
    path: str, tmp: str, layer_text: str, rounds: int, thread_counts: list[int], kinds: list[str]
) -> dict[str, Any]:
    """The kinds against their floors, attn_head against the memmap, the selective read."""
    import torch

    import actstore

    counter = ReadCounter()
    store = actstore.open(path)
    g = store.geometry
    layers = [int(x) for x in layer_text.split(",")]
    rel = store.sql(
        "SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY n DESC, 1"
    ).to_pylist()[0]
    where = "relation_id = $rel"
    params = {"rel": rel["relation_id"]}
    sel_rows = (
        store.sql("SELECT example_id FROM examples WHERE relation_id = $rel ORDER BY example_id", params)
        .column(0)
        .to_numpy()
    )
    sel_all, sel_rel = store.select(), store.select(where, params=params)
    store_files = [f for f in files_under(path) if f"{os.sep}segments{os.sep}" in f]

    # Materialise attn_head once, outside the timing (the memmap's file).
    full = sel_all.features("attn_head")
    mm_path = os.path.join(tmp, "attn_head_float32.npy")
    mm = np.lib.format.open_memmap(mm_path, mode="w+", dtype="float32", shape=full.shape)
    mm[...] = full
    mm.flush()
    del mm

    cases: dict[str, Callable[[], Any]] = {}
    io: dict[str, list[str]] = {}  # files a case reads (evicted before its cold runs)
    checks: dict[str, float] = {}
    for kind in kinds:
        sel = sel_rel if kind == "attn_head_token" else sel_all
        blocks = [b for _, b in sel.blocks()]
        read = factor_reader(store, kind, blocks)
        factors = read()
        math = factor_math(store, kind, factors)
        cases[f"{kind}/features"] = partial(sel.features, kind)
        cases[f"{kind}/read"] = read
        cases[f"{kind}/math"] = math
        io[f"{kind}/features"] = io[f"{kind}/read"] = store_files
        ref = sel.features(kind)
        fl = floor_result(kind, math(), [f.get("lengths", np.zeros(0, int)) for f in factors])
        if fl is not None:
            checks[kind] = check_equal(f"{kind} floor", fl, ref, 1e-5)
        del ref, fl
    if "attn_head" in kinds:
        cases["attn_head/memmap32"] = lambda: np.load(mm_path, mmap_mode="r").astype(
            np.float32
        )  # the read copies
        io["attn_head/memmap32"] = [mm_path]
        check_equal("memmap32", cases["attn_head/memmap32"](), full, 0)
    lay = np.asarray(layers)
    cases["selective/factors"] = lambda: sel_rel.features("attn_head", layers=layers)
    cases["selective/full_scan"] = lambda: sel_all.features("attn_head")
    cases["selective/memmap32"] = lambda: np.load(mm_path, mmap_mode="r")[
        sel_rows[:, None], lay[None, :]
    ].astype(np.float32)
    io["selective/factors"] = io["selective/full_scan"] = store_files
    io["selective/memmap32"] = [mm_path]
    sel_ref = full[sel_rows][:, layers]
    check_equal("selective/factors", cases["selective/factors"](), sel_ref, 1e-6)
    check_equal("selective/memmap32", cases["selective/memmap32"](), sel_ref, 0)
    del full, sel_ref
    fetched = {name: counter.count(cases[name]) for name in ("selective/factors", "selective/full_scan")}

    times: dict[str, list[float]] = {}
    for t in thread_counts:
        for name in cases:
            for state in ("warm", "cold") if name in io else ("warm",):
                times[f"{t}/{name}/{state}"] = []
    cpu: dict[str, list[float]] = {k: [] for k in times}  # CPU seconds of the process (all its threads)
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(times)
        rng.shuffle(order)
        for key in order:
            t_s, name, state = (
                key.split("/", 1)[0],
                key.split("/", 1)[1].rsplit("/", 1)[0],
                key.rsplit("/", 1)[1],
            )
            torch.set_num_threads(int(t_s))
            cases[name]()  # the same call first, so that warm and cold differ only in the page cache
            if state == "cold":
                evict(io[name])
            c0 = time.process_time()
            times[key].append(timed(cases[name])[0])
            cpu[key].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    def m(t: int, name: str, state: str = "warm") -> float:
        return med[f"{t}/{name}/{state}"]

    result: dict[str, Any] = {
        "store": path,
        "rows": store.n_rows,
        "rounds": rounds,
        "threads": thread_counts,
        "geometry": {
            "L": g.n_layers,
            "H": g.n_heads,
            "d_head": g.d_head,
            "d_model": g.d_model,
            "d_mlp": g.d_mlp,
        },
        "attn_head_token_rows": len(sel_rel),
        "floor_max_rel_error": checks,
        "seconds_median": med,
        "cpu_seconds_median": med_cpu,
    }
    kinds_out: dict[str, Any] = {}
    for t in thread_counts:
        for kind in kinds:
            for state in ("warm", "cold"):
                floor = m(t, f"{kind}/read", state) + m(t, f"{kind}/math")
                kinds_out[f"{t}/{kind}/{state}"] = {
                    "features_s": m(t, f"{kind}/features", state),
                    "read_s": m(t, f"{kind}/read", state),
                    "math_s": m(t, f"{kind}/math"),
                    "floor_s": floor,
                    "features_over_floor": m(t, f"{kind}/features", state) / floor,
                    "cpu_features_over_floor": med_cpu[f"{t}/{kind}/features/{state}"]
                    / (med_cpu[f"{t}/{kind}/read/{state}"] + med_cpu[f"{t}/{kind}/math/warm"]),
                }
    result["kinds"] = kinds_out
    if "attn_head" in kinds:
        result["attn_head_factors_over_memmap32"] = {
            f"{t}/{s}": m(t, "attn_head/features", s) / m(t, "attn_head/memmap32", s)
            for t in thread_counts
            for s in ("warm", "cold")
        }
    result["selective"] = {
        "where": f"relation_id = {rel['relation_id']!r}",
        "rows": len(sel_rel),
        "layers": layers,
        "full_over_selective": {
            f"{t}/{s}": m(t, "selective/full_scan", s) / m(t, "selective/factors", s)
            for t in thread_counts
            for s in ("warm", "cold")
        },
        "chunks_bytes_fetched": {k: {"chunks": c, "bytes": b} for k, (c, b) in fetched.items()},
    }
    result["bytes"] = {
        "z_arrays": sum(os.path.getsize(f) for f in store_files if f"{os.sep}z{os.sep}" in f),
        "segments": sum(os.path.getsize(f) for f in store_files),
        "memmap32": os.path.getsize(mm_path),
    }
    result["load_average_during_kinds"] = os.getloadavg()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 128-prompt store (when none is given), 3 rounds")
    ap.add_argument("--store", default=None, help="an existing store (else one is ingested into a temp dir)")
    ap.add_argument(
        "--prompts", type=int, default=None, help="prompts to ingest without --store (512; 128 quick)"
    )
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument(
        "--chunk-layers",
        type=int,
        default=1,
        help="layers per chunk of the store ingested without --store (0: all layers in one chunk)",
    )
    ap.add_argument("--layers", default="10,11,12", help="layers of the selective read")
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts to measure, e.g. 1,2")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument(
        "--sql-store",
        default="/tmp/fewrel-full",
        help="a store (6,128 FewRel rows in benchmarks/README.md; only read) for the SQL latency; '' to skip",
    )
    ap.add_argument("--sql-calls", type=int, default=20)
    ap.add_argument("--probe-kinds", default="attn_head,mlp", help="kinds for the probe loading ('' to skip)")
    ap.add_argument(
        "--parts", default="kinds,sql,probe", help="what to measure (kinds includes memmap, selective)"
    )
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    rounds = args.rounds or (3 if args.quick else 5)
    thread_counts = [int(x) for x in args.threads.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]

    import torch

    tmp = tempfile.mkdtemp(prefix="actstore-query-")
    path = args.store
    if path is None:
        path = os.path.join(tmp, "store")
        make_store(path, args.prompts or (128 if args.quick else 512), chunk_layers=args.chunk_layers)
    result: dict[str, Any] = {"store": path, "parts": sorted(parts)}
    if "kinds" in parts:
        result.update(measure_kinds(path, tmp, args.layers, rounds, thread_counts, kinds))
    torch.set_num_threads(thread_counts[0])
    if args.sql_store and "sql" in parts:
        result["sql"] = sql_latency(args.sql_store, args.sql_calls)
    probe_kinds = [k for k in args.probe_kinds.split(",") if k] if "probe" in parts else []
    if probe_kinds:
        result["probe"] = probe_loading(path, probe_kinds, max(1, rounds // 2 + 1))
    result["load_average_end"] = os.getloadavg()
    shutil.rmtree(tmp, ignore_errors=True)
    emit(result, args.json_out)


if __name__ == "__main__":
    main()
