"""Intervention effectiveness (the ACL 2025 comparison of methods for factual recall): intervene on a component at one layer and measure the
change in the object's probability, at the sites methods locate and at random layers.

A *site* is (component, layer) with component ``mlp`` or ``attn`` (the output of that block at
that decoder layer).  The intervention covers the prompt's positions from the subject's first
token to the last token (where tracing and patching find their effects), in one of two modes:

    knockout  the component's output is set to zero there; effect = P(o | clean) - P(o | knocked out)
              (positive: the site is needed for the recall)
    restore   the subject's input embeddings get Gaussian noise (as in causal tracing: ``samples``
              noise samples, std ``noise_scale`` x the store's subject-embedding std, sample s seeded
              as :meth:`actstore.interventions.tracing.CausalTracer.noise` does) and the component's
              clean output is written back there; effect = mean over samples of
              P(o | restored) - P(o | corrupted) (positive: the site carries the recall)

Restores are computed from the corrupted run by default (``EffectConfig.incremental``): a site at layer
l leaves layers below l and positions before the subject as in the corrupted run, so each restore
runs layers l..L-1 on the subject's first token onwards, from the corrupted run's input of layer l and
its cached keys and values (:class:`actstore.interventions.tracing_incremental.Incremental` with
``span``).  ``incremental=False`` runs every restore in full (the reference; equal up to float rounding).

Random sites: for each fact and component, ``random_draws`` distinct layers drawn uniformly from
all layers by a generator seeded with (seed, example id, component), the same for every method.
The result is one row per (fact, site, random or located) of the ``site_effects`` table
(:data:`SITE_EFFECTS`), which :func:`actstore.query.methods.metrics.effectiveness` reads.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import TraceError
from actstore.core.tables import rows_table
from actstore.interventions.facts import StoredFact, subject_embedding_std
from actstore.interventions.runner import Intervention, InterventionRunner, RunItem
from actstore.interventions.settings import TraceConfig, check_noise
from actstore.interventions.tracing_incremental import Incremental

if TYPE_CHECKING:
    from actstore.interventions.tracing import CausalTracer

MODES = ("knockout", "restore")
SITE_COMPONENTS = ("mlp", "attn")

SITE_EFFECTS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("mode", pa.string()),
        ("component", pa.string()),
        ("layer", pa.int32()),
        ("random", pa.bool_()),
        ("p_base", pa.float64()),
        ("p_intervened", pa.float64()),
        ("effect", pa.float64()),
    ]
)


@dataclass(frozen=True)
class EffectConfig:
    mode: str = "knockout"
    random_draws: int = 4  # random layers per fact and component
    seed: int = 0
    samples: int = 2  # noise samples (restore)
    noise_scale: float = 3.0  # noise std in multiples of the subject embeddings' std (restore)
    batch_size: int = 32
    incremental: bool = True  # restore: reuse the corrupted run (False: every restore a full forward pass)

    def validate(self, n_layers: int) -> None:
        if self.mode not in MODES:
            raise TraceError(f"unknown intervention mode {self.mode!r} (one of {', '.join(MODES)})")
        if self.random_draws < 1:
            raise TraceError(f"at least one random layer per fact is needed, not {self.random_draws}")
        check_noise(self.samples, self.noise_scale)


def random_layers(example_id: int, component: str, n_layers: int, draws: int, seed: int = 0) -> list[int]:
    """``draws`` distinct layers (all of them when ``draws >= n_layers``), sorted, from a generator
    seeded with (seed, example id, component)."""
    tag = zlib.crc32(component.encode())
    rng = np.random.default_rng([int(seed), int(example_id), tag])
    return sorted(int(x) for x in rng.choice(n_layers, size=min(draws, n_layers), replace=False))


@dataclass(frozen=True)
class _Row:
    fact: int
    component: str
    layer: int
    random: bool
    sample: int  # -1: no noise


def site_effects(
    runner: InterventionRunner,
    facts: Sequence[StoredFact],
    sites: Mapping[int, Iterable[tuple[str, int]]],
    cfg: EffectConfig,
    noise_std: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> pa.Table:
    """The ``site_effects`` rows of ``facts``: every located site of ``sites`` (example id -> (component,
    layer) pairs; facts without an entry get only random sites) and ``cfg.random_draws`` random layers
    per component.  ``noise_std`` is the absolute noise std (restore mode)."""
    L = runner.geometry.n_layers
    cfg.validate(L)
    if cfg.mode == "restore" and not (np.isfinite(noise_std) and noise_std > 0):
        raise TraceError(f"restoring needs a positive noise std, not {noise_std}")
    for f in facts:
        f.check()
    out: list[tuple[Any, ...]] = []
    tracer = None
    if cfg.mode == "restore":
        from actstore.interventions.tracing import CausalTracer

        tracer = CausalTracer(
            runner,
            TraceConfig(
                samples=cfg.samples,
                components=SITE_COMPONENTS,
                seed=cfg.seed,
                window=1,
                batch_size=cfg.batch_size,
            ),
            noise_std,
        )
    for f in facts:
        located = sorted({(str(c), int(layer)) for c, layer in sites.get(f.example_id, ())})
        for c, layer in located:
            if c not in SITE_COMPONENTS or not 0 <= layer < L:
                raise TraceError(
                    f"fact {f.example_id}: site {c}@{layer} is not an MLP or attention layer of 0..{L - 1}"
                )
        todo = [(c, layer, False) for c, layer in located] + [
            (c, layer, True)
            for c in SITE_COMPONENTS
            for layer in random_layers(f.example_id, c, L, cfg.random_draws, cfg.seed)
        ]
        if tracer is not None and cfg.incremental:
            base, p_site = _restore_incremental(tracer, f, sorted({(c, layer) for c, layer, _ in todo}))
            values = [(c, layer, rnd, p_site[(c, layer)]) for c, layer, rnd in todo]
        else:
            positions = tuple(range(f.subject_span[0], f.n_tokens))
            items: list[RunItem] = []
            rows: list[_Row] = []
            if tracer is None:
                items.append(RunItem(f.input_ids, (), f.target_id))
                rows.append(_Row(0, "", -1, False, -1))
                for c, layer, rnd in todo:
                    items.append(
                        RunItem(f.input_ids, (Intervention(c, layer, "zero", positions),), f.target_id)
                    )
                    rows.append(_Row(0, c, layer, rnd, -1))
            else:
                clean = tracer.clean([f])[0]
                s0, s1 = f.subject_span
                for s in range(cfg.samples):
                    noise = Intervention(
                        "resid", 0, "add_noise", tuple(range(s0, s1)), value=tracer.noise(f, s)
                    )
                    items.append(RunItem(f.input_ids, (noise,), f.target_id))
                    rows.append(_Row(0, "", -1, False, s))
                    for c, layer, rnd in todo:
                        value = clean.states[(c, layer)][s0:]
                        items.append(
                            RunItem(
                                f.input_ids,
                                (noise, Intervention(c, layer, "set", positions, value=value)),
                                f.target_id,
                            )
                        )
                        rows.append(_Row(0, c, layer, rnd, s))
            p = np.exp(runner.run(items, batch_size=cfg.batch_size).target_logprob.astype(np.float64))
            base = p[[i for i, r in enumerate(rows) if r.component == ""]].mean()
            sums: dict[tuple[str, int, bool], list[float]] = {}
            for r, v in zip(rows, p):
                if r.component:
                    sums.setdefault((r.component, r.layer, r.random), []).append(float(v))
            values = [(c, layer, rnd, float(np.mean(v))) for (c, layer, rnd), v in sums.items()]
        _append(out, f.example_id, cfg.mode, float(base), values)
        if progress:
            progress(1)
    return rows_table(out, SITE_EFFECTS)


def _append(
    out: list[tuple[Any, ...]],
    example_id: int,
    mode: str,
    base: float,
    sites: Iterable[tuple[str, int, bool, float]],
) -> None:
    """One ``site_effects`` row per (component, layer, random, P(o) intervened) of a fact."""
    for c, layer, rnd, pi in sites:
        out.append(
            (example_id, mode, c, layer, rnd, base, pi, base - pi if mode == "knockout" else pi - base)
        )


def _restore_incremental(
    tracer: CausalTracer, fact: StoredFact, sites: Sequence[tuple[str, int]]
) -> tuple[float, dict[tuple[str, int], float]]:
    """Restores of ``sites`` computed from the corrupted runs (see the module docstring): the mean
    corrupted P(o) over the noise samples and, per site, the mean restored P(o)."""

    inc = Incremental(tracer, [fact], tracer.clean([fact]), span=True)
    probs = inc.run(inc.site_rows(sites)).reshape(tracer.cfg.samples, len(sites)).mean(axis=0)
    return float(inc.corrupted.prob.mean()), {site: float(v) for site, v in zip(sites, probs)}


def sites_by_fact(site_lists: Iterable[Any]) -> dict[int, set[tuple[str, int]]]:
    """Union of located sites per fact over several methods' :class:`actstore.query.methods.metrics.Sites`."""
    out: dict[int, set[tuple[str, int]]] = {}
    for s in site_lists:
        for e, c, layer in zip(s.example_ids, s.component, s.layer):
            if c and layer >= 0:
                out.setdefault(int(e), set()).add((str(c), int(layer)))
    return out


def noise_std_for(model: Any, store: Any, runner: InterventionRunner, scale: float) -> float:
    """``scale`` x the standard deviation of the store's subject-token embeddings (as causal tracing)."""

    with torch.inference_mode():
        return float(scale) * subject_embedding_std(model, store, runner.arch)
