"""Run every benchmark in turn and print their results (``make bench`` runs ``--quick``).

Scripts that need a store get one shared store, ingested once here (SmolLM2-135M over
FewRel); bench_tracing ingests its own LRE store.  Each script runs in its own process
with ``OMP_NUM_THREADS=1`` (the machine is shared); a failing script is reported and the
others still run.  Exit status: non-zero if any script failed.

    python benchmarks/run.py [--quick] [--only bench_query,bench_codecs] [--out DIR]

``--out DIR`` also keeps each script's JSON result (``DIR/<script>.json``) and log.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def plan(quick: bool, store: str, out: str) -> list[tuple[str, list[str]]]:
    """(script, arguments) in the order they run; scripts that are absent are skipped."""
    q = ["--quick"] if quick else []

    def js(name: str) -> list[str]:
        return ["--json", os.path.join(out, f"{name}.json")]

    steps = [
        ("bench_ingest", [*q, *js("bench_ingest")]),
        ("bench_peers", [*q, *js("bench_peers")]),
        ("bench_query", [*q, "--store", store, *js("bench_query")]),
        ("bench_codecs", [*q, "--store", store, *js("bench_codecs")]),
        ("maps_static", [store]),
        ("bench_probe", [store, *q, *js("bench_probe")]),
        ("bench_tracing", [*q, *js("bench_tracing")]),
        (
            "crash_safety",
            ["--trials", "3" if quick else "20", "--json", os.path.join(out, "crash_safety.json")],
        ),
    ]
    return [(name, args) for name, args in steps if (HERE / f"{name}.py").exists()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every script's --quick mode (make bench)")
    ap.add_argument("--only", default=None, help="comma-separated script names to run")
    ap.add_argument(
        "--store-prompts",
        type=int,
        default=None,
        help="prompts in the shared store (192, 12 per relation, enough for 5-shot episodes with 5 queries; 512 full)",
    )
    ap.add_argument("--out", default=None, help="keep JSON results and logs here")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="actstore-bench-")
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    store = os.path.join(out, "store")
    steps = plan(args.quick, store, out)
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        steps = [s for s in steps if s[0] in keep]
    needs_store = any(store in a for _, a in steps)
    if needs_store and not os.path.exists(os.path.join(store, "manifest.json")):
        n = args.store_prompts or (192 if args.quick else 512)
        print(f"== shared store: ingesting {n} FewRel prompts into {store}", flush=True)
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); from benchmarks.bench_query import make_store; "
            "make_store(sys.argv[2], int(sys.argv[3]))"
        )
        subprocess.run([sys.executable, "-c", code, str(REPO), store, str(n)], check=True, env=env, cwd=REPO)
    summary: list[tuple[str, int, float]] = []
    for name, script_args in steps:
        cmd = [sys.executable, str(HERE / f"{name}.py"), *script_args]
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        with open(os.path.join(out, f"{name}.log"), "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                if "Loading weights" in line:  # transformers' progress bars
                    continue
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        summary.append((name, rc, time.perf_counter() - t0))
    print("\n== summary")
    for name, rc, secs in summary:
        print(f"{name:16s} {'ok' if rc == 0 else f'FAILED (exit {rc})':18s} {secs:7.0f} s")
    print(f"results and logs: {out}")
    sys.exit(1 if any(rc for _, rc, _ in summary) else 0)


if __name__ == "__main__":
    main()
