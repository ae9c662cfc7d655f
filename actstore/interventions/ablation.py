"""MAPS causal check: remove the heads MAPS finds for a relation and measure the accuracy drop.

For relation R, on its prompts in the store (greedy first token == first token of " " + object):

* ``none``            no ablation (the base accuracy);
* ``relation_heads``  the heads MAPS assigns to R removed: every head with phi_R >= threshold
  (default), or the ``top_m`` best heads with a non-zero score (the paper's setting: 30 for
  models with fewer than 300 heads);
* ``random_heads``    as many heads drawn uniformly from the other heads, ``random_draws`` times;
* on each control relation C: ``control_none`` and ``control_relation_heads`` (R's heads removed
  on C's prompts).  Controls are given, or chosen as in the paper (:func:`choose_controls`):
  relations in the store whose own top heads (as many as R's) overlap R's by less than 15% and
  whose base accuracy is above 0 and within 0.2 of R's, the closest in base accuracy first; at most
  ``max_controls``.  The screening uses the accuracy recorded at ingest (the greedy token in
  ``targets``, which the runner reproduces), so only the chosen controls are run; every
  candidate's overlap, base accuracy and decision are reported.

Removal is zero ablation (z_h = 0) or mean ablation (z_h = its mean over the store's rows),
at the last prompt position (the paper) or at every position.  The static scores are those of
:mod:`actstore.query.maps` on the relation's pairs: given pair files, or else the store's own prompts
(subject's first token -> object's first token).  As in the authors' code, by default each
relation is scored at its own k (:func:`actstore.query.maps.paper_k`: 1 for copying relations, 10 otherwise)
and through the first MLP (:func:`actstore.query.maps.paper_first_mlp`), and a relation whose pairs
(single-token pairs of its pair file, or the distinct pairs of its stored prompts) number fewer
than ``min_pairs`` (30, the authors' ``min_filtered_dataset_size``) takes no part: as R it is an
error, as a control candidate it is skipped with that reason.  They are read from a stored ``actstore maps``
run when one matches (same k, final-norm and first-MLP settings, multi-token policy, and the same
pair counts as the pair file gives here: :func:`actstore.query.maps.stored_static_scores`), which makes
the automatic control choice cheap; otherwise they are computed from the store's weights, all
missing relations in one pass over the heads.  The summary says which, per relation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import AblationError, MapsError
from actstore.core.store import StoreReader
from actstore.ingest.capture.first_mlp import first_mlp_transform
from actstore.interventions.runner import InterventionRunner, RunItem, head_ablation, stored_head_means
from actstore.query.maps.defaults import paper_first_mlp, paper_k
from actstore.query.maps.pairs import TokenPairs, store_pairs
from actstore.query.maps.projection import VocabProjection, check_head
from actstore.query.maps.settings import AblationConfig
from actstore.query.maps.static import implementing_heads, static_scores, stored_static_scores, top_heads
from actstore.query.select.rows import Rows, rows_condition
from actstore.query.select.selection import Selection


@dataclass
class Prompts:
    relation: str
    example_ids: np.ndarray
    input_ids: list[list[int]]
    targets: np.ndarray
    store_top: np.ndarray  # the greedy token recorded at ingest

    def items(self) -> list[RunItem]:
        return [RunItem(ids, target_id=int(t)) for ids, t in zip(self.input_ids, self.targets)]


@dataclass
class AblationResult:
    relation: str
    heads: list[tuple[int, int]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=ROW_SCHEMA)


ROW_SCHEMA = pa.schema(
    [
        ("relation", pa.string()),
        ("evaluated", pa.string()),
        ("condition", pa.string()),
        ("draw", pa.int32()),
        ("n_heads", pa.int32()),
        ("heads", pa.string()),
        ("accuracy", pa.float64()),
        ("n_prompts", pa.int32()),
        ("mode", pa.string()),
        ("positions", pa.string()),
    ]
)


def relation_prompts(store: StoreReader, rows: Rows | None = None) -> dict[str, Prompts]:
    """The store's prompts with an object token (those of ``rows``; all when None), per relation, as
    token ids."""
    rows_cond, params = rows_condition(rows, "e.example_id")
    cond = f"AND {rows_cond}"
    t = store.sql(
        f"""
        SELECT e.example_id, e.relation_id, t.object_token_id AS target, t.top_token_id AS top,
               list(tk.token_id ORDER BY tk.position) AS ids
        FROM examples e JOIN targets t USING (example_id) JOIN tokens tk USING (example_id)
        WHERE t.object_token_id >= 0 {cond}
        GROUP BY ALL ORDER BY e.example_id""",
        params or None,
    )
    out: dict[str, Prompts] = {}
    rel = np.asarray(t.column("relation_id").to_pylist())
    for name in sorted(set(rel.tolist())):
        m = rel == name
        sub = t.filter(pa.array(m))
        out[name] = Prompts(
            name,
            sub.column("example_id").to_numpy(),
            sub.column("ids").to_pylist(),
            sub.column("target").to_numpy().astype(np.int64),
            sub.column("top").to_numpy(),
        )
    return out


def pairs_from_store(store: StoreReader, relation: str, rows: Rows | None = None) -> TokenPairs:
    """Distinct (subject first token, object first token) pairs of a relation's stored prompts."""
    t = store_pairs(store, rows, relations=[relation])
    if t.num_rows == 0:
        raise AblationError(
            f"relation {relation!r} has no prompts with a subject and an object in {store.url}"
        )
    pairs = np.unique(np.stack([t.column("src_id").to_numpy(), t.column("dst_id").to_numpy()], 1), axis=0)
    return TokenPairs(
        relation, pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64), int(pairs.shape[0]), 0, 0
    )


