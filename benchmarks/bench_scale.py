"""How a store's costs grow with its size: a synthetic fact corpus of N prompts (40 relations, 4-28 words
a prompt), ingested with the tiny random Llama, then the figures of issue 33 at that size.

    python benchmarks/bench_scale.py corpus 10000 /tmp/c10k.jsonl
    python benchmarks/bench_scale.py build /tmp/c10k.jsonl /tmp/s10k          # ingest: wall, CPU, peak RSS
    python benchmarks/bench_scale.py build /tmp/c1m.jsonl /tmp/s1m --stop-after 8   # first commit, streaming RSS
    python benchmarks/bench_scale.py measure /tmp/s10k --json out.json        # queries, info, verify
    python benchmarks/bench_scale.py compare /tmp/plain10k /tmp/s10k          # several stores, one run
    python benchmarks/bench_scale.py selective /tmp/s10k /tmp/s100k --checkout /work/main --checkout .
                                                                   # two versions of the code, interleaved
    python benchmarks/bench_scale.py commands /tmp/s1m --checkout OLD --checkout . --only quick,info
    python -m benchmarks.bench_scale_s3 /tmp/s100k --checkout OLD --checkout .   # on a moto server: requests

``measure`` times each query as a median of 5 on an open store (``actstore.open``, imports done), and
"fresh open + first query" (imports done before the clock starts) and the commands in fresh processes
(medians of 3; the commands' figures include Python's start and imports).  Bytes and files
on disk are counted under the store's root.

The uncompacted figures ("before") are those of the same store read from its shards
(``tests/helpers.uncompact``: snapshot and compacted files removed), the path every store took before
format 3 and a store still takes while its ingest runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit

WORDS = (
    "the of and a in to is was for on as with by at from his her that which this an are were its it "
    "city river north south old new great small red blue green stone hill lake king queen house land "
    "music film book song game team club party state union church school army war law"
).split()
RELATIONS = [f"R{i:02d}" for i in range(40)]


def corpus(n: int, path: Path, seed: int = 0) -> None:
    """``n`` JSONL prompts: a subject word inside 4-28 words of filler, an object word, 40 relations."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            rel = RELATIONS[i % len(RELATIONS)]
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 27))]
            subject = f"S{rng.randrange(100000)}"
            words.insert(rng.randrange(len(words) + 1), subject)
            row = {
                "text": " ".join(words),
                "subject": subject,
                "object": rng.choice(WORDS),
                "relation_id": rel,
                "relation_name": f"relation {rel}",
            }
            f.write(json.dumps(row) + "\n")


