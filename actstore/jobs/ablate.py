"""MAPS head ablation (``actstore ablate``): one settings object (:class:`AblateRequest`, in
:mod:`actstore.jobs.settings`) to its result tables and ``runs`` row."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from actstore.core.errors import InvalidSetting
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader, open_reader
from actstore.interventions.ablation import relation_prompts, run_ablation
from actstore.interventions.runner import InterventionRunner
from actstore.jobs.model import load_request_model
from actstore.jobs.record import record_run
from actstore.jobs.settings import AblateRequest
from actstore.query.maps.pairs import load_pair_files, tokenize_pairs
from actstore.query.maps.projection import parse_heads
from actstore.query.select.selection import Selection

Log = Callable[[str], None]
__all__ = ["AblateOutcome", "AblateRequest", "parse_heads_text", "run_ablate"]


@dataclass
class AblateOutcome:
    run_id: str
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    tables: list[str] = field(default_factory=list)


def run_ablate(store: StoreReader, req: AblateRequest, log: Log | None = None) -> AblateOutcome:
    """Accuracy on the relation's prompts with no ablation, with its MAPS heads removed, with as many
    random heads removed, and on control relations; the ``maps_ablation`` table and a ``runs`` row."""

    say = log or (lambda m: None)
    cfg = req.ablation
    started = time.time()
    g = store.geometry
    # checks the relation before the (slow) model load
    have = relation_prompts(store, Selection.from_sql(store, cfg.where))
    for r in (cfg.relation, *(cfg.controls or ())):
        if r not in have:
            raise InvalidSetting(
                "relation",
                f"{r!r} has no prompts with an object in {store.url} (it holds: {', '.join(have) or 'none'})",
            )
    other = None
    if req.scores_store is not None:
        other = open_reader(req.scores_store)
        mine, theirs = (str(x.manifest.model.get("weight_hash") or "") for x in (store, other))
        if not mine or mine != theirs or other.geometry != g:
            raise InvalidSetting(
                "scores_store", f"{other.url} holds another model's weights than {store.url}"
            )
    rels = []
    if req.pairs:
        rels = load_pair_files(list(req.pairs), [cfg.relation])  # the relation must have a pair file
        if cfg.controls is None:  # the candidate controls' pair files, where there are some
            rels += [
                rp
                for rp in load_pair_files(list(req.pairs))
                if rp.relation in have and rp.relation != cfg.relation
            ]
    model, loaded = load_request_model(store, req)
    # single-token pairs (the authors' filter); a relation below min_pairs is excluded by run_ablation
    pairs = {
        rp.relation: tokenize_pairs(
            rp,
            loaded.tokenizer,
            vocab_size=g.vocab_size,
            allow_empty=True,
            multi_token=cfg.multi_token,  # type: ignore[arg-type]
        )
        for rp in rels
    }
    res = run_ablation(InterventionRunner(loaded.model), store, cfg, pairs=pairs, scores_store=other, log=say)
    out = AblateOutcome(new_run_id("ablate"), res.summary, res.rows)
    if req.save:
        config: dict[str, Any] = asdict(cfg)
        config.update(first_mlp=res.summary["first_mlp"], k_per_relation={cfg.relation: res.summary["k"]})
        out.tables += record_run(
            store,
            "ablate",
            {
                **config,
                "model": model,
                "pairs": list(req.pairs),
                "scores_store": req.scores_store,
                "static_scores": res.summary["static_scores"],
                "control_choice": res.summary["control_choice"],
            },
            {"maps_ablation": res.table()},
            started=started,
            run_id=out.run_id,
        ).tables
    return out


def parse_heads_text(text: str | None, store: StoreReader) -> tuple[tuple[int, int], ...] | None:
    """``"12.3,7.*"`` -> the (layer, head) pairs of the store's model; None for None."""
    if not text:
        return None

    g = store.geometry
    heads = parse_heads(text, g.n_layers, g.n_heads)
    return tuple(heads) if heads else None
