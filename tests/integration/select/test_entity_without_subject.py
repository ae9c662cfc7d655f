"""``attn_entity`` of a prompt with no subject span is zero, next to rows that have one.

Found by mutation testing: every fixture prompt has a subject, so reading one source token (instead
of none) for a subject-less row went unnoticed.  The oracle is ``attn_head_token`` summed over the
subject's source tokens by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

import actstore


def test_attn_entity_is_zero_without_a_subject(store_factory: Callable[..., Path], tmp_path: Path) -> None:
    rows = [
        {"text": "The capital of France is", "subject": "France", "relation_id": "R1"},
        {"text": "A plain sentence with no entity", "relation_id": "R1"},
        {"text": "The mother tongue of Ada is", "subject": "Ada", "relation_id": "R2"},
    ]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = actstore.open(store_factory("llama", dataset=f"jsonl:{data}", limit=None))
    ex = store.sql(
        "SELECT example_id, subject_start, subject_end, n_tokens FROM examples ORDER BY example_id",
        format="pandas",
    )
    assert len(ex) == 3 and (ex.subject_start < 0).sum() == 1
    sel = store.select("example_id >= 0")
    entity = sel.features("attn_entity")
    per_token = sel.features("attn_head_token")  # [n, L, H, S, d]
    for i, r in ex.iterrows():
        if r.subject_start < 0:
            assert not np.any(entity[i]), "a row without a subject must have attn_entity 0"
        else:
            want = per_token[i][:, :, r.subject_start : r.subject_end].sum(2)
            np.testing.assert_allclose(entity[i], want, rtol=1e-5, atol=1e-6)
            assert np.abs(want).max() > 0
