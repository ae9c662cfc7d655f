"""Facts of a store, ready to trace or patch: a prompt's token ids, its subject's token span, the object token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actstore.core.errors import TraceError
from actstore.query.select.rows import Rows, rows_condition

# ------------------------------------------------------------------------------------ facts


@dataclass(frozen=True)
class StoredFact:
    """One fact of a store, ready to run: its prompt's token ids and the subject's token span."""

    example_id: int
    relation_id: str
    subject: str
    object: str
    input_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    subject_span: tuple[int, int]  # [start, end) token positions; (-1, -1) when absent
    target_id: int  # first token of " " + object (-1 without an object)
    correct: bool  # the model's greedy first token is the object's (targets.object_rank = 0)
    template: str = ""

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def subject_last(self) -> int:
        return self.subject_span[1] - 1

    def check(self) -> None:
        """Raise :class:`TraceError` when the fact cannot be traced or patched."""
        s0, s1 = self.subject_span
        if s0 < 0 or s1 <= s0 or s1 > self.n_tokens:
            raise TraceError(
                f"fact {self.example_id}: its subject {self.subject!r} is not in its prompt "
                f"({' '.join(self.tokens)!r}); tracing needs the subject's tokens"
            )
        if self.target_id < 0:
            raise TraceError(f"fact {self.example_id}: it has no object token to measure")


_FACTS_SQL = """
SELECT e.example_id, e.relation_id, e.subject, e.object, e.subject_start, e.subject_end, e.meta,
       t.object_token_id, t.object_rank,
       list(tk.token_id ORDER BY tk.position) AS ids, list(tk.token ORDER BY tk.position) AS toks
FROM examples e JOIN targets t USING (example_id) JOIN tokens tk USING (example_id)
WHERE {cond}
GROUP BY ALL ORDER BY e.example_id
"""


def stored_facts(
    store: Any,
    rows: Rows | None = None,
    *,
    correct_only: bool = True,
    limit: int | None = None,
    check: bool = True,
) -> list[StoredFact]:
    """Facts of ``store`` among ``rows`` (all when None), in example order.

    ``correct_only`` keeps the facts the model answers correctly (``object_rank = 0``).  ``check``
    raises on a selected fact whose subject is not in its prompt.
    """
    cond, params = rows_condition(rows, "e.example_id")
    conds = ["t.object_token_id >= 0", cond] + (["t.object_rank = 0"] if correct_only else [])
    found = store.sql(
        _FACTS_SQL.format(cond=" AND ".join(f"({c})" for c in conds)), params or None
    ).to_pylist()
    if limit is not None:
        found = found[:limit]
    out = []
    for r in found:
        meta = json.loads(r["meta"] or "{}")
        fact = StoredFact(
            example_id=int(r["example_id"]),
            relation_id=str(r["relation_id"]),
            subject=str(r["subject"]),
            object=str(r["object"]),
            input_ids=tuple(int(i) for i in r["ids"]),
            tokens=tuple(str(t) for t in r["toks"]),
            subject_span=(int(r["subject_start"]), int(r["subject_end"])),
            target_id=int(r["object_token_id"]),
            correct=int(r["object_rank"]) == 0,
            template=str(meta.get("template") or ""),
        )
        if check:
            fact.check()
        out.append(fact)
    return out


def subject_embedding_std(model: Any, store: Any, arch: Any = None) -> float:
    """Standard deviation (over all elements) of the input embeddings of the store's subject tokens.

    ROME's ``collect_embedding_std``: the embedding module's output, so Gemma's ``sqrt(d_model)``
    scale is included; for GPT-2 the token embedding without the position embedding.
    """
    ids = store.sql("SELECT token_id FROM tokens WHERE role = 'subject'").column("token_id").to_numpy()
    if ids.size == 0:
        raise TraceError(f"{store.url}: no subject tokens to estimate the embedding scale from")
    emb = arch.embedding(model) if arch is not None else model.get_input_embeddings()
    device = next(model.parameters()).device
    with torch.inference_mode():
        x = emb(torch.as_tensor(ids.astype(np.int64), device=device)).float()
    return float(x.std())
