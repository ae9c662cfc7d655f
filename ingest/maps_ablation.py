"""MAPS causal check: remove the heads MAPS finds for a relation and measure the accuracy drop.

For relation R, on its prompts in the store (greedy first token == first token of " " + object):

* ``none``            no ablation (the base accuracy);
* ``relation_heads``  the heads MAPS assigns to R removed: every head with phi_R >= threshold
  (default), or the ``top_m`` best heads with a non-zero score (the paper's setting: 30 for
  models with fewer than 300 heads);
* ``random_heads``    as many heads drawn uniformly from the other heads, ``random_draws`` times;
* on each control relation C: ``control_none`` and ``control_relation_heads`` (R's heads removed
  on C's prompts).  Controls are given, or chosen as in the paper: relations in the store whose
  own top heads (as many as R's) overlap R's by less than 15% and whose base accuracy is within
  0.2 of R's; at most ``max_controls``.

Removal is zero ablation (z_h = 0) or mean ablation (z_h = its mean over the store's rows),
at the last prompt position (the paper) or at every position.  The static scores come from the
store's weights (:mod:`query.maps`) on the relation's pairs: the store's own prompts (subject's
first token -> object's first token), or given pair files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.errors import ActstoreError
from actstore.store import Store
from ingest.first_mlp import first_mlp_transform
from ingest.interventions import InterventionRunner, RunItem, head_ablation, stored_head_means
from query.maps import (
    DEFAULT_K,
    IMPLEMENTS_THRESHOLD,
    MapsError,
    TokenPairs,
    VocabProjection,
    implementing_heads,
    static_scores,
    store_pairs,
    top_heads,
)


class AblationError(ActstoreError, ValueError):
    """The ablation cannot run as asked (one line)."""


@dataclass(frozen=True)
class AblationConfig:
    relation: str
    controls: tuple[str, ...] | None = None  # None: choose as the paper does
    k: int = DEFAULT_K
    threshold: float = IMPLEMENTS_THRESHOLD
    top_m: int | None = None  # None: the heads with score >= threshold
    heads: tuple[tuple[int, int], ...] | None = None  # explicit heads instead of MAPS's
    random_draws: int = 5
    seed: int = 0
    mode: str = "zero"
    all_positions: bool = False
    where: str | None = None
    batch_size: int = 32
    final_norm: bool = True
    first_mlp: bool = False  # static scores through the first MLP (the paper's code)
    max_controls: int = 3
    max_head_overlap: float = 0.15
    max_accuracy_gap: float = 0.2


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


ROW_SCHEMA = pa.schema([
    ("relation", pa.string()), ("evaluated", pa.string()), ("condition", pa.string()), ("draw", pa.int32()),
    ("n_heads", pa.int32()), ("heads", pa.string()), ("accuracy", pa.float64()), ("n_prompts", pa.int32()),
    ("mode", pa.string()), ("positions", pa.string()),
])


def relation_prompts(store: Store, where: str | None = None) -> dict[str, Prompts]:
    """The store's prompts with an object token, per relation, as token ids."""
    cond = f"AND ({where})" if where and where.strip() else ""
    t = store.sql(f"""
        SELECT e.example_id, e.relation_id, t.object_token_id AS target, t.top_token_id AS top,
               list(tk.token_id ORDER BY tk.position) AS ids
        FROM examples e JOIN targets t USING (example_id) JOIN tokens tk USING (example_id)
        WHERE t.object_token_id >= 0 {cond}
        GROUP BY ALL ORDER BY e.example_id""")
    out: dict[str, Prompts] = {}
    rel = np.asarray(t.column("relation_id").to_pylist())
    for name in sorted(set(rel.tolist())):
        m = rel == name
        sub = t.filter(pa.array(m))
        out[name] = Prompts(name, sub.column("example_id").to_numpy(), sub.column("ids").to_pylist(),
                            sub.column("target").to_numpy().astype(np.int64), sub.column("top").to_numpy())
    return out


