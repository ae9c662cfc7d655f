"""Activation patching: clean activations into a counterfactual prompt, measured as logit-difference recovery.

A pair is a clean fact c (subject s, object o) and a counterfactual fact x of the *same relation*
with another subject s' and an object o' whose first token differs.  With LD(run) = logit(o) -
logit(o') at the last position (equal to the log-probability difference):

    LD_clean   on c's prompt          (positive when the model answers c correctly)
    LD_cf      on x's prompt          (negative when it answers x correctly)
    LD_patched on x's prompt with one clean activation of c written in
    recovery = (LD_patched - LD_cf) / (LD_clean - LD_cf)     1 = the clean answer fully restored

Patched sites, one forward pass each (many per batch):

    resid / attn / mlp, per layer l, at each named position: the output of layer l, of its
        attention block, of its MLP, taken from c at the position and written into x at the
        corresponding position;
    head (l, h) at the named head positions: the per-head input of the attention output
        projection z_h (the store's ``z``).

Named positions align the two prompts, which may differ in length: ``subject_last`` (the
subject's last token in each prompt) and ``last`` (the last token, where the model predicts).

Counterfactuals are chosen from the store's correctly answered facts of the same relation with a
different object first token, preferring the same prompt template, then the same number of
tokens and of subject tokens, then the nearest example id (:func:`choose_counterfactuals`); or
given explicitly, in which case a counterfactual of another relation is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import PatchError
from actstore.core.tables import rows_table
from actstore.interventions.facts import StoredFact
from actstore.interventions.runner import Intervention, InterventionRunner, RunItem
from actstore.interventions.settings import PatchConfig


@dataclass(frozen=True)
class PatchPair:
    clean: StoredFact
    counterfactual: StoredFact

    def check(self) -> None:
        c, x = self.clean, self.counterfactual
        c.check()
        x.check()
        if c.relation_id != x.relation_id:
            raise PatchError(
                f"counterfactual {x.example_id} is from relation {x.relation_id!r}, fact {c.example_id} "
                f"from {c.relation_id!r}: a counterfactual must come from the same relation"
            )
        if c.target_id == x.target_id:
            raise PatchError(
                f"counterfactual {x.example_id} has the same object token as fact {c.example_id} "
                f"({c.object!r} / {x.object!r}): the logit difference would be 0"
            )


def position_of(fact: StoredFact, name: str) -> int:
    return fact.subject_last if name == "subject_last" else fact.n_tokens - 1


def choose_counterfactuals(
    facts: Sequence[StoredFact], candidates: Sequence[StoredFact]
) -> tuple[list[PatchPair], list[dict[str, Any]]]:
    """A counterfactual for each fact among ``candidates`` (see the module docstring), and the facts
    left without one ({example_id, reason})."""
    by_rel: dict[str, list[StoredFact]] = {}
    for x in candidates:
        by_rel.setdefault(x.relation_id, []).append(x)
    pairs, skipped = [], []
    for c in facts:
        pool = [
            x
            for x in by_rel.get(c.relation_id, [])
            if x.target_id != c.target_id and x.example_id != c.example_id
        ]
        if not pool:
            skipped.append(
                {
                    "example_id": c.example_id,
                    "reason": f"no fact of relation {c.relation_id} with another object answered correctly",
                }
            )
            continue
        n_sub = c.subject_span[1] - c.subject_span[0]

        def score(x: StoredFact, c: StoredFact = c, n_sub: int = n_sub) -> tuple[int, int, int, int]:
            return (
                int(x.template != c.template),
                int(x.n_tokens != c.n_tokens),
                int(x.subject_span[1] - x.subject_span[0] != n_sub),
                abs(x.example_id - c.example_id),
            )

        pairs.append(PatchPair(c, min(pool, key=score)))
    return pairs, skipped


@dataclass
class PatchResult:
    pair: PatchPair
    ld_clean: float
    ld_cf: float
    recovery: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # (component, position) -> [L]
    head_recovery: dict[str, np.ndarray] = field(default_factory=dict)  # position -> [L, H]

    def to_json(self) -> dict[str, Any]:
        c, x = self.pair.clean, self.pair.counterfactual
        return {
            "example_id": c.example_id,
            "counterfactual_id": x.example_id,
            "relation_id": c.relation_id,
            "subject": c.subject,
            "object": c.object,
            "counterfactual_subject": x.subject,
            "counterfactual_object": x.object,
            "ld_clean": self.ld_clean,
            "ld_counterfactual": self.ld_cf,
            "recovery": {f"{comp}@{pos}": _round(v) for (comp, pos), v in self.recovery.items()},
            "head_recovery": {pos: _round(v) for pos, v in self.head_recovery.items()},
        }


def _round(x: np.ndarray) -> Any:
    return (
        [None if not np.isfinite(v) else round(float(v), 6) for v in x.ravel()]
        if x.ndim == 1
        else [_round(row) for row in x]
    )


PATCH_EFFECTS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("counterfactual_id", pa.int64()),
        ("component", pa.string()),
        ("layer", pa.int32()),
        ("head", pa.int32()),
        ("position", pa.string()),
        ("recovery", pa.float64()),
    ]
)
PATCH_PAIRS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("counterfactual_id", pa.int64()),
        ("relation_id", pa.string()),
        ("object", pa.string()),
        ("counterfactual_object", pa.string()),
        ("ld_clean", pa.float64()),
        ("ld_counterfactual", pa.float64()),
    ]
)


def effects_table(results: Sequence[PatchResult]) -> pa.Table:
    """One row per (pair, component, layer[, head], position); head = -1 for whole components."""
    rows = []
    for r in results:
        ids = (r.pair.clean.example_id, r.pair.counterfactual.example_id)
        for (comp, pos), v in r.recovery.items():
            rows += [(*ids, comp, layer, -1, pos, float(x)) for layer, x in enumerate(v)]
        for pos, grid in r.head_recovery.items():
            rows += [(*ids, "head", layer, h, pos, float(x)) for (layer, h), x in np.ndenumerate(grid)]
    return rows_table(rows, PATCH_EFFECTS)


def pairs_table(results: Sequence[PatchResult]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "example_id": r.pair.clean.example_id,
                "counterfactual_id": r.pair.counterfactual.example_id,
                "relation_id": r.pair.clean.relation_id,
                "object": r.pair.clean.object,
                "counterfactual_object": r.pair.counterfactual.object,
                "ld_clean": r.ld_clean,
                "ld_counterfactual": r.ld_cf,
            }
            for r in results
        ],
        schema=PATCH_PAIRS,
    )


_KEY = {
    "resid": lambda layer: ("resid", layer + 1),
    "mlp": lambda layer: ("mlp", layer),
    "attn": lambda layer: ("attn", layer),
    "head": lambda layer: ("head", layer),
}


@dataclass(frozen=True)
class _Site:
    pair: int
    component: str  # "" = the unpatched counterfactual
    layer: int
    head: int
    position: str


class ActivationPatcher:
    """Runs activation patching through an :class:`InterventionRunner` (see the module docstring)."""

    def __init__(self, runner: InterventionRunner, cfg: PatchConfig) -> None:
        self.runner = runner
        self.cfg = cfg
        g = runner.geometry
        self.n_layers, self.n_heads = g.n_layers, g.n_heads

    def patch(
        self, pairs: Sequence[PatchPair], progress: Callable[[int], None] | None = None
    ) -> list[PatchResult]:
        for p in pairs:
            p.check()
        out = []
        for p in pairs:  # one pair at a time: its clean states are held only while it runs
            out.append(self._patch_one(p))
            if progress:
                progress(1)
        return out

    def _record_keys(self) -> list[tuple[str, int]]:
        keys = {_KEY[c](layer) for c in self.cfg.components for layer in range(self.n_layers)}
        if self.cfg.heads:
            keys |= {("head", layer) for layer in range(self.n_layers)}
        return sorted(keys)

    def _patch_one(self, pair: PatchPair) -> PatchResult:
        c, x = pair.clean, pair.counterfactual
        keys = self._record_keys()
        rec = self.runner.run([RunItem(c.input_ids, target_id=c.target_id)], record=keys).records[0]
        dev = self.runner.device
        states = {k: rec[f"{k[0]}:{k[1]}"].to(dev) for k in keys}
        items: list[RunItem] = [RunItem(c.input_ids), RunItem(x.input_ids)]
        sites: list[_Site] = [_Site(0, "clean", -1, -1, ""), _Site(0, "", -1, -1, "")]
        for comp in self.cfg.components:
            for layer in range(self.n_layers):
                key = _KEY[comp](layer)
                for pos in self.cfg.positions:
                    value = states[key][position_of(c, pos)]
                    iv = Intervention(key[0], key[1], "set", (position_of(x, pos),), value=value)
                    items.append(RunItem(x.input_ids, (iv,)))
                    sites.append(_Site(0, comp, layer, -1, pos))
        if self.cfg.heads:
            for layer in range(self.n_layers):
                for pos in self.cfg.head_positions:
                    z = states[("head", layer)][position_of(c, pos)].view(self.n_heads, -1)
                    for h in range(self.n_heads):
                        iv = Intervention("head", layer, "set", (position_of(x, pos),), (h,), value=z[h])
                        items.append(RunItem(x.input_ids, (iv,)))
                        sites.append(_Site(0, "head", layer, h, pos))
        ld = self._logit_differences(items, c.target_id, x.target_id)
        ld_clean, ld_cf = float(ld[0]), float(ld[1])
        den = ld_clean - ld_cf
        rec_v = (ld - ld_cf) / den if abs(den) >= self.cfg.min_denominator else np.full_like(ld, np.nan)
        result = PatchResult(pair, ld_clean, ld_cf)
        for comp in self.cfg.components:
            for pos in self.cfg.positions:
                result.recovery[(comp, pos)] = np.full(self.n_layers, np.nan)
        if self.cfg.heads:
            for pos in self.cfg.head_positions:
                result.head_recovery[pos] = np.full((self.n_layers, self.n_heads), np.nan)
        for site, v in zip(sites[2:], rec_v[2:]):
            if site.component == "head":
                result.head_recovery[site.position][site.layer, site.head] = v
            else:
                result.recovery[(site.component, site.position)][site.layer] = v
        return result

    def _logit_differences(self, items: Sequence[RunItem], o: int, o_cf: int) -> np.ndarray:
        """logit(o) - logit(o_cf) at each item's last position, ``batch_size`` rows of logits at a time."""
        out = []
        step = self.cfg.batch_size
        for i in range(0, len(items), step):
            res = self.runner.run(items[i : i + step], batch_size=step, keep_logits=True)
            assert res.logits is not None
            lg = res.logits.to(torch.float64)
            out.append((lg[:, o] - lg[:, o_cf]).numpy())
        return np.concatenate(out)
