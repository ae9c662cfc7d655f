"""The Markdown tables ``actstore study tables`` and ``actstore study summary`` print (the tables of
docs/results-methods.md): those of a study's summary (``study run --out``: per method, by stratum, the
pairs, the cross-size row), those of a re-read (``study chance --out``: agreement against chance, the
key-layer variants, the within-relation null, the effect correlations, ROME's filter), and one table
across several re-reads, a column each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actstore.cli.methods import PAPER_CONSENSUS_TEXT, method_label

PCT_METRICS = {"consistency", "verdict_consistency", "beats_random"}
STUDY_METRICS = (
    "precision",
    "layer_precision",
    "consistency",
    "verdict_consistency",
    "located_effect",
    "random_effect",
    "effectiveness",
    "beats_random",
)
GROUPINGS = ("freq_band", "uniqueness", "source_set")


def is_reread(d: dict[str, Any]) -> bool:
    """Whether ``d`` is a re-read (``study chance --out``) rather than a study's summary."""
    return "rome_filter" in d


def _label(method: str, d: dict[str, Any]) -> str:
    """How the tables name a method: the tuned lens with its fitting rule, "tuned lens (adam)".  Outputs
    written before the rule was recorded come from the ridge fit (the only one the study had)."""
    tl = d.get("tuned_lens") or d.get("state", {}).get("tuned_lens") or {}
    return method_label(method, tl.get("method") or "ridge")


def _ci(r: dict[str, Any], pct: bool = False) -> str:
    def f(x: Any) -> str:
        if x is None or x != x:
            return "n/a"
        return f"{100 * x:.1f}%" if pct else f"{x:+.3f}" if abs(x) < 10 else f"{x:.0f}"

    if r.get("value") is None or r["value"] != r["value"]:
        return "n/a"
    if r.get("low") is None or r["low"] != r["low"]:
        return f(r["value"])
    return f"{f(r['value'])} [{f(r['low'])}, {f(r['high'])}]"


def _method_rows(d: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| method | facts | " + " | ".join(STUDY_METRICS) + " |",
        "|---" * (len(STUDY_METRICS) + 2) + "|",
    ]
    for m in d["readings"]:
        got = {r["metric"]: r for r in rows if r["method"] == m and r["grouping"] == "all"}
        n = max((r["n"] for r in got.values()), default=0)
        cells = []
        for k in STUDY_METRICS:
            if k not in got:
                cells.append("n/a")
            elif got[k]["n"] != n:
                cells.append(_ci(got[k], k in PCT_METRICS) + f" (n={got[k]['n']})")
            else:
                cells.append(_ci(got[k], k in PCT_METRICS))
        lines.append(f"| {_label(m, d)} | {n} | " + " | ".join(cells) + " |")
    return lines


def _group_rows(d: dict[str, Any], rows: list[dict[str, Any]], grouping: str, mode: str) -> list[str]:
    groups = sorted({r["group"] for r in rows if r["grouping"] == grouping})
    if not groups:
        return []
    lines = [f"\n#### By {grouping} ({mode})\n"]
    lines.append(
        "| method | " + " | ".join(f"{g}: n / precision / consistency / effectiveness" for g in groups) + " |"
    )
    lines.append("|---" * (len(groups) + 1) + "|")
    for m in d["readings"]:
        cells = []
        for g in groups:
            got = {
                r["metric"]: r
                for r in rows
                if r["method"] == m and r["grouping"] == grouping and r["group"] == g
            }
            n = got["precision"]["n"] if "precision" in got else 0
            figures = " / ".join(
                _ci(got[k], k == "consistency") if k in got else "n/a"
                for k in ("precision", "consistency", "effectiveness")
            )
            cells.append(f"{n} / {figures}")
        lines.append(f"| {_label(m, d)} | " + " | ".join(cells) + " |")
    return lines


def _table_head(title: str, columns: str) -> list[str]:
    """A table's title and header lines; ``columns``: its column names, ``|`` between them."""
    n = columns.count("|") + 1
    return [f"\n#### {title}\n", f"| {columns} |", "|" + "---|" * n]