def pairs_from_store(store: Store, relation: str, where: str | None = None) -> TokenPairs:
    """Distinct (subject first token, object first token) pairs of a relation's stored prompts."""
    rel = relation.replace("'", "''")
    w = f"e.relation_id = '{rel}'" + (f" AND ({where})" if where and where.strip() else "")
    t = store_pairs(store, w)
    if t.num_rows == 0:
        raise AblationError(f"relation {relation!r} has no prompts with a subject and an object in {store.url}")
    pairs = np.unique(np.stack([t.column("src_id").to_numpy(), t.column("dst_id").to_numpy()], 1), axis=0)
    return TokenPairs(relation, pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64), int(pairs.shape[0]), 0, 0)


def _fmt(heads: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{layer}.{h}" for layer, h in heads)


def run_ablation(runner: InterventionRunner, store: Store, cfg: AblationConfig, *,
                 pairs: dict[str, TokenPairs] | None = None,
                 log: Callable[[str], None] = lambda m: None) -> AblationResult:
    """Run the experiment of the module docstring."""
    if cfg.mode not in ("zero", "mean"):
        raise AblationError(f"--mode must be zero or mean, not {cfg.mode!r}")
    if cfg.random_draws < 0:
        raise AblationError("--random-draws must be >= 0")
    prompts = relation_prompts(store, cfg.where)
    if cfg.relation not in prompts:
        have = ", ".join(prompts) or "none"
        raise AblationError(f"relation {cfg.relation!r} has no prompts with an object in {store.url} (it holds: {have})")
    controls = list(cfg.controls or [])
    missing = [c for c in controls if c not in prompts]
    if missing:
        raise AblationError(f"control relation(s) {', '.join(missing)} have no prompts in {store.url}")
    g = store.geometry
    proj = VocabProjection(store, final_norm=cfg.final_norm,
                           first_mlp=first_mlp_transform(runner.model) if cfg.first_mlp else None)
    pairs = dict(pairs or {})
    # Static scores of R and of every relation that may serve as a control, in one pass over
    # the heads (each head's readout is the expensive part).
    needed = [cfg.relation] + (list(prompts) if cfg.controls is None and cfg.heads is None else controls)
    for rel in dict.fromkeys(needed):
        if rel not in pairs:
            try:
                pairs[rel] = pairs_from_store(store, rel, cfg.where)
            except AblationError:
                if rel == cfg.relation:
                    raise
    all_scores = static_scores(proj, [pairs[r] for r in dict.fromkeys(needed) if r in pairs], k_max=cfg.k)

    def scores_for(rel: str) -> np.ndarray:
        if rel not in all_scores:
            if rel not in pairs:
                pairs[rel] = pairs_from_store(store, rel, cfg.where)
            all_scores.update(static_scores(proj, [pairs[rel]], k_max=cfg.k))
        return all_scores[rel].score(cfg.k)

    score = scores_for(cfg.relation)
    if cfg.heads is not None:
        for layer, h in cfg.heads:
            proj.check_head(layer, h)
        heads = list(cfg.heads)
    elif cfg.top_m is not None:
        heads = top_heads(score, cfg.top_m)
    else:
        heads = implementing_heads(score, cfg.threshold)
    positions: tuple[int, ...] | None = None if cfg.all_positions else (-1,)
    means = stored_head_means(store, cfg.where) if cfg.mode == "mean" else None
    pos_name = "all" if cfg.all_positions else "last"
    res = AblationResult(cfg.relation, heads)

    def accuracy(rel: str, hs: Sequence[tuple[int, int]]) -> float:
        p = prompts[rel]
        shared = head_ablation(hs, mode=cfg.mode, means=means, positions=positions) if hs else []
        return runner.run(p.items(), shared=shared, batch_size=cfg.batch_size).accuracy(p.targets)

    def add(evaluated: str, condition: str, draw: int, hs: Sequence[tuple[int, int]], acc: float) -> None:
        res.rows.append({"relation": cfg.relation, "evaluated": evaluated, "condition": condition, "draw": draw,
                         "n_heads": len(hs), "heads": _fmt(hs), "accuracy": acc,
                         "n_prompts": len(prompts[evaluated].targets), "mode": cfg.mode, "positions": pos_name})

    base = accuracy(cfg.relation, [])
    add(cfg.relation, "none", 0, [], base)
    log(f"{cfg.relation}: base accuracy {base:.3f} on {len(prompts[cfg.relation].targets)} prompts; removing {len(heads)} heads")
    ablated = accuracy(cfg.relation, heads)
    add(cfg.relation, "relation_heads", 0, heads, ablated)
    rng = np.random.default_rng(cfg.seed)
    others = [(layer, h) for layer in range(g.n_layers) for h in range(g.n_heads) if (layer, h) not in set(heads)]
    random_accs: list[float] = []
    if heads:
        for d in range(cfg.random_draws):
            pick = rng.choice(len(others), size=min(len(heads), len(others)), replace=False)
            hs = sorted(others[i] for i in pick)
            acc = accuracy(cfg.relation, hs)
            random_accs.append(acc)
            add(cfg.relation, "random_heads", d, hs, acc)
    if cfg.controls is None and heads:
        controls = _choose_controls(cfg, prompts, heads, base, scores_for, accuracy, log)
    control_summary = []
    for c in controls:
        c_base = accuracy(c, [])
        c_abl = accuracy(c, heads) if heads else c_base
        add(c, "control_none", 0, [], c_base)
        add(c, "control_relation_heads", 0, heads, c_abl)
        control_summary.append({"relation": c, "base": c_base, "ablated": c_abl, "drop_pct": _drop(c_base, c_abl)})
    p = prompts[cfg.relation]
    res.summary = {
        "relation": cfg.relation, "n_prompts": len(p.targets), "n_heads": len(heads), "heads": _fmt(heads),
        "head_selection": "explicit" if cfg.heads is not None else (f"top {cfg.top_m}" if cfg.top_m is not None else
                                                                     f"score >= {cfg.threshold}"),
        "k": cfg.k, "mode": cfg.mode, "positions": pos_name, "first_mlp": cfg.first_mlp,
        "base": base, "store_base": float((p.store_top == p.targets).mean()),
        "ablated": ablated, "drop_pct": _drop(base, ablated),
        "random_mean": float(np.mean(random_accs)) if random_accs else None,
        "random_std": float(np.std(random_accs)) if random_accs else None,
        "random_drop_pct": _drop(base, float(np.mean(random_accs))) if random_accs else None,
        "random_draws": len(random_accs), "controls": control_summary,
    }
    return res


def _choose_controls(cfg: AblationConfig, prompts: dict[str, Prompts], heads: list[tuple[int, int]], base: float,
                     scores_for: Callable[[str], np.ndarray], accuracy: Callable[[str, Sequence[tuple[int, int]]], float],
                     log: Callable[[str], None]) -> list[str]:
    chosen: list[str] = []
    for c in sorted(prompts):
        if c == cfg.relation or len(chosen) >= cfg.max_controls:
            continue
        try:
            c_heads = set(top_heads(scores_for(c), len(heads)))
        except (MapsError, AblationError):
            continue
        overlap = len(c_heads & set(heads)) / len(heads)
        if overlap >= cfg.max_head_overlap:
            log(f"control {c}: skipped, head overlap {overlap:.2f}")
            continue
        c_base = accuracy(c, [])
        if abs(c_base - base) >= cfg.max_accuracy_gap:
            log(f"control {c}: skipped, base accuracy {c_base:.2f} vs {base:.2f}")
            continue
        chosen.append(c)
    return chosen


def _drop(base: float, after: float) -> float | None:
    """Relative accuracy drop in percent (the paper's arrows); None when the base is 0."""
    return None if base <= 0 else 100.0 * (base - after) / base
