"""Section ``section-tokenscore``: TokenScore over the prompt's tokens, for probe errors and correct predictions."""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from actstore.query.report.context import (
    READ_ERRORS,
    Block,
    Heading,
    Note,
    ReportContext,
    Section,
    TokenExample,
    TokenLegend,
    TokenSpan,
    log,
    missing,
    of_run,
    run_label,
)

POSITIVE_RGB = "214, 39, 40"
NEGATIVE_RGB = "31, 119, 180"

Key = tuple[Any, Any, Any]


def token_colour(v: float, lim: float) -> str:
    """Red for positive, blue for negative scores, opacity by |v| / lim."""
    a = 0.0 if lim <= 0 or not math.isfinite(v) else min(1.0, abs(v) / lim)
    rgb = POSITIVE_RGB if v > 0 else NEGATIVE_RGB
    return f"rgba({rgb}, {0.85 * a:.3f})"


def spread(items: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` items spread over the list (different relations and episodes, deterministic)."""
    if n <= 0 or not items:
        return []
    by_rel: dict[str, list[dict[str, Any]]] = {}
    for r in items:
        by_rel.setdefault(str(r.get("relation_id")), []).append(r)
    out: list[dict[str, Any]] = []
    queues = [list(v) for _, v in sorted(by_rel.items())]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def prompt_tokens(ctx: ReportContext, ids: list[int]) -> dict[int, list[str]]:
    """Each prompt's tokens as they appear in its text (by their character spans; a token that covers no
    text, a special token, as its token string)."""
    if not ids:
        return {}
    wanted = [int(i) for i in ids]
    rows = ctx.sql(
        "SELECT t.example_id, list(t.token ORDER BY t.position) AS toks, "
        "list(t.char_start ORDER BY t.position) AS cs, list(t.char_end ORDER BY t.position) AS ce, "
        "any_value(e.text) AS text FROM tokens t JOIN examples e USING (example_id) "
        "WHERE list_contains(?, t.example_id) GROUP BY 1",
        [wanted],
    ).to_pylist()
    out: dict[int, list[str]] = {}
    for r in rows:
        text = r["text"]
        words = []
        for tok, cs, ce in zip(r["toks"], r["cs"], r["ce"]):
            if text is not None and cs is not None and ce is not None and 0 <= cs < ce <= len(text):
                words.append(text[cs:ce])
            else:
                words.append(str(tok or "").replace("Ġ", " ").replace("▁", " "))
        out[int(r["example_id"])] = words
    return out


def _key(r: dict[str, Any]) -> Key:
    return (r.get("seed"), r.get("episode"), r.get("example_id"))


def prediction_probs(ctx: ReportContext, run: str, picked: list[dict[str, Any]]) -> dict[Key, float]:
    """The probe's probability of each picked prediction (empty when the run's predictions are not stored)."""
    if not ctx.has("probe_predictions") or not run or not picked:
        return {}
    try:
        t = ctx.store.table(
            "probe_predictions",
            files=ctx.run_file("probe_predictions", run) or ctx.files["probe_predictions"],
        )
    except READ_ERRORS as e:  # the probabilities only annotate the examples: show them without
        log.warning("report: probe_predictions of run %s cannot be read (%s)", run, e)
        return {}
    if missing(t, "seed", "episode", "example_id", "prob"):
        return {}
    t = of_run(t, run)
    wanted = pa.array([int(r["example_id"]) for r in picked], type=t.schema.field("example_id").type)
    t = t.filter(pc.is_in(t.column("example_id"), value_set=wanted))
    return {
        (r["seed"], r["episode"], r["example_id"]): float(r["prob"])
        for r in t.select(["seed", "episode", "example_id", "prob"]).to_pylist()
    }


def _example(r: dict[str, Any], words: list[str], has_pred: bool, probs: dict[Key, float]) -> TokenExample:
    scores = [float(x) for x in (r["scores"] or [])]
    lim = max((abs(x) for x in scores), default=0.0)
    spans = [
        TokenSpan(words[j] if j < len(words) else f"<{j}>", token_colour(s, lim), f"{s:+.4f}")
        for j, s in enumerate(scores)
    ]
    ok = has_pred and r["relation_id"] == r["predicted"]
    details = []
    if _key(r) in probs:
        details.append(f" (p={probs[_key(r)]:.3f})")
    if r.get("centering") is not None:
        details.append(f", centering {float(r['centering']):+.3f}")
    if r.get("head_score_total") is not None:
        details.append(f", total HeadScore {float(r['head_score_total']):+.3f}")
    return TokenExample(
        r["example_id"],
        "correct" if ok else "error" if has_pred else "",
        r["relation_id"] if has_pred else None,
        r["predicted"] if has_pred else None,
        details,
        spans,
    )


def tokenscore_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("token_scores")
    if t is None:
        return None
    miss = missing(t, "example_id", "scores")
    if miss:
        return Section("tokenscore", "TokenScore", [Note(f"token_scores lacks columns {miss}")])
    blocks: list[Block] = [
        Note(
            "TokenScore of each prompt token (summed over the probed layers): the contribution of that source "
            "token's attention-head outputs to the predicted relation's logit contrast. Red pushes towards the "
            "prediction, blue away from it; hover a token for its value. The centering term makes token "
            "scores plus centering add up to the prediction's total HeadScore."
        ),
        TokenLegend(negative=f"rgba({NEGATIVE_RGB}, 0.85)", positive=f"rgba({POSITIVE_RGB}, 0.85)"),
    ]
    for run in ctx.latest_runs(t)[:1]:
        recs = of_run(t, run).to_pylist()
        has_pred = "relation_id" in t.column_names and "predicted" in t.column_names
        errors = [r for r in recs if has_pred and r["relation_id"] != r["predicted"]]
        correct = [r for r in recs if has_pred and r["relation_id"] == r["predicted"]] if has_pred else recs
        picked = spread(errors, ctx.opts.token_errors) + spread(correct, ctx.opts.token_correct)
        if not picked:
            continue
        toks = prompt_tokens(ctx, sorted({int(r["example_id"]) for r in picked}))
        probs = prediction_probs(ctx, run, picked)
        blocks.append(
            Heading(
                f"{run_label(run)}: {len(errors)} errors and {len(correct)} correct predictions "
                f"with token scores; showing {len(picked)}"
            )
        )
        blocks += [_example(r, toks.get(int(r["example_id"]), []), has_pred, probs) for r in picked]
    return Section("tokenscore", "TokenScore over the prompt", blocks)
