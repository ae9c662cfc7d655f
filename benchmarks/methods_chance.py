"""Re-read a finished method study with issue 36's definitions: agreement against chance, effects
relative to p_clean, key-layer variants, ROME's filter.  Reads the stored runs only (no tracing,
patching or intervention is run again):

    python benchmarks/methods_study.py restore G --from benchmarks/results/methods-gemma3-270m-s10 --state G.study.json
    python benchmarks/methods_chance.py G --state G.study.json --json OUT.json     # the readings and every figure
    python benchmarks/methods_chance.py --tables OUT.json                           # Markdown for results-methods.md

(``OUT.json.gz``: gzip-compressed.)  The Gemma-3-270M output of issue 36 is
``benchmarks/results/methods-gemma3-270m-s10/chance.json.gz`` (``--tuned adam``: the study's fit).

Readings as the study reads them (``query/methods/study.py::study_readings``; the tuned lens only
with ``--tuned``: the study's Adam fit takes ~11 minutes on 2 cores), the variants of
``query/methods/keys.py``, the metrics of ``query/methods/tables.py::compute_metrics`` (pairs with
their chance level, kappa and excess; effect correlations raw, relative, log-odds and partial) for
both intervention modes, on all traced facts and on the facts ROME's filter keeps
(``query/methods/study.py::rome_filter``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from methods_study import read_summary, write_summary  # noqa: E402  (the study's --json format)

BASE = ("trace", "patch", "probe", "attention", "logit_lens", "tuned_lens")
SEED_PAIRS = (("trace", "patch"), ("trace", "probe"), ("patch", "logit_lens"), ("probe", "attention"))
SUBSTITUTES = {  # variant -> the base method it stands in for
    "trace@centre": "trace",
    "patch@subject_last": "patch",
    "patch@last": "patch",
    "logit_lens@top10": "logit_lens",
    "logit_lens@half": "logit_lens",
    "tuned_lens@top10": "tuned_lens",  # (with --tuned corpus:STORE: the lens is a stored object)
    "tuned_lens@half": "tuned_lens",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(a: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    import numpy as np

    from actstore.api import open_store
    from actstore.query.analyses.corpus_lens import load_corpus_lens
    from actstore.query.analyses.lens_methods import CORPUS_PREFIX, check_tuned_method
    from actstore.query.methods.agreement import default_tolerance
    from actstore.query.methods.chance import (
        coded_chance,
        consensus_chance,
        group_codes,
        pair_chance,
    )
    from actstore.query.methods.keys import (
        lens_variant_readings,
        patch_position_readings,
        trace_centre_reading,
        trace_window,
        window_kernel,
    )
    from actstore.query.methods.metrics import subset_reading
    from actstore.query.methods.readings import COMPARISON_TRAIN, stored_outputs
    from actstore.query.methods.study import (
        rome_filter,
        store_strata,
        study_readings,
        trace_clean_probabilities,
        trace_total_effects,
    )
    from actstore.query.methods.tables import compute_metrics

    t0 = time.time()
    store = open_store(a.store)
    state = json.loads(Path(a.state).read_text())
    L = store.geometry.n_layers
    tol = default_tolerance(L)
    methods = [m for m in a.methods.split(",") if m] + (["tuned_lens"] if a.tuned else [])
    if "trace" not in methods or any(m not in BASE for m in methods):
        raise SystemExit(f"--methods: trace and any of {', '.join(BASE[1:-1])}")
    tcfg = COMPARISON_TRAIN
    corpus = bool(a.tuned) and a.tuned.startswith(CORPUS_PREFIX)
    if a.tuned:
        check_tuned_method(a.tuned)
    if a.tuned and not corpus and state.get("tuned_lens", {}).get("config"):
        c = state["tuned_lens"]["config"]
        tcfg = replace(COMPARISON_TRAIN, steps=c["steps"], batch=c["batch"], lr=c["lr"], seed=c["seed"])
    readings = study_readings(
        store, methods, state["trace_runs"], state["patch_runs"], tuned=a.tuned or "adam", tuned_config=tcfg
    )
    log(
        "readings: "
        + ", ".join(f"{m} {len(r.example_ids)}" for m, r in readings.items())
        + f" ({time.time() - t0:.0f}s)"
    )
    window = trace_window(store, state["trace_runs"])
    variants = {"trace@centre": trace_centre_reading(readings["trace"], window, L)}
    if "patch" in readings:
        variants.update(patch_position_readings(store, state["patch_runs"]))
    lenses = [m for m in ("logit_lens", "tuned_lens") if m in readings]
    # both lenses read the same facts (study_readings reads them from one StoredOutputs): read them once
    out = stored_outputs(store, readings[lenses[0]].example_ids) if lenses else None
    if out is not None and "logit_lens" in readings:
        variants.update(lens_variant_readings(store, out, readings["logit_lens"]))
    if out is not None and corpus and "tuned_lens" in readings:  # the same two keys through the translators
        lens = load_corpus_lens(a.tuned, store)
        variants.update(lens_variant_readings(store, out, readings["tuned_lens"], tuned=lens))
    if a.also_trace:  # another study's trace runs on the same store (another window), on this one's facts
        other = json.loads(Path(a.also_trace).read_text())["trace_runs"]
        w = trace_window(store, other)
        if w == window:
            raise SystemExit(f"--also-trace: its trace runs have this study's window ({w})")
        r = subset_reading(
            study_readings(store, ["trace"], other, [])["trace"], readings["trace"].example_ids
        )
        variants[f"trace@w{w}"] = replace(r, method=f"trace@w{w}")
    log(f"variants ({time.time() - t0:.0f}s)")
    ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    strata = store_strata(store, ids)
    te = trace_total_effects(store, state["trace_runs"])
    p_clean = trace_clean_probabilities(store, state["trace_runs"])
    rome = rome_filter(te, strata.get("stratum", {}), a.threshold)
    effects = {
        mode: store.sql(
            "SELECT * EXCLUDE (run_id) FROM site_effects WHERE run_id = ?", [state[f"effects_{mode}_run"]]
        )
        for mode in ("knockout", "restore")
        if state.get(f"effects_{mode}_run")
    }
    null = strata.get("stratum")
    result: dict[str, Any] = {
        "model": store.manifest.model.get("name"),
        "n_layers": L,
        "tolerance": tol,
        "window": window,
        "permutations": a.permutations,
        "resamples": a.resamples,
        "readings": {m: int(len(r.example_ids)) for m, r in {**readings, **variants}.items()},
        "key_layer_median": {
            m: float(np.median(r.key_layer[r.key_layer >= 0])) for m, r in {**readings, **variants}.items()
        },
        "key_layer_distinct": {
            m: int(np.unique(r.key_layer[r.key_layer >= 0]).size) for m, r in {**readings, **variants}.items()
        },
        "tuned_lens": readings["tuned_lens"].info if "tuned_lens" in readings else None,
        "rome_filter": {
            "threshold": rome.threshold,
            "facts": int(len(te)),
            "removed": int(rome.removed.size),
            "removed_ids": rome.removed.tolist(),
            "removed_per_stratum": rome.removed_per_stratum,
            "strata": len(rome.facts_per_stratum),
        },
    }
    for subset, keep in (("all", ids), ("rome", rome.kept)):
        rs = {m: subset_reading(r, keep) for m, r in readings.items()}
        vs = {m: subset_reading(r, keep) for m, r in variants.items()}
        block: dict[str, Any] = {}
        for mode, eff in effects.items():
            res = compute_metrics(
                list(rs.values()), strata, tol, eff, a.resamples, p_clean=p_clean, permutations=a.permutations
            )
            block[mode] = {
                "pairs": res.pairs.to_pylist(),
                "null_grouping": res.null_grouping,
                "methods": [r for r in res.metrics.to_pylist() if r["grouping"] == "all"],
            }
            log(f"{subset} / {mode}: metrics ({time.time() - t0:.0f}s)")
        # variant pairs: each variant against every base method but its own, and variant against variant
        rows = []
        every = {**rs, **vs}
        names = list(every)
        for x, y in itertools.combinations(names, 2):
            if SUBSTITUTES.get(x, x) == SUBSTITUTES.get(y, y) or (x in rs and y in rs):
                continue
            ch = pair_chance(every[x], every[y], tol, null, a.permutations, a.resamples)
            for metric in ("key_layer", "key_layer_exact", "verdict"):
                rows.append({"method_a": x, "method_b": y, "metric": metric, **ch[metric].__dict__})
        # the trace window's reading: the other method's key inside the trace key's window
        tr = rs["trace"]
        kernel = window_kernel(window, L)
        for other in [m for m in every if SUBSTITUTES.get(m, m) != "trace"]:
            o = every[other]
            common = np.intersect1d(tr.example_ids, o.example_ids)
            kt, ko = (
                tr.key_layer[np.searchsorted(tr.example_ids, common)],
                o.key_layer[np.searchsorted(o.example_ids, common)],
            )
            ok = (kt >= 0) & (ko >= 0)
            groups = (
                group_codes([null.get(int(i), "") for i in common[ok]])
                if null
                else np.zeros(int(ok.sum()), np.int64)
            )
            f = coded_chance(kt[ok], ko[ok], groups, kernel, a.permutations, a.resamples)
            rows.append({"method_a": "trace", "method_b": other, "metric": "in_trace_window", **f.__dict__})
        # consensus with a variant in place of its method
        for v, base in SUBSTITUTES.items():
            if base not in rs:
                continue
            group = [vs[v] if m == base else r for m, r in rs.items()]
            f = consensus_chance(group, tol, null, a.permutations, a.resamples)
            rows.append(
                {"method_a": "all", "method_b": f"all, {v} for {base}", "metric": "consensus", **f.__dict__}
            )
        block["variants"] = rows
        # the same pairs against two other nulls: shuffles within relations, and over all facts
        # (the latter is kappa's p_e, in every row as chance_pooled)
        rel = strata.get("relation")
        block["relation_null"] = [
            {"method_a": x, "method_b": y, "metric": m, **f.__dict__}
            for x, y in itertools.combinations(list(rs), 2)
            for m, f in pair_chance(rs[x], rs[y], tol, rel, a.permutations, a.resamples).items()
        ] + [
            {
                "method_a": "all",
                "method_b": "all",
                "metric": "consensus",
                **consensus_chance(list(rs.values()), tol, rel, a.permutations, a.resamples).__dict__,
            }
        ]
        sizes = (
            np.bincount(group_codes([null.get(int(i), "") for i in keep])) if null else np.array([len(keep)])
        )
        block["stratum_sizes"] = {
            "strata": int(sizes.size),
            "single_fact_strata": int((sizes == 1).sum()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
        }
        block["n_facts"] = int(len(keep))
        result[subset] = block
    result["seconds"] = time.time() - t0
    return result


def _pct(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _pp(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:+.1f}"


def _r(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{x:+.2f}"


def tables(d: dict[str, Any]) -> str:
    lines: list[str] = []
    for subset in ("all", "rome"):
        blk = d[subset]
        lines.append(
            f"\n#### Agreement against chance ({subset}: {blk['n_facts']} facts; null within {blk['knockout']['null_grouping']})\n"
        )
        lines.append(
            "| methods | metric | facts | observed | chance [95%] | null 95% | p | excess [95%] | kappa [95%] | pooled chance | seed |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in blk["knockout"]["pairs"]:
            if r.get("chance") is None:
                continue
            seed = _pct(r["paper"]) if r.get("paper") is not None else ""
            lines.append(
                f"| {r['method_a']} vs {r['method_b']} | {r['metric']} | {r['n']} | {_pct(r['value'])} | "
                f"{_pct(r['chance'])} [{_pct(r['chance_low'])}, {_pct(r['chance_high'])}] | "
                f"{_pct(r['null_low'])}-{_pct(r['null_high'])} | {r['p_value']:.3f} | "
                f"{_pp(r['excess'])} [{_pp(r['excess_low'])}, {_pp(r['excess_high'])}] | "
                f"{_r(r['kappa'])} [{_r(r['kappa_low'])}, {_r(r['kappa_high'])}] | {_pct(r['chance_pooled'])} | {seed} |"
            )
        lines.append(f"\n#### Key-layer variants ({subset})\n")
        lines.append("| methods | metric | facts | observed | chance | p | excess [95%] | kappa [95%] |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in blk["variants"]:
            lines.append(
                f"| {r['method_a']} vs {r['method_b']} | {r['metric']} | {r['n']} | {_pct(r['value'])} | {_pct(r['chance'])} | "
                f"{r['p_value']:.3f} | {_pp(r['excess'])} [{_pp(r['excess_low'])}, {_pp(r['excess_high'])}] | "
                f"{_r(r['kappa'])} [{_r(r['kappa_low'])}, {_r(r['kappa_high'])}] |"
            )
        lines.append(f"\n#### The same pairs against the within-relation null ({subset})\n")
        lines.append("| methods | metric | facts | observed | chance | p | excess [95%] |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in blk.get("relation_null", []):
            if r["n"]:
                lines.append(
                    f"| {r['method_a']} vs {r['method_b']} | {r['metric']} | {r['n']} | {_pct(r['value'])} | "
                    f"{_pct(r['chance'])} | {r['p_value']:.3f} | {_pp(r['excess'])} [{_pp(r['excess_low'])}, {_pp(r['excess_high'])}] |"
                )
        lines.append(f"\nStrata of the null ({subset}): {blk.get('stratum_sizes')}")
        for mode in ("knockout", "restore"):
            if mode not in blk:
                continue
            lines.append(f"\n#### Effect correlations ({subset}, {mode})\n")
            lines.append(
                "| methods | raw r [95%] | relative r [95%] | log-odds r [95%] | partial r given p_clean [95%] | facts |"
            )
            lines.append("|---|---|---|---|---|---|")
            got: dict[tuple[str, str], dict[str, Any]] = {}
            for r in blk[mode]["pairs"]:
                if r["metric"].startswith("effect_"):
                    got.setdefault((r["method_a"], r["method_b"]), {})[r["metric"]] = r
            for (x, y), m in got.items():
                cells = []
                for k in (
                    "effect_correlation",
                    "effect_correlation_relative",
                    "effect_correlation_logodds",
                    "effect_partial_correlation",
                ):
                    r = m.get(k)
                    cells.append(
                        "n/a" if r is None else f"{_r(r['value'])} [{_r(r['low'])}, {_r(r['high'])}]"
                    )
                lines.append(f"| {x} vs {y} | " + " | ".join(cells) + f" | {m['effect_correlation']['n']} |")
    rome = d["rome_filter"]
    lines.append(
        f"\nROME's filter (total effect > {rome['threshold']}): {rome['removed']} of {rome['facts']} facts removed, "
        f"per stratum: {rome['removed_per_stratum']}"
    )
    lines.append(f"\nKey layers: median {d['key_layer_median']}, distinct values {d['key_layer_distinct']}")
    return "\n".join(lines)


# The summary's rows: (section, method a, method b, metric); a pair is looked up in either order among
# the pairs of knock-out, then the variants; the effect rows read (mode, pair) from the effect metrics.
SUMMARY_AGREEMENT = (
    ("key layers, the seed's pairs", "trace", "patch", "key_layer"),
    ("key layers, the seed's pairs", "trace", "probe", "key_layer"),
    ("key layers, the seed's pairs", "patch", "logit_lens", "key_layer"),
    ("key layers, the seed's pairs", "probe", "attention", "key_layer"),
    ("key layers, the seed's pairs", "all", "all", "consensus"),
    ("verdicts (MLP vs attention)", "trace", "patch", "verdict"),
    ("verdicts (MLP vs attention)", "probe", "attention", "verdict"),
    ("key-layer variants", "trace@centre", "patch", "key_layer"),
    ("key-layer variants", "trace", "patch@last", "key_layer"),
    ("key-layer variants", "trace", "patch@subject_last", "key_layer"),
    ("key-layer variants", "patch", "logit_lens@top10", "key_layer"),
    ("key-layer variants", "patch", "logit_lens@half", "key_layer"),
    ("key-layer variants", "patch@last", "logit_lens@half", "key_layer"),
    ("key-layer variants", "trace", "trace@w10", "key_layer"),
    ("key-layer variants", "trace", "trace@w1", "key_layer"),
    ("key-layer variants", "logit_lens", "tuned_lens", "key_layer"),
    ("key-layer variants", "logit_lens@top10", "tuned_lens@top10", "key_layer"),
)
SUMMARY_EFFECTS = (
    ("knockout", "trace", "patch"),
    ("knockout", "patch", "logit_lens"),
    ("knockout", "patch", "attention"),
    ("restore", "trace", "patch"),
    ("restore", "trace", "probe"),
    ("restore", "patch", "attention"),
)


def _find(rows: list[dict[str, Any]], a: str, b: str, metric: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["metric"] == metric and {r["method_a"], r["method_b"]} == {a, b}), None)


def summary(outputs: list[tuple[str, dict[str, Any]]], subset: str = "all") -> str:
    """One Markdown table across several ``--json`` outputs (a column each, named by its label): the
    seed's pairs, the verdicts and the key-layer variants as ``observed / chance / excess [95%] / kappa
    (facts)``, then the effect correlations as ``raw / relative to p_clean / partial given p_clean``.
    A figure an output does not have (another model's variant, a method it did not read) is ``-``."""
    labels = [label for label, _ in outputs]
    lines = [
        "| figure | " + " | ".join(labels) + " | seed |",
        "|---|" + "---|" * (len(labels) + 1),
    ]
    section = ""
    for sec, a, b, metric in SUMMARY_AGREEMENT:
        cells, seed = [], ""
        for _, d in outputs:
            blk = d[subset]
            r = _find(blk["knockout"]["pairs"], a, b, metric) or _find(blk["variants"], a, b, metric)
            if r is None or r.get("chance") is None or not r["n"]:
                cells.append("-")
                continue
            if r.get("paper") is not None:
                seed = _pct(r["paper"])
            cells.append(
                f"{_pct(r['value'])} / {_pct(r['chance'])} / {_pp(r['excess'])} [{_pp(r['excess_low'])}, "
                f"{_pp(r['excess_high'])}] / {_r(r['kappa'])} ({r['n']})"
            )
        if all(c == "-" for c in cells):
            continue
        if sec != section:
            lines.append(
                f"| **{sec}**: observed / chance / excess [95%] / kappa (facts) |" + " |" * (len(labels) + 1)
            )
            section = sec
        name = "consensus of all methods" if metric == "consensus" else f"{a} vs {b}"
        lines.append(
            f"| {name}{', verdict' if metric == 'verdict' else ''} | " + " | ".join(cells) + f" | {seed} |"
        )
    lines.append(
        "| **effect correlations**: raw r / relative to p_clean / partial given p_clean (facts) |"
        + " |" * (len(labels) + 1)
    )
    for mode, a, b in SUMMARY_EFFECTS:
        cells = []
        for _, d in outputs:
            rows = d[subset].get(mode, {}).get("pairs", [])
            got = [
                _find(rows, a, b, k)
                for k in ("effect_correlation", "effect_correlation_relative", "effect_partial_correlation")
            ]
            if got[0] is None or not got[0]["n"]:
                cells.append("-")
                continue
            cells.append(
                " / ".join("n/a" if g is None else _r(g["value"]) for g in got) + f" ({got[0]['n']})"
            )
        if any(c != "-" for c in cells):
            lines.append(f"| {a} vs {b}, {mode} | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", nargs="?")
    p.add_argument("--state", help="the study's state file (methods_study.py restore writes one)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--tables", help="print the Markdown tables of a --json output and stop")
    p.add_argument(
        "--summary",
        nargs="+",
        metavar="LABEL=JSON",
        help="print one table across several --json outputs (a column each) and stop",
    )
    p.add_argument("--subset", choices=("all", "rome"), default="all", help="--summary: all facts or ROME's")
    p.add_argument(
        "--methods", default="trace,patch,probe,attention,logit_lens", help="trace and any of these"
    )
    p.add_argument(
        "--tuned",
        default=None,
        help="also the tuned lens: adam or ridge (the study's fit on facts), or corpus:STORE[#RUN] (the "
        "translators an 'actstore corpus-lens' run stored; its @top10 and @half keys too)",
    )
    p.add_argument(
        "--also-trace",
        help="another study state on the same store whose trace runs have another window: read as "
        "the variant trace@wN, on this study's traced facts (window 1 against 10, say)",
    )
    p.add_argument("--threshold", type=float, default=0.0, help="ROME's filter: keep total effect above this")
    p.add_argument("--permutations", type=int, default=1000)
    p.add_argument("--resamples", type=int, default=2000)
    a = p.parse_args(argv)
    if a.tables:
        print(tables(read_summary(Path(a.tables))))
        return 0
    if a.summary:
        outputs = []
        for item in a.summary:
            label, sep, path = item.partition("=")
            if not sep or not label or not path:
                p.error(f"--summary takes LABEL=JSON, not {item!r}")
            outputs.append((label, read_summary(Path(path))))
        print(summary(outputs, a.subset))
        return 0
    if not a.store or not a.state:
        p.error("a store and --state are needed (or --tables)")
    d = run(a)
    if a.json:
        write_summary(Path(a.json), d)
        log(f"wrote {a.json}")
    print(tables(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
