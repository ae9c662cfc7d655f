"""Target mode's segment tables: the ``examples``, ``tokens`` and ``targets`` rows of a segment of
prompts (corpus mode's are :func:`actstore.ingest.corpus_windows.segment_corpus_tables`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.tables import EXAMPLES, TARGETS, TOKENS
from actstore.ingest.records import TokenizedPrompt


def object_token_ids(tokenizer: Any, prompts: Sequence[TokenizedPrompt]) -> np.ndarray:
    """First token id of " " + object for each prompt of a segment (-1 without an object)."""
    objects = [p.record.object for p in prompts]
    out = np.full(len(prompts), -1, dtype=np.int64)
    idx = [i for i, o in enumerate(objects) if o]
    if idx:
        enc = tokenizer([" " + objects[i] for i in idx], add_special_tokens=False)["input_ids"]
        for i, ids in zip(idx, enc):
            if ids:
                out[i] = ids[0]
    return out


def segment_tables(
    seg: int,
    lo: int,
    prompts: Sequence[TokenizedPrompt],
    tokenizer: Any,
    preds: tuple[np.ndarray, np.ndarray, np.ndarray],
    object_ids: np.ndarray,
) -> dict[str, pa.Table]:
    """The examples, tokens and targets shards of one segment."""
    n = len(prompts)
    n_tok = np.array([p.target_position + 1 for p in prompts], dtype=np.int64)
    tok_start = np.concatenate([[0], np.cumsum(n_tok)[:-1]]).astype(np.int64)
    ids = np.arange(lo, lo + n, dtype=np.int64)

    def span(s: tuple[int, int] | None, i: int) -> int:
        return -1 if s is None else int(s[i])

    recs = [p.record for p in prompts]
    examples = pa.table(
        {
            "example_id": ids,
            "text": [r.text for r in recs],
            "relation_id": [r.relation_id for r in recs],
            "relation_name": [r.relation_name for r in recs],
            "subject": [r.subject for r in recs],
            "object": [r.object for r in recs],
            "split": [r.split for r in recs],
            "source": [r.source for r in recs],
            "subject_start": [span(p.subject_tokens, 0) for p in prompts],
            "subject_end": [span(p.subject_tokens, 1) for p in prompts],
            "object_start": [span(p.object_tokens, 0) for p in prompts],
            "object_end": [span(p.object_tokens, 1) for p in prompts],
            "n_tokens": n_tok.astype(np.int32),
            "segment": np.full(n, seg, dtype=np.int32),
            "tok_start": tok_start,
            "meta": [json.dumps(r.meta, sort_keys=True, default=str) for r in recs],
        },
        schema=EXAMPLES,
    )
    tok_rows: dict[str, list[Any]] = {k: [] for k in TOKENS.names}
    for eid, p in zip(ids.tolist(), prompts):
        n_p = p.target_position + 1
        pieces = tokenizer.convert_ids_to_tokens(p.input_ids[:n_p])
        for pos in range(n_p):
            cs, ce = p.offsets[pos]
            role = "other"
            if p.subject_tokens and p.subject_tokens[0] <= pos < p.subject_tokens[1]:
                role = "subject"
            elif p.object_tokens and p.object_tokens[0] <= pos < p.object_tokens[1]:
                role = "object"
            tok_rows["example_id"].append(eid)
            tok_rows["position"].append(pos)
            tok_rows["token_id"].append(p.input_ids[pos])
            tok_rows["token"].append(p.record.text[cs:ce] if ce > cs else str(pieces[pos]))
            tok_rows["role"].append(role)
            tok_rows["char_start"].append(cs)
            tok_rows["char_end"].append(ce)
    tokens = pa.table(tok_rows, schema=TOKENS)
    top, lp, rank = preds
    targets = pa.table(
        {
            "example_id": ids,
            "position": (n_tok - 1).astype(np.int32),
            "row": ids,
            "segment": np.full(n, seg, dtype=np.int32),
            "seg_row": np.arange(n, dtype=np.int32),
            "src_start": tok_start,
            "n_src": n_tok.astype(np.int32),
            "top_token_id": top,
            "top_token": [str(t) for t in tokenizer.convert_ids_to_tokens(top.tolist())],
            "object_token_id": object_ids.astype(np.int32),
            "object_logprob": lp,
            "object_rank": rank,
        },
        schema=TARGETS,
    )
    return {"examples": examples, "tokens": tokens, "targets": targets}
