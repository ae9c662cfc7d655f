"""The stored activation-patching tables against the results they are built from.

Every (component, layer, head, position) cell gets a distinct value, so a table that swaps
layers and heads, drops a position, mislabels a component or pairs a row with another fact's
ids cannot pass (mutmut found no test reading ``effects_table`` at all).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.interventions.patching import (
    PATCH_EFFECTS,
    PATCH_PAIRS,
    PatchPair,
    PatchResult,
    effects_table,
    pairs_table,
)

L, H = 3, 4


def fact(example_id: int, obj: str) -> Any:
    return SimpleNamespace(example_id=example_id, relation_id="P1", object=obj)


def result(clean: int, cf: int, rng: np.random.Generator) -> PatchResult:
    r = PatchResult(
        PatchPair(fact(clean, f"o{clean}"), fact(cf, f"o{cf}")),
        ld_clean=float(rng.normal()),
        ld_cf=float(rng.normal()),
    )
    for comp in ("resid", "mlp", "attn"):
        for pos in ("last", "subject_last"):
            r.recovery[comp, pos] = rng.normal(size=L)
    r.recovery["mlp", "last"][1] = np.nan  # a non-finite recovery is stored as it is
    for pos in ("last", "subject_last"):
        r.head_recovery[pos] = rng.normal(size=(L, H))
    return r


def test_effects_table_holds_every_cell_of_every_result_once() -> None:
    rng = np.random.default_rng(0)
    results = [result(10, 11, rng), result(12, 10, rng)]
    t = effects_table(results)
    assert t.schema == PATCH_EFFECTS
    expected: dict[tuple[int, int, str, int, int, str], float] = {}
    for r in results:
        ids = (r.pair.clean.example_id, r.pair.counterfactual.example_id)
        for (comp, pos), v in r.recovery.items():
            for layer in range(L):
                expected[(*ids, comp, layer, -1, pos)] = float(v[layer])
        for pos, grid in r.head_recovery.items():
            for layer in range(L):
                for h in range(H):
                    expected[(*ids, "head", layer, h, pos)] = float(grid[layer, h])
    rows = t.to_pylist()
    assert len(rows) == len(expected) == 2 * (3 * 2 * L + 2 * L * H)
    seen = {}
    for row in rows:
        key = (
            row["example_id"],
            row["counterfactual_id"],
            row["component"],
            row["layer"],
            row["head"],
            row["position"],
        )
        assert key not in seen, key
        seen[key] = row["recovery"]
    assert seen.keys() == expected.keys()
    for key, want in expected.items():
        got = seen[key]
        assert (np.isnan(want) and np.isnan(got)) or got == want, (key, got, want)


def test_pairs_table_names_each_pair_and_its_logit_differences() -> None:
    rng = np.random.default_rng(1)
    results = [result(10, 11, rng), result(12, 10, rng)]
    t = pairs_table(results)
    assert t.schema == PATCH_PAIRS
    assert t.to_pylist() == [
        {
            "example_id": r.pair.clean.example_id,
            "counterfactual_id": r.pair.counterfactual.example_id,
            "relation_id": "P1",
            "object": r.pair.clean.object,
            "counterfactual_object": r.pair.counterfactual.object,
            "ld_clean": r.ld_clean,
            "ld_counterfactual": r.ld_cf,
        }
        for r in results
    ]
    assert effects_table([]).num_rows == 0 and isinstance(effects_table([]), pa.Table)