def build(
    corpus_path: Path, out: Path, segment_size: int, batch_size: int, stop_after: int | None = None
) -> dict[str, Any]:
    """Ingest ``corpus_path`` into ``out`` in a child process, watching it: wall, CPU, peak RSS (the
    kernel's, for the whole run), the seconds from the start to the first committed segment (an upper
    bound on the first batch: that segment's forwards and its write included) and the largest RSS
    while segments are written (sampled from /proc, before the final compaction).  ``stop_after``:
    interrupt the ingest once that many segments are committed (a store to resume, not to query)."""
    cmd = [sys.executable, "-m", "actstore.cli", "ingest", "--model", "tiny-llama"]
    cmd += ["--dataset", f"jsonl:{corpus_path}", "--out", str(out), "--overwrite", "--quiet", "--json"]
    cmd += ["--batch-size", str(batch_size), "--segment-size", str(segment_size), "--threads", "1"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first: float | None = None
    streaming_rss = 0.0
    n_commits = 0
    while proc.poll() is None:
        time.sleep(0.05 if first is None else 0.5)
        commits = out / "commits"
        n_commits = sum(1 for _ in commits.iterdir()) if commits.is_dir() else 0
        if n_commits and first is None:
            first = time.perf_counter() - t0
        if n_commits and not (out / "snapshot").exists():  # segments being written, no compaction yet
            streaming_rss = max(streaming_rss, _rss_mb(proc.pid))
        if stop_after is not None and n_commits >= stop_after:
            proc.terminate()
            break
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    r: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 3),
        "peak_rss_mb": round(after.ru_maxrss / 1024, 1),  # the largest child so far (Linux: KB)
        "first_commit_s": None if first is None else round(first, 2),
        "streaming_rss_mb": round(streaming_rss, 1),
    }
    if stop_after is not None:
        return {**r, "stopped_after_segments": n_commits}
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {stderr.strip().splitlines()[-1:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    return {**r, "ingest": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}}


def _rss_mb(pid: int) -> float:
    """The resident set of process ``pid`` now, in MB (0 when it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def disk(root: Path) -> dict[str, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def _median_ms(fn: Any, n: int = 5) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(ts), 2)


def read_all(root: Path) -> float:
    """Seconds to read every file of the store once, one thread per core (what verify must at least do)."""
    from concurrent.futures import ThreadPoolExecutor

    files = [p for p in root.rglob("*") if p.is_file()]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sum(pool.map(lambda p: len(p.read_bytes()), files))
    return time.perf_counter() - t0


FRESH = """
import sys, time
import actstore, duckdb, pyarrow.dataset, actstore.query.select.selection  # imports done (the issue's measure)
t1 = time.perf_counter()
s = actstore.open(sys.argv[1])
n = s.sql("SELECT count(*) AS n FROM examples").column("n")[0].as_py()
t2 = time.perf_counter()
ids = s.select("relation_id = 'R07'").limit(64)
x = ids.features("resid", layers=[1])
t3 = time.perf_counter()
print((t2 - t1) * 1000, (t3 - t2) * 1000)
"""


SELECTIVE = """
import json, statistics, sys, time
import actstore, duckdb, pyarrow.dataset, actstore.query.select.selection  # imports done
store = sys.argv[1]
t0, c0 = time.perf_counter(), time.process_time()
s = actstore.open(store)
s.select("relation_id = 'R07'").limit(64).features("resid", layers=[1])
fresh, fresh_cpu = time.perf_counter() - t0, time.process_time() - c0

def med(fn, n=7):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(1000 * statistics.median(ts), 2)

n = s.sql("SELECT count(*) AS n FROM examples").column("n")[0].as_py()
last = "R%02d" % ((n - 1) % 40)
print(json.dumps({
    "fresh_open_rel64_ms": round(1000 * fresh, 1),
    "fresh_open_rel64_cpu_ms": round(1000 * fresh_cpu, 1),  # (this process's CPU, its threads too)
    "rel64_resid_ms": med(lambda: s.select("relation_id = 'R07'").limit(64).features("resid", layers=[1])),
    "rel64_param_ms": med(lambda: s.select("relation_id = ?", params=["R07"]).limit(64).rows),
    "rel_all_rows_ms": med(lambda: s.select("relation_id = 'R07'").rows, 3),
    "rel64_late_ms": med(lambda: s.select(f"relation_id = '{last}' AND example_id >= {n - 4000}").limit(64).rows),
    "point_resid_ms": med(lambda: s.select(f"example_id = {n // 2 + 7}").features("resid", layers=[1])),
    "limit64_all_ms": med(lambda: s.select().limit(64).rows),
}))
"""


def selective(stores: list[Path], checkouts: list[Path], rounds: int) -> dict[str, Any]:
    """The selective figures of each store read by each checkout's code (``CHECKOUT/.venv/bin/python``
    in ``CHECKOUT``), each in a fresh process, rounds interleaved; medians over the rounds."""
    runs: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for store in stores:
            for co in checkouts:
                r = subprocess.run(
                    [str(co / ".venv" / "bin" / "python"), "-c", SELECTIVE, str(store)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=co,
                    env={**os.environ, "PYTHONPATH": str(co)},
                )
                got = json.loads(r.stdout.strip().splitlines()[-1])
                key = f"{store} @ {co}"
                for k, v in got.items():
                    runs.setdefault(key, {}).setdefault(k, []).append(v)
    return {key: {k: round(statistics.median(v), 2) for k, v in d.items()} for key, d in runs.items()}


COMMANDS = {"verify": ["verify"], "quick": ["verify", "--quick"], "info": ["info"]}


def commands(
    stores: list[Path], checkouts: list[Path], rounds: int, only: tuple[str, ...] = tuple(COMMANDS)
) -> dict[str, Any]:
    """``actstore verify``, ``verify --quick`` and ``info`` (``only``: some of them) end to end with each
    checkout's code, beside reading every file of the store once (threads; with ``verify`` only), rounds
    interleaved; medians (seconds), and the commands' CPU time (user + system, ``cpu`` keys)."""
    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for store in stores:
            if "verify" in only:
                runs.setdefault(f"{store} read_all_files", []).append(read_all(store))
            for co in checkouts:
                for cmd in (COMMANDS[k] for k in only):
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    t0 = time.perf_counter()
                    r = subprocess.run(
                        [str(co / ".venv" / "bin" / "python"), "-m", "actstore.cli", *cmd, str(store)],
                        capture_output=True,
                        text=True,
                        cwd=co,
                    )
                    dt = time.perf_counter() - t0 if r.returncode == 0 else float("nan")
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                    runs.setdefault(f"{store} @ {co} {' '.join(cmd)}", []).append(dt)
                    runs.setdefault(f"{store} @ {co} {' '.join(cmd)} cpu", []).append(cpu)
    return {k: round(statistics.median(v), 3) for k, v in runs.items()}


