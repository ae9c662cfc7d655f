"""How far methods agree: key layers within a tolerance, equal MLP-vs-attention verdicts, and the
per-fact tables of an agreement run.  Every key-layer, verdict and consensus figure comes with its
chance level under the within-stratum permutation null, the excess over it and Cohen's kappa
(:mod:`actstore.query.methods.chance`; the strata are the facts' methods2k strata, or relations,
or, with none given, all facts together)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.query.analyses.stats import pearson
from actstore.query.methods.chance import PERMUTATIONS, RESAMPLES, ChanceFigure, consensus_chance, pair_chance
from actstore.query.methods.readings import SEED_001, SEED_001_CONSENSUS, MethodReading, common_keys


def default_tolerance(n_layers: int) -> int:
    return max(1, round(n_layers / 10))


CHANCE_FIELDS = ("chance", "excess", "excess_low", "excess_high", "kappa", "p_value")


def _chance(prefix: str, f: ChanceFigure) -> dict[str, float | None]:
    return {
        f"{prefix}_{k}": (None if v != v else float(v)) for k, v in f.columns().items() if k in CHANCE_FIELDS
    }


def agreement(
    readings: Sequence[MethodReading],
    tolerance: int,
    strata: Mapping[int, str] | None = None,
    permutations: int = PERMUTATIONS,
    resamples: int = RESAMPLES,
) -> dict[str, Any]:
    """Pairwise key-layer / verdict agreement, profile correlation, and all-method consensus, each
    agreement with ``..._chance``, ``..._excess`` (and its interval), ``..._kappa`` and
    ``..._p_value`` against the permutation null within ``strata`` (example id -> label; None: all
    facts one stratum)."""
    by = {r.method: r for r in readings}
    pairs = []
    for a, b in itertools.combinations([r.method for r in readings], 2):
        ra, rb = by[a], by[b]
        common = np.intersect1d(ra.example_ids, rb.example_ids)
        ia, ib = np.searchsorted(ra.example_ids, common), np.searchsorted(rb.example_ids, common)
        ka, kb = ra.key_layer[ia], rb.key_layer[ib]
        ok = (ka >= 0) & (kb >= 0)
        va, vb = ra.verdict[ia], rb.verdict[ib]
        vok = (va != "") & (vb != "")
        corr = [pearson(ra.profile[i], rb.profile[j])[0] for i, j in zip(ia, ib)]
        corr_f = [c for c in corr if np.isfinite(c)]
        chance = pair_chance(ra, rb, tolerance, strata, permutations, resamples)
        seed = SEED_001.get((a, b)) or SEED_001.get((b, a))
        pairs.append(
            {
                "method_a": a,
                "method_b": b,
                "n_facts": int(ok.sum()),
                "key_layer_agreement": float((np.abs(ka - kb)[ok] <= tolerance).mean()) if ok.any() else None,
                "key_layer_exact": float((ka == kb)[ok].mean()) if ok.any() else None,
                "n_verdict": int(vok.sum()),
                "verdict_agreement": float((va == vb)[vok].mean()) if vok.any() else None,
                "profile_correlation": float(np.mean(corr_f)) if corr_f else None,
                **_chance("key_layer", chance["key_layer"]),
                **_chance("verdict", chance["verdict"]),
                "paper_key_layer": seed[0] / 100 if seed else None,
                "paper_verdict": seed[1] / 100 if seed else None,
                "paper_correlation": seed[2] if seed else None,
            }
        )
    _, keys = common_keys(readings)
    defined = (keys >= 0).all(axis=0)
    spread = keys.max(axis=0) - keys.min(axis=0) if keys.size else np.zeros(0)
    consensus = float((spread[defined] <= tolerance).mean()) if defined.any() else None
    return {
        "tolerance": tolerance,
        "methods": [r.method for r in readings],
        "pairs": pairs,
        "consensus": consensus,
        "consensus_facts": int(defined.sum()),
        **_chance("consensus", consensus_chance(readings, tolerance, strata, permutations, resamples)),
        "paper_consensus": SEED_001_CONSENSUS / 100,
    }


TABLE_CHANCE = tuple(f"{m}_{k}" for m in ("key_layer", "verdict") for k in CHANCE_FIELDS)
#: The columns of ``method_agreement`` that every row has (the chance columns follow: :data:`TABLE_CHANCE`).
PAIR_COLUMNS = (
    "method_a",
    "method_b",
    "n_facts",
    "key_layer_agreement",
    "key_layer_exact",
    "n_verdict",
    "verdict_agreement",
    "profile_correlation",
)


def agreement_table(result: dict[str, Any]) -> pa.Table:
    """One row per pair and one for the consensus (method_a = method_b = "all", its chance columns
    in the key_layer_* ones)."""
    rows = [{k: p[k] for k in (*PAIR_COLUMNS, *TABLE_CHANCE)} for p in result["pairs"]]
    rows.append(
        {
            "method_a": "all",
            "method_b": "all",
            "n_facts": result["consensus_facts"],
            "key_layer_agreement": result["consensus"],
            "key_layer_exact": None,
            "n_verdict": 0,
            "verdict_agreement": None,
            "profile_correlation": None,
            **{
                k: result.get(k.replace("key_layer", "consensus")) if k.startswith("key_layer") else None
                for k in TABLE_CHANCE
            },
        }
    )
    return pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("method_a", pa.string()),
                ("method_b", pa.string()),
                ("n_facts", pa.int32()),
                ("key_layer_agreement", pa.float64()),
                ("key_layer_exact", pa.float64()),
                ("n_verdict", pa.int32()),
                ("verdict_agreement", pa.float64()),
                ("profile_correlation", pa.float64()),
                *[(k, pa.float64()) for k in TABLE_CHANCE],
            ]
        ),
    )
