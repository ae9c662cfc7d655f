"""Intervention effects relative to the clean probability, and their correlation given it.

The raw effect of a knock-out is a drop in P(object); a site that removes most of the recall drops
P by about p_clean, whatever the site.  Two methods whose sites both remove most of it then
correlate across facts through p_clean alone (SmolLM2: patch vs logit lens r = +0.88 on raw drops,
+0.12 on drops over p_clean).  Each located-site effect of ``site_effects`` is therefore read in
three forms (ours; the ACL 2025 method study does not define its "effect correlation"):

    raw       the table's ``effect``: knock-out P(o | clean) - P(o | knocked out); restore
              P(o | restored) - P(o | corrupted)  (the form comparable with the ACL 2025 method study, kept)
    relative  effect / p_clean: the share of the clean probability the site removes (restores)
    logodds   the same change in log-odds, logit(p) = log p - log(1 - p), p clipped to
              [1e-12, 1 - 1e-12]: knock-out logit(P clean) - logit(P knocked out); restore
              logit(P restored) - logit(P corrupted).  With one object competing against the rest of
              the vocabulary this is the logit-difference form of patching's LD (restore: of the
              mean over noise samples of P, as the table stores it)

and between two methods, next to the Pearson r of each form, the partial correlation of the raw
effects given p_clean (``partial_correlation``): r of the residuals of both after a least-squares
line on p_clean, i.e. ``(r_ab - r_ac r_bc) / sqrt((1 - r_ac^2) (1 - r_bc^2))``.

p_clean per fact: given (from ``trace_facts``), or else the knock-out rows' ``p_base`` (which is
P(o | clean)); restore rows need it given.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from actstore.query.methods.metrics import RESAMPLES, Summary

FORMS = ("raw", "relative", "logodds")
CLIP = 1e-12


def logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(np.asarray(p, dtype=np.float64), CLIP, 1 - CLIP)
    return np.log(q) - np.log1p(-q)


def clean_probabilities(effects: pa.Table) -> dict[int, float]:
    """example id -> P(o | clean) from the knock-out rows of a ``site_effects`` table (empty when it
    has none)."""
    names = set(effects.column_names)
    if not {"mode", "p_base"} <= names:
        return {}
    d = effects.select(["example_id", "mode", "p_base"]).to_pydict()
    return {int(e): float(p) for e, m, p in zip(d["example_id"], d["mode"], d["p_base"]) if m == "knockout"}


def effect_forms(effects: pa.Table, p_clean: Mapping[int, float] | None = None) -> dict[str, pa.Table]:
    """The ``site_effects`` table in each form of :data:`FORMS` (``effect`` replaced; NaN where a form
    is undefined): ``raw`` always, ``relative`` where p_clean is known, ``logodds`` where the table
    has ``p_base``, ``p_intervened`` and ``mode``."""
    out = {"raw": effects}
    pc = dict(p_clean) if p_clean is not None else clean_probabilities(effects)
    ids = np.asarray(effects.column("example_id").to_pylist(), dtype=np.int64)
    effect = np.asarray(effects.column("effect").to_pylist(), dtype=np.float64)
    idx = effects.column_names.index("effect")
    if pc:
        clean = np.asarray([pc.get(int(i), np.nan) for i in ids], dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(clean > 0, effect / clean, np.nan)
        out["relative"] = effects.set_column(idx, "effect", pa.array(rel, pa.float64()))
    if {"p_base", "p_intervened", "mode"} <= set(effects.column_names):
        base = np.asarray(effects.column("p_base").to_pylist(), dtype=np.float64)
        inter = np.asarray(effects.column("p_intervened").to_pylist(), dtype=np.float64)
        sign = np.where(np.asarray(effects.column("mode").to_pylist(), dtype=object) == "knockout", -1.0, 1.0)
        lo = sign * (logit(inter) - logit(base))
        out["logodds"] = effects.set_column(idx, "effect", pa.array(lo, pa.float64()))
    return out


def _partial_r(a: np.ndarray, b: np.ndarray, c: np.ndarray, axis: int = -1) -> np.ndarray:
    def r(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x = x - x.mean(axis=axis, keepdims=True)
        y = y - y.mean(axis=axis, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(
                (x * y).sum(axis=axis) / np.sqrt((x * x).sum(axis=axis) * (y * y).sum(axis=axis))
            )

    rab, rac, rbc = r(a, b), r(a, c), r(b, c)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray((rab - rac * rbc) / np.sqrt((1 - rac**2) * (1 - rbc**2)))


def partial_correlation(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, resamples: int = RESAMPLES, seed: int = 0
) -> Summary:
    """Partial Pearson r of ``a`` and ``b`` given ``c`` over the facts where all three are finite,
    with a paired percentile bootstrap 95% interval (facts resampled ``resamples`` times, seeded);
    NaN with fewer than 4 facts or no spread."""
    a, b, c = (np.asarray(x, dtype=np.float64) for x in (a, b, c))
    m = np.isfinite(a) & np.isfinite(b) & np.isfinite(c)
    x, y, z = a[m], b[m], c[m]
    n = int(x.size)
    if n < 4:
        return Summary(n, float("nan"), float("nan"), float("nan"))
    value = float(_partial_r(x, y, z))
    if not np.isfinite(value):
        return Summary(n, value, float("nan"), float("nan"))
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = _partial_r(x[idx], y[idx], z[idx], axis=1)
    boot = boot[np.isfinite(boot)]
    lo, hi = (float(q) for q in np.percentile(boot, [2.5, 97.5])) if boot.size else (float("nan"),) * 2
    return Summary(n, value, lo, hi)
