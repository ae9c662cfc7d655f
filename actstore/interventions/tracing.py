"""Causal tracing (Meng et al. 2022, "ROME"): corrupt the subject, restore clean states, measure.

For a fact (prompt, subject token span [s0, s1), object o = first token of " " + object):

    p_clean          P(o) on the clean prompt
    p_corrupt        mean over noise samples of P(o) when Gaussian noise of ``noise_std`` is
                     added to the input embeddings of the subject tokens (positions s0..s1-1)
    p_restored(c,l,p) mean over the same noise samples of P(o) on the corrupted prompt with the
                     clean state of component c restored at layer l and position p:
                       resid  the output of decoder layer l (the store's resid index l+1)
                       mlp    the MLP outputs of the layers in a window of ``window`` layers
                              centred on l: max(0, l - w//2) .. min(L, l + ceil(w/2)) - 1 (ROME's)
                       attn   the attention outputs of the same window
    total effect     TE = p_clean - p_corrupt
    indirect effect  IE(c,l,p) = p_restored(c,l,p) - p_corrupt

``noise_std`` is ``noise_scale`` (3 by default, as in ROME) times the standard deviation of the
input embeddings (the embedding module's output: Gemma's scale included) of the store's subject
tokens, see :func:`subject_embedding_std`.  Noise sample s of a fact is drawn from a generator
seeded with (seed, s), so the corrupted baseline and every restoration of that sample see the
same noise (ROME reseeds the same way).

Clean states come from a clean forward pass, not from the store: the store keeps the residual
stream, MLP and attention outputs at the target row (the prompt's last token) only, while tracing
restores every position.  The clean pass records them through the same hooks the edits use.

Incremental restorations (the default, ``TraceConfig.incremental``): a restoration at position p
whose first changed decoder layer is ``start`` (resid at layer l: l + 1; mlp and attn: the first
layer of the window) leaves every state at positions before p, and every state below ``start``,
as in the corrupted run.  The corrupted run of each (fact, noise sample) is computed once, keeping
the input of every layer and the attention's keys and values; each restoration then runs only
layers start..L-1 at positions p..T-1, from the corrupted input of layer ``start`` and with the
corrupted keys/values of positions < p as its past
(:class:`actstore.interventions.tracing_incremental.Incremental`).  The effects equal the
full recomputation (float rounding: about 1e-9 on the tiny models, 2e-6 on SmolLM2 in float32) at
about a third of its positions x layers on SmolLM2 (benchmarks/bench_tracing.py).

Full recomputation (``incremental=False``, the reference): every (component, layer, position,
sample) restoration is one row of a batch of corrupted copies (:class:`actstore.interventions.runner.RunItem`
carries its own edits), so one forward pass holds many restorations, of several facts.

Either way positions before the subject are not run: the noise cannot reach them under causal
attention, so their clean and corrupted states are equal and their indirect effect is exactly 0
(``skip_before_subject``; off runs them anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actstore.core.errors import InterventionError, TraceError
from actstore.interventions.facts import StoredFact, stored_facts, subject_embedding_std
from actstore.interventions.runner import Intervention, InterventionRunner, RunItem
from actstore.interventions.settings import TraceConfig
from actstore.interventions.trace_results import (
    STATE_KEY,
    TRACE_EFFECTS,
    TRACE_FACTS,
    CleanStates,
    TraceResult,
    effects_table,
    facts_table,
    window_layers,
)
from actstore.interventions.tracing_incremental import Incremental

__all__ = [
    "TRACE_EFFECTS",
    "TRACE_FACTS",
    "CausalTracer",
    "GroupedEditRunner",
    "StoredFact",
    "TraceError",
    "TraceResult",
    "effects_table",
    "facts_table",
    "stored_facts",
    "subject_embedding_std",
    "trace_facts",
    "window_layers",
]


# ------------------------------------------------------------------------------------ runner


class GroupedEditRunner(InterventionRunner):
    """The shared runner with the edits of one hook point applied in a few vectorised ops.

    Causal tracing puts thousands of one-position edits in a batch (a restoration per row, ten
    for a window); the base class applies them one by one (a few small kernels each, which
    dominates on a GPU).  Here the whole-component edits of a hook point that are ``set``,
    ``add`` or ``add_noise`` with a given value, each touching distinct (row, position) cells,
    become one ``index_put_`` per op.  Anything else (head edits, drawn noise, ``zero``/``mean``,
    overlapping cells) goes through the base class unchanged, so results are the same.
    """

    def _edit(self, key: tuple[str, int], x: torch.Tensor) -> torch.Tensor | None:
        edits = self._edits.get(key)
        if not edits or key[0] == "head" or not all(_groupable(e.iv, e.positions.numel()) for e in edits):
            return super()._edit(key, x)
        sizes = [e.positions.numel() for e in edits]
        rows = torch.as_tensor([e.row for e, n in zip(edits, sizes) for _ in range(n)], device=x.device)
        pos = torch.cat([e.positions for e in edits])
        flat = rows * x.shape[1] + pos
        if torch.unique(flat).numel() != flat.numel():  # overlapping cells: in order, as the base class does
            return super()._edit(key, x)
        X = x.shape[-1]
        vals = torch.cat([_value(e.iv, n, X) for e, n in zip(edits, sizes)]).to(x.device, x.dtype)
        add = torch.as_tensor(
            [e.iv.op != "set" for e, n in zip(edits, sizes) for _ in range(n)], device=x.device
        )
        x = x.clone()
        x[rows, pos] = torch.where(add[:, None], x[rows, pos] + vals, vals)
        if key in self._record:
            self._recorded[key] = x.detach()
        return x


def _groupable(iv: Intervention, n: int) -> bool:
    v = iv.value
    return (
        iv.op in ("set", "add", "add_noise")
        and v is not None
        and (v.dim() == 1 or (v.dim() == 2 and v.shape[0] in (1, n)))
    )


def _value(iv: Intervention, n: int, width: int) -> torch.Tensor:
    assert iv.value is not None
    v = iv.value
    if v.shape[-1] != width:
        raise InterventionError(
            f"{iv.op} value of shape {list(v.shape)} does not fit the edited {iv.component} "
            f"slice [{n}, {width}] at layer {iv.layer}"
        )
    return v.reshape(-1, width).expand(n, width)


# ------------------------------------------------------------------------------------ tracer


@dataclass(frozen=True)
class _Cell:
    fact: int  # index into the facts of the call
    component: str  # "" for the corrupted baseline
    layer: int
    position: int
    sample: int


class CausalTracer:
    """Runs causal traces through an :class:`InterventionRunner` (see the module docstring)."""

    def __init__(self, runner: InterventionRunner, cfg: TraceConfig, noise_std: float) -> None:
        cfg.validate(runner.geometry.n_layers)
        if not np.isfinite(noise_std) or noise_std < 0:
            raise TraceError(f"noise std must be finite and >= 0, not {noise_std}")
        self.runner = runner
        self.cfg = cfg
        self.noise_std = float(noise_std)
        self.n_layers = runner.geometry.n_layers
        self._noise_cache: dict[tuple[tuple[int, int], int], torch.Tensor] = {}

    # ------------------------------------------------------------------ public
    def trace(
        self, facts: Sequence[StoredFact], progress: Callable[[int], None] | None = None
    ) -> list[TraceResult]:
        """Trace every fact; facts are run together, ``max_rows_per_call`` restorations at a time."""
        for f in facts:
            f.check()
        out: list[TraceResult] = []
        group: list[StoredFact] = []
        rows = 0
        for f in facts:
            n = self.rows_per_fact(f)
            if group and rows + n > self.cfg.max_rows_per_call:
                out.extend(self._trace_group(group))
                if progress:
                    progress(len(group))
                group, rows = [], 0
            group.append(f)
            rows += n
        if group:
            out.extend(self._trace_group(group))
            if progress:
                progress(len(group))
        return out

    def rows_per_fact(self, fact: StoredFact) -> int:
        """Forward-pass rows one fact costs (restorations and corrupted baselines, all samples)."""
        return self.cfg.samples * (1 + len(self.cfg.components) * self.n_layers * len(self._positions(fact)))

    def noise(self, fact: StoredFact, sample: int) -> torch.Tensor:
        """Noise sample ``sample`` for the fact's subject embeddings: [n_subject, d_model]."""
        n = fact.subject_span[1] - fact.subject_span[0]
        gen = torch.Generator().manual_seed(int(self.cfg.seed) * 100_003 + sample)
        d = self.runner.geometry.d_model
        noise = torch.randn((n, d), generator=gen, dtype=torch.float32) * self.noise_std
        return noise.to(self.runner.device)

    def clean(self, facts: Sequence[StoredFact]) -> list[CleanStates]:
        """Clean probabilities of the object and every state restorations need, from one clean pass."""
        keys = sorted({STATE_KEY[c](layer) for c in self.cfg.components for layer in range(self.n_layers)})
        res = self.runner.run(
            [RunItem(f.input_ids, target_id=f.target_id) for f in facts],
            record=keys,
            batch_size=self.cfg.batch_size,
        )
        dev = self.runner.device  # restorations read them where the model runs
        return [
            CleanStates(float(np.exp(lp)), {k: rec[f"{k[0]}:{k[1]}"].to(dev) for k in keys})
            for lp, rec in zip(res.target_logprob, res.records)
        ]

    def restore(
        self,
        fact: StoredFact,
        clean: CleanStates,
        component: str,
        layer: int,
        position: int,
        sample: int | None,
    ) -> RunItem:
        """One corrupted copy of ``fact`` (noise ``sample``; None: no noise) with one restoration."""
        edits = [] if sample is None else [self._noise_edit(fact, sample)]
        layers = (
            [layer] if component == "resid" else list(window_layers(layer, self.cfg.window, self.n_layers))
        )
        for lay in layers:
            key = STATE_KEY[component](lay)
            edits.append(Intervention(key[0], key[1], "set", (position,), value=clean.states[key][position]))
        return RunItem(fact.input_ids, tuple(edits), fact.target_id)

    # ------------------------------------------------------------------ internals
    def _positions(self, fact: StoredFact) -> range:
        return range(fact.subject_span[0] if self.cfg.skip_before_subject else 0, fact.n_tokens)

    def _noise_edit(self, fact: StoredFact, sample: int) -> Intervention:
        key = (fact.subject_span, sample)
        if key not in self._noise_cache:
            self._noise_cache[key] = self.noise(fact, sample)
        s0, s1 = fact.subject_span
        return Intervention("resid", 0, "add_noise", tuple(range(s0, s1)), value=self._noise_cache[key])

    def _trace_group(self, facts: Sequence[StoredFact]) -> list[TraceResult]:
        if self.cfg.incremental:
            return self._trace_group_incremental(facts)
        return self._trace_group_full(facts)

    def _trace_group_full(self, facts: Sequence[StoredFact]) -> list[TraceResult]:
        """The reference: every restoration is a full forward pass of its corrupted prompt."""
        cleans = self.clean(facts)
        items: list[RunItem] = []
        cells: list[_Cell] = []
        for i, (f, cl) in enumerate(zip(facts, cleans)):
            for s in range(self.cfg.samples):
                items.append(RunItem(f.input_ids, (self._noise_edit(f, s),), f.target_id))
                cells.append(_Cell(i, "", -1, -1, s))
                for c in self.cfg.components:
                    for layer in range(self.n_layers):
                        for p in self._positions(f):
                            items.append(self.restore(f, cl, c, layer, p, s))
                            cells.append(_Cell(i, c, layer, p, s))
        probs = np.exp(
            self.runner.run(items, batch_size=self.cfg.batch_size).target_logprob.astype(np.float64)
        )
        S = self.cfg.samples
        low = np.zeros((len(facts), S))
        sums = [{c: np.zeros((self.n_layers, f.n_tokens)) for c in self.cfg.components} for f in facts]
        for cell, p in zip(cells, probs):
            if cell.component == "":
                low[cell.fact, cell.sample] = p
            else:
                sums[cell.fact][cell.component][cell.layer, cell.position] += p
        return self._results(facts, cleans, low, sums)

    # ------------------------------------------------------------------ incremental
    def _trace_group_incremental(self, facts: Sequence[StoredFact]) -> list[TraceResult]:
        """Restorations that reuse the corrupted run: see :class:`Incremental`."""
        cleans = self.clean(facts)
        inc = Incremental(self, facts, cleans)
        S = self.cfg.samples
        low = inc.corrupted.prob.reshape(len(facts), S)
        sums = [{c: np.zeros((self.n_layers, f.n_tokens)) for c in self.cfg.components} for f in facts]
        rows = inc.rows()
        probs = inc.run(rows)
        np.add.at(inc.grid_sums, (rows.fact, rows.comp, rows.layer, rows.position), probs)
        for i, f in enumerate(facts):
            for j, c in enumerate(self.cfg.components):
                sums[i][c] += inc.grid_sums[i, j, :, : f.n_tokens]
        return self._results(facts, cleans, low, sums)

    def _results(
        self,
        facts: Sequence[StoredFact],
        cleans: Sequence[CleanStates],
        low: np.ndarray,
        sums: list[dict[str, np.ndarray]],
    ) -> list[TraceResult]:
        S = self.cfg.samples
        out = []
        for i, (f, cl) in enumerate(zip(facts, cleans)):
            p_low = float(low[i].mean())
            restored = {}
            for c, grid in sums[i].items():
                grid = grid / S
                grid[:, : self._positions(f).start] = p_low  # unreachable by the noise: IE = 0 exactly
                restored[c] = grid
            out.append(TraceResult(f, cl.p, p_low, low[i].copy(), self.noise_std, restored))
        return out


def trace_facts(
    runner: InterventionRunner,
    facts: Sequence[StoredFact],
    cfg: TraceConfig,
    noise_std: float,
    progress: Callable[[int], None] | None = None,
) -> list[TraceResult]:
    """Convenience: :class:`CausalTracer` (cfg, noise_std) over ``facts``."""
    return CausalTracer(runner, cfg, noise_std).trace(facts, progress)
