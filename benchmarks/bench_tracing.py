"""Causal-tracing throughput: incremental restorations against today's batched runner, side by side.

One run traces the same facts (same noise samples, same restorations) with each mode and reports
facts per minute, the positions x layers each computed (counted by hooks on every layer's attention
output projection and MLP down projection) and the FLOPs they make (those counts times the
attention's and the MLP's matmul FLOPs per position, plus the LM head of every restoration):

* ``incremental``  :class:`actstore.interventions.tracing.CausalTracer` default: each restoration reuses the corrupted
                   run (keys/values of the positions before it, the layer inputs below its window)
                   and runs only layers start..L-1 at positions p..T-1
* ``batched``      ``TraceConfig(incremental=False)`` with the shared
                   :class:`actstore.interventions.runner.InterventionRunner` (what ``actstore trace`` ran before
                   the incremental runner): ``--batch-size`` full corrupted copies per forward pass
* ``vectorised``   the same with :class:`actstore.interventions.tracing.GroupedEditRunner` (edits as one indexed write)
* ``loop``         the shared runner with ``batch_size=1``, one restoration per forward pass (first fact only)

Rounds are interleaved (the mode order alternates each round, so a load change on this shared machine
does not favour one mode); the best round of each mode is kept and every round's results are checked
against the batched runner's first (max abs difference of the restored probabilities).  Facts: the
first ``--facts`` facts the model answers correctly from a small known_1000 store (one per relation),
ingested into a temporary folder unless ``--store`` is given.

    python benchmarks/bench_tracing.py [--facts 3] [--samples 1] [--rounds 2] [--modes incremental,batched]
                                       [--model smollm2-135m] [--threads 1] [--profile] [--check64] [--json OUT]

``--quick``: 2 facts, 1 round.  Window 10, the three components (residual, MLP, attention) and every
position from the subject's first token on, as ``actstore trace`` runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KNOWN = (
    Path(os.environ.get("ACTSTORE_DATA") or REPO.parent / "shared" / "data")
    / "known_1000"
    / "known_1000.json"
)
MODES = ("incremental", "batched", "vectorised", "loop")


def make_store(model: str, folder: Path, per_relation: int) -> Path:
    out = folder / "store"
    cmd = [
        sys.executable,
        "-m",
        "actstore.cli",
        "ingest",
        "--model",
        model,
        "--dataset",
        f"known1000:{KNOWN}",
        "--limit-per-relation",
        str(per_relation),
        "--out",
        str(out),
        "--threads",
        "1",
        "--quiet",
    ]
    subprocess.run(cmd, check=True, cwd=REPO)
    return out


def max_diff(a: list[Any], b: list[Any]) -> float:
    import numpy as np

    return float(max(np.abs(x.restored[c] - y.restored[c]).max() for x, y in zip(a, b) for c in y.restored))


PROFILE_PARTS = {  # cProfile entries (built-in torch ops) -> report heading
    "linear": "matmuls (linear)",
    "scaled_dot_product_attention": "attention (sdpa)",
    "cat": "copies (cat)",
    "log_softmax": "log_softmax",
}


def profile(tracer: Any, facts: list[Any]) -> dict[str, Any]:
    """Seconds of one trace under cProfile and the share of the main torch ops in it (tottime)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    tracer.trace(facts)
    prof.disable()
    total = time.perf_counter() - t0
    stats: Any = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    parts = {v: 0.0 for v in PROFILE_PARTS.values()}
    for (_, _, name), (_, _, tottime, _, _) in stats.items():
        for key, heading in PROFILE_PARTS.items():
            if name in (f"<built-in method torch._C._nn.{key}>", f"<built-in method torch.{key}>"):
                parts[heading] += tottime
    parts["the rest"] = total - sum(parts.values())
    return {"seconds": total, "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 facts, 1 round.")
    ap.add_argument("--facts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1, help="Noise samples per fact.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--modes", default="incremental,batched", help=f"Comma-separated, from {', '.join(MODES)}."
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--store", default=None, help="Existing store of the model (default: ingest a small one)."
    )
    ap.add_argument("--per-relation", type=int, default=2, help="Prompts per relation in the ingested store.")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (part of the measurement).")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="After the timed rounds, trace the first fact once per mode under cProfile and report "
        "where the time goes (matmuls, attention, the rest).",
    )
    ap.add_argument(
        "--check64",
        action="store_true",
        help="Also trace the first fact in float64 (batched and incremental) and report each float32 "
        "mode's max |diff| from the float64 batched trace: float32's own rounding error.",
    )
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or "batched" not in modes:
        sys.exit(
            f"error: --modes takes {', '.join(MODES)} and must include batched (the reference), "
            f"not {args.modes!r}"
        )
    n_facts, rounds = (2, 1) if args.quick else (args.facts, args.rounds)

    import torch

    torch.set_num_threads(args.threads)
    import actstore
    from actstore.ingest.models.registry import load_model
    from actstore.interventions.runner import InterventionRunner
    from actstore.interventions.settings import TraceConfig
    from actstore.interventions.tracing import (
        CausalTracer,
        GroupedEditRunner,
        stored_facts,
        subject_embedding_std,
    )

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        path = Path(args.store) if args.store else make_store(args.model, Path(tmp), args.per_relation)
        store = actstore.open(str(path))
        where = (
            "example_id IN (SELECT min(example_id) FROM examples JOIN targets USING (example_id) "
            "WHERE object_rank = 0 GROUP BY relation_id)"
        )
        facts = stored_facts(store, where, limit=n_facts)
        if len(facts) < n_facts:
            facts = stored_facts(store, limit=n_facts)
        loaded = load_model(args.model)
        model = loaded.model
        std = 3 * subject_embedding_std(model, store)
    cfg = TraceConfig(samples=args.samples, window=10, batch_size=args.batch_size)
    shared = InterventionRunner(model)
    tracers = {
        "incremental": CausalTracer(shared, cfg, std),
        "batched": CausalTracer(shared, replace(cfg, incremental=False), std),
        "vectorised": CausalTracer(GroupedEditRunner(model), replace(cfg, incremental=False), std),
        "loop": CausalTracer(shared, replace(cfg, incremental=False, batch_size=1), std),
    }
    arch = shared.arch
    blocks = arch.blocks(model)
    count = {"attn": 0, "mlp": 0}

    def counter(kind: str) -> Any:
        def hook(module: Any, inputs: tuple[Any, ...], output: Any) -> None:
            count[kind] += int(inputs[0].shape[0] * inputs[0].shape[1])

        return hook

    handles = [m.register_forward_hook(counter("attn")) for m in blocks.out_proj]
    handles += [m.register_forward_hook(counter("mlp")) for m in blocks.down_proj]
    g = shared.geometry
    # FLOPs of one position through one layer's attention (q, k, v, o projections; the scores are
    # negligible at these lengths) and MLP, and of one restoration's LM head.
    n_mlp_mats = 3 if hasattr(blocks.layers[0].mlp, "gate_proj") else 2
    attn_flops = 2 * (2 * g.d_model * g.n_heads * g.d_head + 2 * g.d_model * g.n_kv_heads * g.d_head)
    mlp_flops = 2 * n_mlp_mats * g.d_model * g.d_mlp
    head_flops = 2 * g.vocab_size * g.d_model
    rows_per_fact = [tracers["batched"].rows_per_fact(f) for f in facts]

    tracers["incremental"].trace(facts[:1])  # warm-up (allocator, kernels)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    positions: dict[str, dict[str, int]] = {}
    results: dict[str, list[list[Any]]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            todo = facts[:1] if mode == "loop" else facts
            count.update(attn=0, mlp=0)
            t0 = time.perf_counter()
            results[mode].append(tracers[mode].trace(todo))
            seconds[mode].append(time.perf_counter() - t0)
            positions[mode] = dict(count)
    profiles = {m: profile(tracers[m], facts[:1]) for m in modes} if args.profile else {}
    ref = results["batched"][0]  # every round of every mode against the reference's first round
    diffs = {m: max(max_diff(ref[: len(out)], out) for out in results[m]) for m in modes}
    for h in handles:
        h.remove()
    check64: dict[str, float] = {}
    if args.check64:
        model.double()  # the tracers' runners hold the model: they now run it in float64
        truth = tracers["batched"].trace(facts[:1])
        inc64 = tracers["incremental"].trace(facts[:1])
        model.float()
        check64 = {
            "batched_float32_vs_float64": max_diff(truth, results["batched"][0][:1]),
            "incremental_float32_vs_float64": max_diff(truth, results["incremental"][0][:1])
            if "incremental" in results
            else float("nan"),
            "incremental_float64_vs_batched_float64": max_diff(truth, inc64),
        }
    load_after = os.getloadavg()

    def rate(n: int, s: float) -> float:
        return 60 * n / s

    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "threads": args.threads,
        "samples": args.samples,
        "window": 10,
        "batch_size": args.batch_size,
        "rounds": rounds,
        "facts": len(facts),
        "tokens_per_fact": [f.n_tokens for f in facts],
        "subject_spans": [list(f.subject_span) for f in facts],
        "restorations_per_fact": rows_per_fact,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }
    for mode in modes:
        n = 1 if mode == "loop" else len(facts)
        rows = rows_per_fact[0] if mode == "loop" else sum(rows_per_fact)
        pos = positions[mode]
        flops = pos["attn"] * attn_flops + pos["mlp"] * mlp_flops + rows * head_flops
        res[mode] = {
            "facts": n,
            "seconds": seconds[mode],
            "facts_per_minute": rate(n, min(seconds[mode])),
            "attn_positions_x_layers_per_fact": pos["attn"] / n,
            "mlp_positions_x_layers_per_fact": pos["mlp"] / n,
            "gflop_per_fact": flops / n / 1e9,
            "max_abs_diff_vs_batched": diffs[mode],
        }
    base = res["batched"]
    for mode in modes:
        if mode in profiles:
            res[mode]["profile_first_fact"] = profiles[mode]
        if mode != "batched":
            res[mode]["speedup_vs_batched"] = res[mode]["facts_per_minute"] / base["facts_per_minute"]
            res[mode]["flop_ratio_batched_over_this"] = base["gflop_per_fact"] / res[mode]["gflop_per_fact"]
    print(
        f"{args.model}, {len(facts)} facts ({', '.join(str(f.n_tokens) for f in facts)} tokens; "
        f"{sum(rows_per_fact) / len(rows_per_fact):.0f} restorations each: {args.samples} noise sample(s) x "
        f"(1 + 3 components x layers x positions)), window 10, {args.threads} thread(s), batch {args.batch_size}, "
        f"{rounds} interleaved round(s), best kept"
    )
    for mode in modes:
        m = res[mode]
        extra = (
            f"  max |diff| {m['max_abs_diff_vs_batched']:.1e}"
            if mode == "batched"
            else (
                f"  {m['speedup_vs_batched']:.2f}x faster, {m['flop_ratio_batched_over_this']:.2f}x fewer FLOPs, "
                f"max |diff| {m['max_abs_diff_vs_batched']:.1e}"
            )
        )
        print(
            f"  {mode:<11} {m['facts_per_minute']:7.2f} facts/min  {m['gflop_per_fact']:8.0f} GFLOP/fact  "
            f"{m['attn_positions_x_layers_per_fact']:7.0f} / {m['mlp_positions_x_layers_per_fact']:7.0f} "
            f"attn / mlp positions x layers/fact  "
            f"rounds {', '.join(f'{s:.1f}' for s in m['seconds'])} s{extra}"
        )
    if check64:
        res["float64_check_first_fact"] = check64
        print(
            "  first fact, max |diff| from the float64 batched trace: "
            + ", ".join(
                f"{k.replace('_vs_float64', '').replace('_vs_batched_float64', '')} {v:.1e}"
                for k, v in check64.items()
            )
        )
    for mode, prof in profiles.items():
        print(
            f"  profile {mode:<11} {prof['seconds']:.1f} s: "
            + ", ".join(f"{k} {100 * v / prof['seconds']:.0f}%" for k, v in prof["parts"].items())
        )
    print(f"  {res['uptime']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