def _fmt(heads: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{layer}.{h}" for layer, h in heads)


def run_ablation(
    runner: InterventionRunner,
    store: StoreReader,
    cfg: AblationConfig,
    *,
    pairs: dict[str, TokenPairs] | None = None,
    scores_store: StoreReader | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> AblationResult:
    """Run the experiment of the module docstring.

    ``pairs``: token pairs per relation (from MAPS pair files); a relation without them is scored on the
    store's own prompts.  ``scores_store``: where to look for stored static scores (default: ``store``;
    another store of the same model also works, the caller checks that its weights are the same).
    """
    model_name = str(store.manifest.model.get("name") or "")
    if cfg.first_mlp is None:
        cfg = replace(cfg, first_mlp=paper_first_mlp(model_name))
    if cfg.random_draws < 0:
        raise AblationError("the number of random draws must be >= 0")
    rows = Selection.from_sql(store, cfg.where)
    prompts = relation_prompts(store, rows)
    if cfg.relation not in prompts:
        have = ", ".join(prompts) or "none"
        raise AblationError(
            f"relation {cfg.relation!r} has no prompts with an object in {store.url} (it holds: {have})"
        )
    controls = list(cfg.controls or [])
    missing = [c for c in controls if c not in prompts]
    if missing:
        raise AblationError(f"control relation(s) {', '.join(missing)} have no prompts in {store.url}")
    g = store.geometry
    auto = cfg.controls is None
    scorer = _Scorer(runner, store, cfg, dict(pairs or {}), scores_store, rows)
    # Static scores of R and, when controls are chosen here, of every other relation in the store: read from a
    # matching stored `maps` run where there is one, the rest computed in one pass over the heads.
    scorer.resolve(
        ([cfg.relation] if cfg.heads is None else [])
        + ([r for r in prompts if r != cfg.relation] if auto else [])
    )
    if cfg.heads is not None:
        for layer, h in cfg.heads:
            check_head(g, layer, h)
        heads = list(cfg.heads)
    else:
        score = scorer.score(cfg.relation)
        heads = (
            top_heads(score, cfg.top_m) if cfg.top_m is not None else implementing_heads(score, cfg.threshold)
        )
    positions: tuple[int, ...] | None = None if cfg.all_positions else (-1,)
    means = stored_head_means(rows) if cfg.mode == "mean" else None
    pos_name = "all" if cfg.all_positions else "last"
    res = AblationResult(cfg.relation, heads)

    def accuracy(rel: str, hs: Sequence[tuple[int, int]]) -> float:
        p = prompts[rel]
        shared = head_ablation(hs, mode=cfg.mode, means=means, positions=positions) if hs else []
        return runner.run(p.items(), shared=shared, batch_size=cfg.batch_size).accuracy(p.targets)

    def add(evaluated: str, condition: str, draw: int, hs: Sequence[tuple[int, int]], acc: float) -> None:
        res.rows.append(
            {
                "relation": cfg.relation,
                "evaluated": evaluated,
                "condition": condition,
                "draw": draw,
                "n_heads": len(hs),
                "heads": _fmt(hs),
                "accuracy": acc,
                "n_prompts": len(prompts[evaluated].targets),
                "mode": cfg.mode,
                "positions": pos_name,
            }
        )

    base = accuracy(cfg.relation, [])
    add(cfg.relation, "none", 0, [], base)
    log(
        f"{cfg.relation}: base accuracy {base:.3f} on {len(prompts[cfg.relation].targets)} prompts; removing {len(heads)} heads"
    )
    ablated = accuracy(cfg.relation, heads)
    add(cfg.relation, "relation_heads", 0, heads, ablated)
    rng = np.random.default_rng(cfg.seed)
    others = [
        (layer, h) for layer in range(g.n_layers) for h in range(g.n_heads) if (layer, h) not in set(heads)
    ]
    random_accs: list[float] = []
    if heads:
        for d in range(cfg.random_draws):
            pick = rng.choice(len(others), size=min(len(heads), len(others)), replace=False)
            hs = sorted(others[i] for i in pick)
            acc = accuracy(cfg.relation, hs)
            random_accs.append(acc)
            add(cfg.relation, "random_heads", d, hs, acc)
    choice: list[dict[str, Any]] = []
    if auto:
        if heads:
            choice = choose_controls(cfg, prompts, heads, scorer)
            controls = [c["relation"] for c in choice if c["chosen"]]
            for cand in choice:
                log(
                    f"control {cand['relation']}: {'chosen' if cand['chosen'] else 'skipped'}, {cand['reason']}"
                )
        else:
            log("no heads removed: no control relation chosen")
    control_summary = []
    for c in controls:
        c_base = accuracy(c, [])
        c_abl = accuracy(c, heads) if heads else c_base
        add(c, "control_none", 0, [], c_base)
        add(c, "control_relation_heads", 0, heads, c_abl)
        control_summary.append(
            {"relation": c, "base": c_base, "ablated": c_abl, "drop_pct": _drop(c_base, c_abl)}
        )
    p = prompts[cfg.relation]
    res.summary = {
        "relation": cfg.relation,
        "n_prompts": len(p.targets),
        "n_heads": len(heads),
        "heads": _fmt(heads),
        "head_selection": "explicit"
        if cfg.heads is not None
        else (f"top {cfg.top_m}" if cfg.top_m is not None else f"score >= {cfg.threshold}"),
        "k": scorer.k(cfg.relation),
        "k_policy": "given" if cfg.k is not None else "paper",
        "mode": cfg.mode,
        "positions": pos_name,
        "first_mlp": cfg.first_mlp,
        "base": base,
        "store_base": _store_base(p),
        "ablated": ablated,
        "drop_pct": _drop(base, ablated),
        "random_mean": float(np.mean(random_accs)) if random_accs else None,
        "random_std": float(np.std(random_accs)) if random_accs else None,
        "random_drop_pct": _drop(base, float(np.mean(random_accs))) if random_accs else None,
        "random_draws": len(random_accs),
        "controls": control_summary,
        "control_selection": (
            "given"
            if not auto
            else f"automatic: {cfg.relation}'s head overlap < {cfg.max_head_overlap} and base accuracy "
            f"(recorded at ingest) above {cfg.min_control_base} and within {cfg.max_accuracy_gap} of "
            f"{cfg.relation}'s, closest base "
            f"first, at most {cfg.max_controls}"
        ),
        "control_choice": choice,
        "static_scores": dict(scorer.source),
    }
    return res


def _store_base(p: Prompts) -> float:
    """Accuracy of the greedy token recorded at ingest (the runner reproduces it on the store's model)."""
    return float((p.store_top == p.targets).mean()) if p.targets.size else float("nan")


class _Scorer:
    """Static scores per relation at its k: from a stored ``maps`` run with the same settings and pair
    counts, or computed from the store's weights; ``source`` says which, per relation."""

    def __init__(
        self,
        runner: InterventionRunner,
        store: StoreReader,
        cfg: AblationConfig,
        pairs: dict[str, TokenPairs],
        scores_store: StoreReader | None,
        rows: Rows | None = None,
    ) -> None:
        self.runner, self.store, self.cfg, self.pairs, self.rows = runner, store, cfg, pairs, rows
        self.scores_store = store if scores_store is None else scores_store
        self.scores: dict[str, np.ndarray] = {}
        self.source: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.from_files = set(pairs)
        self.model_name = str(store.manifest.model.get("name") or "")
        self._proj: VocabProjection | None = None

    def k(self, rel: str) -> int:
        return int(self.cfg.k) if self.cfg.k is not None else paper_k(rel, self.model_name)

    def proj(self) -> VocabProjection:
        if self._proj is None:
            self._proj = VocabProjection(
                self.store,
                final_norm=self.cfg.final_norm,
                first_mlp=first_mlp_transform(self.runner.model) if self.cfg.first_mlp else None,
            )
        return self._proj

    def resolve(self, relations: Sequence[str]) -> None:
        todo = [r for r in dict.fromkeys(relations) if r not in self.scores and r not in self.errors]
        if not todo:
            return
        cfg = self.cfg
        stored = (
            stored_static_scores(
                self.scores_store,
                todo,
                k={r: self.k(r) for r in todo},
                final_norm=cfg.final_norm,
                first_mlp=bool(cfg.first_mlp),
                multi_token=cfg.multi_token,
            )
            if cfg.reuse_stored
            else {}
        )
        compute: list[TokenPairs] = []
        for rel in todo:
            tp = self.pairs.get(rel)
            if tp is None:
                try:
                    tp = self.pairs[rel] = pairs_from_store(self.store, rel, self.rows)
                except AblationError as e:
                    if rel == cfg.relation:
                        raise
                    self.errors[rel] = str(e)
                    continue
            if tp.n_used < max(cfg.min_pairs, 1):
                where = "in its pair file" if rel in self.from_files else "among its stored prompts"
                msg = (
                    f"relation {rel!r} has {tp.n_used} usable pairs {where} ({tp.n_pairs} in all), fewer than "
                    f"{cfg.min_pairs}: excluded, as in the authors' code"
                )
                if rel == cfg.relation:
                    raise AblationError(msg)
                self.errors[rel] = msg
                continue
            st = stored.get(rel)
            if rel in self.from_files and st is not None and st.same_pairs(tp):
                self.scores[rel] = st.score
                self.source[rel] = f"stored run {st.run_id}"
                continue
            compute.append(tp)
        if compute:
            ks = {tp.relation: self.k(tp.relation) for tp in compute}
            for rel, sc in static_scores(self.proj(), compute, k_max=max(ks.values())).items():
                self.scores[rel] = sc.score(ks[rel])
                src = (
                    "computed from its pair file"
                    if rel in self.from_files
                    else "computed from the store's prompts"
                )
                st = stored.get(rel)
                if st is not None:
                    src += f" (stored run {st.run_id} " + (
                        "has other pair counts)"
                        if rel in self.from_files
                        else "scored pair files, not these prompts)"
                    )
                self.source[rel] = src

    def score(self, rel: str) -> np.ndarray:
        self.resolve([rel])
        if rel not in self.scores:
            raise AblationError(self.errors.get(rel, f"no static scores for {rel!r}"))
        return self.scores[rel]


def choose_controls(
    cfg: AblationConfig, prompts: dict[str, Prompts], heads: Sequence[tuple[int, int]], scorer: _Scorer
) -> list[dict[str, Any]]:
    """Every other relation of the store as a control candidate, with the decision and its reason.

    A candidate C qualifies when its own top ``len(heads)`` heads (non-zero scores) share fewer than
    ``max_head_overlap`` of R's heads and its base accuracy recorded at ingest is above ``min_control_base``
    (0: else no drop can show) and within ``max_accuracy_gap`` of R's; of those, the ``max_controls`` closest in base accuracy are chosen (ties: lower overlap, name).
    """
    r_base = _store_base(prompts[cfg.relation])
    hs = set(heads)
    rows: list[dict[str, Any]] = []
    for c in sorted(prompts):
        if c == cfg.relation:
            continue
        c_base = _store_base(prompts[c])
        # rounded, so that a gap of exactly max_accuracy_gap (e.g. 18/60 - 6/60) is not below it by float error
        row: dict[str, Any] = {
            "relation": c,
            "store_base": c_base,
            "base_gap": round(abs(c_base - r_base), 9),
            "head_overlap": None,
            "shared_heads": "",
            "score_source": None,
            "chosen": False,
        }
        try:
            score = scorer.score(c)
        except (MapsError, AblationError) as e:
            rows.append({**row, "reason": f"no static scores ({e})"})
            continue
        shared = sorted(set(top_heads(score, len(heads))) & hs)
        overlap = len(shared) / len(heads)
        row.update(head_overlap=overlap, shared_heads=_fmt(shared), score_source=scorer.source.get(c))
        if overlap >= cfg.max_head_overlap:
            row["reason"] = f"head overlap {overlap:.2f} >= {cfg.max_head_overlap}"
        elif c_base <= cfg.min_control_base:
            row["reason"] = f"base accuracy {c_base:.2f} <= {cfg.min_control_base}: no drop to measure"
        elif row["base_gap"] >= cfg.max_accuracy_gap:
            row["reason"] = f"base accuracy {c_base:.2f} vs {r_base:.2f} (gap >= {cfg.max_accuracy_gap})"
        else:
            row["reason"] = f"head overlap {overlap:.2f}, base accuracy {c_base:.2f} vs {r_base:.2f}"
            row["eligible"] = True
        rows.append(row)
    eligible = sorted(
        (r for r in rows if r.pop("eligible", False)),
        key=lambda r: (r["base_gap"], r["head_overlap"], r["relation"]),
    )
    for i, r in enumerate(eligible):
        if i < cfg.max_controls:
            r["chosen"] = True
        else:
            r["reason"] += (
                f"; qualifies, but {cfg.max_controls} ranked before it (closer base accuracy, then lower overlap)"
            )
    return rows


def _drop(base: float, after: float) -> float | None:
    """Relative accuracy drop in percent (the paper's arrows); None when the base is 0."""
    return None if base <= 0 else 100.0 * (base - after) / base