def measure(store: Path) -> dict[str, Any]:
    import actstore

    s = actstore.open(store)
    n = s.sql("SELECT count(*) AS n FROM examples").column("n")[0].as_py()
    eid = n // 2 + 7
    out: dict[str, Any] = {"rows": n, "segments": len(s.commits), **disk(store)}
    out["count_ms"] = _median_ms(lambda: s.sql("SELECT count(*) FROM examples"))
    out["point_sql_ms"] = _median_ms(lambda: s.sql("SELECT * FROM examples WHERE example_id = ?", [eid]))
    out["point_resid_ms"] = _median_ms(lambda: s.select(f"example_id = {eid}").features("resid", layers=[1]))
    out["rel64_resid_ms"] = _median_ms(
        lambda: s.select("relation_id = 'R07'").limit(64).features("resid", layers=[1])
    )
    fresh = []
    for _ in range(3):
        r = subprocess.run(
            [sys.executable, "-c", FRESH, str(store)], capture_output=True, text=True, check=True
        )
        fresh.append([float(v) for v in r.stdout.split()])
    out["fresh_open_count_ms"] = round(statistics.median(f[0] for f in fresh), 1)
    out["fresh_rel64_resid_ms"] = round(statistics.median(f[1] for f in fresh), 1)
    out["read_all_files_s"] = round(read_all(store), 3)  # verify's floor: every file read once, threads
    for name, cmd in (
        ("info_s", ["info"]),
        ("verify_s", ["verify"]),
        ("verify_quick_s", ["verify", "--quick"]),
    ):
        ts = []
        for _ in range(1 if name == "verify_s" else 3):
            t0 = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-m", "actstore.cli", *cmd, str(store)], capture_output=True, text=True
            )
            ts.append(time.perf_counter() - t0)
            if r.returncode != 0:
                ts = [float("nan")]
                break
        out[name] = round(statistics.median(ts), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("n", type=int)
    c.add_argument("path", type=Path)
    b = sub.add_parser("build")
    b.add_argument("corpus", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--segment-size", type=int, default=256)
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--json", default=None)
    b.add_argument("--stop-after", type=int, default=None, help="interrupt after this many segments")
    m = sub.add_parser("measure")
    m.add_argument("store", type=Path)
    m.add_argument("--json", default=None)
    cmp = sub.add_parser("compare", help="measure several stores one after the other, in one run")
    cmp.add_argument("stores", type=Path, nargs="+")
    cmp.add_argument("--json", default=None)
    sel = sub.add_parser("selective", help="the selective figures, several checkouts' code side by side")
    sel.add_argument("stores", type=Path, nargs="+")
    sel.add_argument("--checkout", type=Path, action="append", required=True, help="repeat: one per code")
    sel.add_argument("--rounds", type=int, default=3)
    sel.add_argument("--json", default=None)
    cm = sub.add_parser(
        "commands", help="verify, verify --quick, info: several checkouts, and the read floor"
    )
    cm.add_argument("stores", type=Path, nargs="+")
    cm.add_argument("--checkout", type=Path, action="append", required=True, help="repeat: one per code")
    cm.add_argument("--rounds", type=int, default=3)
    cm.add_argument("--only", default="verify,quick,info", help="some of verify, quick, info")
    cm.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.cmd == "corpus":
        corpus(a.n, a.path)
    elif a.cmd == "build":
        emit(
            {
                "corpus": str(a.corpus),
                **build(a.corpus, a.out, a.segment_size, a.batch_size, a.stop_after),
                **disk(a.out),
            },
            a.json,
        )
    elif a.cmd == "commands":
        emit(commands(a.stores, a.checkout, a.rounds, tuple(a.only.split(","))), a.json)
    elif a.cmd == "selective":
        emit(selective(a.stores, a.checkout, a.rounds), a.json)
    elif a.cmd == "compare":
        emit({str(p): measure(p) for p in a.stores}, a.json)
    else:
        emit({"store": str(a.store), **measure(a.store)}, a.json)


if __name__ == "__main__":
    main()