def _by_pair(rows: list[dict[str, Any]], metric_prefix: str = "") -> dict[tuple[str, str], dict[str, Any]]:
    """(method a, method b) -> metric -> its row, of the rows whose metric starts with ``metric_prefix``."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if r["metric"].startswith(metric_prefix):
            out.setdefault((r["method_a"], r["method_b"]), {})[r["metric"]] = r
    return out


def _pair_rows(d: dict[str, Any], mode: str) -> list[str]:
    lines = _table_head(
        f"Pairs ({mode})",
        "methods | facts | key layer | ACL 2025 | exact | MLP/attn | ACL 2025 | effect r | ACL 2025",
    )
    pairs = _by_pair(d[mode]["pairs"])
    for (x, y), got in pairs.items():
        if x == "all":
            c = got["consensus"]
            lines.append(
                f"| all methods (consensus) | {c['n']} | {_ci(c, True)} | {PAPER_CONSENSUS_TEXT} | | | | | |"
            )
            continue

        def paper(k: str, pct: bool, got: dict[str, Any] = got) -> str:
            p = got.get(k, {}).get("paper")
            return "" if p is None else (f"{100 * p:.1f}%" if pct else f"{p:.2f}")

        effect = (
            f"{_ci(got['effect_correlation'])} (n={got['effect_correlation']['n']})"
            if "effect_correlation" in got
            else "n/a"
        )
        lines.append(
            f"| {_label(x, d)} vs {_label(y, d)} | {got['key_layer']['n']} | {_ci(got['key_layer'], True)} | "
            f"{paper('key_layer', True)} | {_ci(got['key_layer_exact'], True)} | "
            f"{_ci(got['verdict'], True)} (n={got['verdict']['n']}) | {paper('verdict', True)} | "
            f"{effect} | {paper('effect_correlation', False)} |"
        )
    return lines


def study_tables(d: dict[str, Any], groupings: Sequence[str] = GROUPINGS) -> str:
    """Markdown tables of a study's summary (``actstore study run --out``)."""
    lines: list[str] = []
    for mode in [m for m in ("knockout", "restore") if m in d]:
        rows = d[mode]["metrics"]
        lines.append(f"\n#### Per method, all facts ({mode}; run {d[mode]['run_id']})\n")
        lines += _method_rows(d, rows)
        for grouping in groupings:
            lines += _group_rows(d, rows, grouping, mode)
        lines += _pair_rows(d, mode)
    if d.get("cross_size"):
        lines.append("\n#### Cross-size row\n")
        lines.append("| model | metric | n | mean [95% CI] | IQR |")
        lines.append("|---|---|---|---|---|")
        for r in d["cross_size"]:
            q = "" if r["q25"] is None or r["q25"] != r["q25"] else f"{r['q25']:.2f}-{r['q75']:.2f}"
            lines.append(f"| {r['model']} | {r['metric']} | {r['n']} | {_ci(r)} | {q} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ re-reads


def _pct(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _pp(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:+.1f}"


def _r(x: Any) -> str:
    return "n/a" if x is None or x != x else f"{x:+.2f}"


def _excess(r: dict[str, Any]) -> str:
    return f"{_pp(r['excess'])} [{_pp(r['excess_low'])}, {_pp(r['excess_high'])}]"


def _kappa(r: dict[str, Any]) -> str:
    return f"{_r(r['kappa'])} [{_r(r['kappa_low'])}, {_r(r['kappa_high'])}]"


def _effect_rows(blk: dict[str, Any], subset: str, mode: str) -> list[str]:
    lines = _table_head(
        f"Effect correlations ({subset}, {mode})",
        "methods | raw r [95%] | relative r [95%] | log-odds r [95%] | partial r given p_clean [95%] | facts",
    )
    got = _by_pair(blk[mode]["pairs"], "effect_")
    for (x, y), m in got.items():
        cells = []
        for k in (
            "effect_correlation",
            "effect_correlation_relative",
            "effect_correlation_logodds",
            "effect_partial_correlation",
        ):
            r = m.get(k)
            cells.append("n/a" if r is None else f"{_r(r['value'])} [{_r(r['low'])}, {_r(r['high'])}]")
        lines.append(f"| {x} vs {y} | " + " | ".join(cells) + f" | {m['effect_correlation']['n']} |")
    return lines


def reread_tables(d: dict[str, Any]) -> str:
    """Markdown tables of a re-read (``actstore study chance --out``), both subsets."""
    lines: list[str] = []
    for subset in ("all", "rome"):
        blk = d[subset]
        null = blk["knockout"]["null_grouping"]
        lines.append(
            f"\n#### Agreement against chance ({subset}: {blk['n_facts']} facts; null within {null})\n"
        )
        lines.append(
            "| methods | metric | facts | observed | chance [95%] | null 95% | p | excess [95%] | kappa [95%] | pooled chance | ACL 2025 |"
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
                f"{_excess(r)} | {_kappa(r)} | {_pct(r['chance_pooled'])} | {seed} |"
            )
        lines.append(f"\n#### Key-layer variants ({subset})\n")
        lines.append("| methods | metric | facts | observed | chance | p | excess [95%] | kappa [95%] |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in blk["variants"]:
            lines.append(
                f"| {r['method_a']} vs {r['method_b']} | {r['metric']} | {r['n']} | {_pct(r['value'])} | "
                f"{_pct(r['chance'])} | {r['p_value']:.3f} | {_excess(r)} | {_kappa(r)} |"
            )
        lines.append(f"\n#### The same pairs against the within-relation null ({subset})\n")
        lines.append("| methods | metric | facts | observed | chance | p | excess [95%] |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in blk.get("relation_null", []):
            if r["n"]:
                lines.append(
                    f"| {r['method_a']} vs {r['method_b']} | {r['metric']} | {r['n']} | {_pct(r['value'])} | "
                    f"{_pct(r['chance'])} | {r['p_value']:.3f} | {_excess(r)} |"
                )
        lines.append(f"\nStrata of the null ({subset}): {blk.get('stratum_sizes')}")
        for mode in ("knockout", "restore"):
            if mode in blk:
                lines += _effect_rows(blk, subset, mode)
    rome = d["rome_filter"]
    lines.append(
        f"\nROME's filter (total effect > {rome['threshold']}): {rome['removed']} of {rome['facts']} facts removed, "
        f"per stratum: {rome['removed_per_stratum']}"
    )
    lines.append(f"\nKey layers: median {d['key_layer_median']}, distinct values {d['key_layer_distinct']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ summary

# The summary's rows: (section, method a, method b, metric); a pair is looked up in either order among
# the pairs of knock-out, then the variants; the effect rows read (mode, pair) from the effect metrics.
# The four pairs whose agreement the ACL 2025 study reports (its figures in the last column, "ACL 2025": the
# labels are those of the tables docs/results-methods.md quotes).
PAPER_PAIRS = "key layers, the ACL 2025 study's pairs"
SUMMARY_AGREEMENT = (
    (PAPER_PAIRS, "trace", "patch", "key_layer"),
    (PAPER_PAIRS, "trace", "probe", "key_layer"),
    (PAPER_PAIRS, "patch", "logit_lens", "key_layer"),
    (PAPER_PAIRS, "probe", "attention", "key_layer"),
    (PAPER_PAIRS, "all", "all", "consensus"),
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


def summary_table(outputs: Sequence[tuple[str, dict[str, Any]]], subset: str = "all") -> str:
    """One Markdown table across several re-reads (a column each, named by its label): the paper's
    pairs, the verdicts and the key-layer variants as ``observed / chance / excess [95%] / kappa
    (facts)``, then the effect correlations as ``raw / relative to p_clean / partial given p_clean``.
    A figure an output does not have (another model's variant, a method it did not read) is ``-``."""
    labels = [label for label, _ in outputs]
    lines = ["| figure | " + " | ".join(labels) + " | ACL 2025 |", "|---|" + "---|" * (len(labels) + 1)]
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
                f"{_pct(r['value'])} / {_pct(r['chance'])} / {_excess(r)} / {_r(r['kappa'])} ({r['n']})"
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
