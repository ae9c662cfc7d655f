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
corrupted keys/values of positions < p as its past (:class:`_Incremental`).  The effects equal the
full recomputation (float rounding: about 1e-9 on the tiny models, 2e-6 on SmolLM2 in float32) at
about a third of its positions x layers on SmolLM2 (benchmarks/bench_tracing.py).

Full recomputation (``incremental=False``, the reference): every (component, layer, position,
sample) restoration is one row of a batch of corrupted copies (:class:`ingest.interventions.RunItem`
carries its own edits), so one forward pass holds many restorations, of several facts.

Either way positions before the subject are not run: the noise cannot reach them under causal
attention, so their clean and corrupted states are equal and their indirect effect is exactly 0
(``skip_before_subject``; off runs them anyway).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.errors import ActstoreError
from ingest.interventions import Intervention, InterventionError, InterventionRunner, RunItem

COMPONENTS = ("resid", "mlp", "attn")


class TraceError(ActstoreError, ValueError):
    """Tracing cannot run as asked (one line)."""


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
            raise TraceError(f"fact {self.example_id}: its subject {self.subject!r} is not in its prompt "
                             f"({' '.join(self.tokens)!r}); tracing needs the subject's tokens")
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


def stored_facts(store: Any, where: str | None = None, *, correct_only: bool = True, limit: int | None = None,
                 example_ids: Sequence[int] | None = None, check: bool = True) -> list[StoredFact]:
    """Facts of ``store`` in example order.

    ``where``: a SQL predicate over ``examples JOIN targets USING (example_id)`` (so both
    ``relation_id = 'P17'`` and ``object_rank < 3`` work).  ``correct_only`` keeps the facts the
    model answers correctly (``object_rank = 0``).  ``check`` raises on a selected fact whose
    subject is not in its prompt.
    """
    conds = ["t.object_token_id >= 0"]
    if correct_only:
        conds.append("t.object_rank = 0")
    if where and where.strip():
        conds.append(f"e.example_id IN (SELECT example_id FROM examples JOIN targets USING (example_id) WHERE {where})")
    if example_ids is not None:
        conds.append(f"e.example_id IN ({', '.join(str(int(i)) for i in example_ids) or 'NULL'})")
    rows = store.sql(_FACTS_SQL.format(cond=" AND ".join(f"({c})" for c in conds))).to_pylist()
    if limit is not None:
        rows = rows[:limit]
    out = []
    for r in rows:
        meta = json.loads(r["meta"] or "{}")
        fact = StoredFact(
            example_id=int(r["example_id"]), relation_id=str(r["relation_id"]), subject=str(r["subject"]),
            object=str(r["object"]), input_ids=tuple(int(i) for i in r["ids"]), tokens=tuple(str(t) for t in r["toks"]),
            subject_span=(int(r["subject_start"]), int(r["subject_end"])), target_id=int(r["object_token_id"]),
            correct=int(r["object_rank"]) == 0, template=str(meta.get("template") or ""))
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
    emb = (arch.embedding(model) if arch is not None else model.get_input_embeddings())
    device = next(model.parameters()).device
    with torch.inference_mode():
        x = emb(torch.as_tensor(ids.astype(np.int64), device=device)).float()
    return float(x.std())


# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class TraceConfig:
    samples: int = 3  # noise samples per fact (ROME: 10)
    noise_scale: float = 3.0  # noise std in multiples of the subject embeddings' std
    window: int = 10  # layers restored together for mlp and attn
    components: tuple[str, ...] = COMPONENTS
    seed: int = 0
    batch_size: int = 64  # corrupted copies per forward pass (incremental: batch_size x longest prompt positions)
    skip_before_subject: bool = True  # positions before the subject have IE = 0 exactly; do not run them
    max_rows_per_call: int = 8192  # restorations held in memory at once (several facts)
    incremental: bool = True  # restorations reuse the corrupted run (False: recompute every row in full)

    def validate(self, n_layers: int) -> None:
        bad = [c for c in self.components if c not in COMPONENTS]
        if bad or not self.components:
            raise TraceError(f"unknown component {bad[0] if bad else '(none)'!r} (one of {', '.join(COMPONENTS)})")
        if self.samples < 1:
            raise TraceError(f"--samples must be at least 1, not {self.samples}")
        if self.noise_scale < 0:
            raise TraceError(f"the noise scale must be >= 0, not {self.noise_scale}")
        if self.window < 1:
            raise TraceError(f"--window must be at least 1, not {self.window}")
        if self.window > n_layers:
            raise TraceError(f"--window {self.window} is larger than the model ({n_layers} layers)")
        if self.batch_size < 1:
            raise TraceError("--batch-size must be positive")


def window_layers(layer: int, window: int, n_layers: int) -> range:
    """ROME's window of layers restored together around ``layer``."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


# ------------------------------------------------------------------------------------ results


@dataclass
class TraceResult:
    """One fact's trace.  Grids are [L, T] (layer x position) per component."""

    fact: StoredFact
    p_clean: float
    p_corrupt: float  # mean over samples
    p_corrupt_samples: np.ndarray  # [samples]
    noise_std: float
    restored: dict[str, np.ndarray] = field(default_factory=dict)  # component -> [L, T] mean P(o) restored

    @property
    def total_effect(self) -> float:
        return self.p_clean - self.p_corrupt

    def indirect_effect(self, component: str) -> np.ndarray:
        return self.restored[component] - self.p_corrupt

    def to_json(self) -> dict[str, Any]:
        f = self.fact
        return {
            "example_id": f.example_id, "relation_id": f.relation_id, "subject": f.subject, "object": f.object,
            "tokens": list(f.tokens), "subject_span": list(f.subject_span), "p_clean": self.p_clean,
            "p_corrupt": self.p_corrupt, "total_effect": self.total_effect, "noise_std": self.noise_std,
            "indirect_effect": {c: np.round(self.indirect_effect(c), 6).tolist() for c in self.restored},
        }


TRACE_EFFECTS = pa.schema([
    ("example_id", pa.int64()), ("component", pa.string()), ("layer", pa.int32()), ("position", pa.int32()),
    ("token", pa.string()), ("role", pa.string()), ("prob", pa.float64()), ("indirect_effect", pa.float64()),
])
TRACE_FACTS = pa.schema([
    ("example_id", pa.int64()), ("relation_id", pa.string()), ("subject", pa.string()), ("object", pa.string()),
    ("subject_start", pa.int32()), ("subject_end", pa.int32()), ("n_tokens", pa.int32()),
    ("p_clean", pa.float64()), ("p_corrupt", pa.float64()), ("total_effect", pa.float64()),
    ("noise_std", pa.float64()), ("samples", pa.int32()), ("window", pa.int32()),
])


def effects_table(results: Sequence[TraceResult]) -> pa.Table:
    """One row per (fact, component, layer, position): restored probability and indirect effect."""
    cols: dict[str, list[Any]] = {n: [] for n in TRACE_EFFECTS.names}
    for r in results:
        f = r.fact
        roles = [_role(p, f.subject_span) for p in range(f.n_tokens)]
        for c, grid in r.restored.items():
            L, T = grid.shape
            for layer in range(L):
                for p in range(T):
                    cols["example_id"].append(f.example_id)
                    cols["component"].append(c)
                    cols["layer"].append(layer)
                    cols["position"].append(p)
                    cols["token"].append(f.tokens[p])
                    cols["role"].append(roles[p])
                    cols["prob"].append(float(grid[layer, p]))
                    cols["indirect_effect"].append(float(grid[layer, p] - r.p_corrupt))
    return pa.table(cols, schema=TRACE_EFFECTS)


def facts_table(results: Sequence[TraceResult], cfg: TraceConfig) -> pa.Table:
    rows = [{
        "example_id": r.fact.example_id, "relation_id": r.fact.relation_id, "subject": r.fact.subject,
        "object": r.fact.object, "subject_start": r.fact.subject_span[0], "subject_end": r.fact.subject_span[1],
        "n_tokens": r.fact.n_tokens, "p_clean": r.p_clean, "p_corrupt": r.p_corrupt,
        "total_effect": r.total_effect, "noise_std": r.noise_std, "samples": cfg.samples, "window": cfg.window,
    } for r in results]
    return pa.Table.from_pylist(rows, schema=TRACE_FACTS)


def _role(p: int, span: tuple[int, int]) -> str:
    """ROME's position classes: first/middle/last subject token, after the subject, the last token."""
    s0, s1 = span
    if s0 <= p < s1:
        return "subject_first" if p == s0 else ("subject_last" if p == s1 - 1 else "subject_middle")
    return "before_subject" if p < s0 else "after_subject"


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
        add = torch.as_tensor([e.iv.op != "set" for e, n in zip(edits, sizes) for _ in range(n)], device=x.device)
        x = x.clone()
        x[rows, pos] = torch.where(add[:, None], x[rows, pos] + vals, vals)
        if key in self._record:
            self._recorded[key] = x.detach()
        return x


def _groupable(iv: Intervention, n: int) -> bool:
    v = iv.value
    return iv.op in ("set", "add", "add_noise") and v is not None and (v.dim() == 1 or (v.dim() == 2 and v.shape[0] in (1, n)))


def _value(iv: Intervention, n: int, width: int) -> torch.Tensor:
    assert iv.value is not None
    v = iv.value
    if v.shape[-1] != width:
        raise InterventionError(f"{iv.op} value of shape {list(v.shape)} does not fit the edited {iv.component} "
                                f"slice [{n}, {width}] at layer {iv.layer}")
    return v.reshape(-1, width).expand(n, width)


# ------------------------------------------------------------------------------------ tracer


_KEY = {"resid": lambda layer: ("resid", layer + 1), "mlp": lambda layer: ("mlp", layer),
        "attn": lambda layer: ("attn", layer)}


@dataclass
class _Clean:
    p: float
    states: dict[tuple[str, int], torch.Tensor]  # hook key -> [T, d_model] clean activations


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
    def trace(self, facts: Sequence[StoredFact], progress: Callable[[int], None] | None = None) -> list[TraceResult]:
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

    def clean(self, facts: Sequence[StoredFact]) -> list[_Clean]:
        """Clean probabilities of the object and every state restorations need, from one clean pass."""
        keys = sorted({_KEY[c](layer) for c in self.cfg.components for layer in range(self.n_layers)})
        res = self.runner.run([RunItem(f.input_ids, target_id=f.target_id) for f in facts],
                              record=keys, batch_size=self.cfg.batch_size)
        dev = self.runner.device  # restorations read them where the model runs
        return [_Clean(float(np.exp(lp)), {k: rec[f"{k[0]}:{k[1]}"].to(dev) for k in keys})
                for lp, rec in zip(res.target_logprob, res.records)]

    def restore(self, fact: StoredFact, clean: _Clean, component: str, layer: int, position: int,
                sample: int | None) -> RunItem:
        """One corrupted copy of ``fact`` (noise ``sample``; None: no noise) with one restoration."""
        edits = [] if sample is None else [self._noise_edit(fact, sample)]
        layers = [layer] if component == "resid" else list(window_layers(layer, self.cfg.window, self.n_layers))
        for lay in layers:
            key = _KEY[component](lay)
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
        probs = np.exp(self.runner.run(items, batch_size=self.cfg.batch_size).target_logprob.astype(np.float64))
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
        """Restorations that reuse the corrupted run: see :class:`_Incremental`."""
        cleans = self.clean(facts)
        inc = _Incremental(self, facts, cleans)
        S = self.cfg.samples
        low = inc.corrupted.prob.reshape(len(facts), S)
        sums = [{c: np.zeros((self.n_layers, f.n_tokens)) for c in self.cfg.components} for f in facts]
        rows = inc.rows()
        probs = inc.run(rows)
        np.add.at(inc.grid_sums, (rows.fact, rows.comp, rows.layer, rows.position), probs)
        for i, f in enumerate(facts):
            for j, c in enumerate(self.cfg.components):
                sums[i][c] += inc.grid_sums[i, j, :, :f.n_tokens]
        return self._results(facts, cleans, low, sums)

    def _results(self, facts: Sequence[StoredFact], cleans: Sequence[_Clean], low: np.ndarray,
                 sums: list[dict[str, np.ndarray]]) -> list[TraceResult]:
        S = self.cfg.samples
        out = []
        for i, (f, cl) in enumerate(zip(facts, cleans)):
            p_low = float(low[i].mean())
            restored = {}
            for c, grid in sums[i].items():
                grid = grid / S
                grid[:, :self._positions(f).start] = p_low  # unreachable by the noise: IE = 0 exactly
                restored[c] = grid
            out.append(TraceResult(f, cl.p, p_low, low[i].copy(), self.noise_std, restored))
        return out


# ------------------------------------------------------------------------------------ incremental


@dataclass
class _Corrupted:
    """The corrupted runs of a group of facts, one row per (fact, sample): row = fact * samples + sample."""

    resid: torch.Tensor  # [L, R, T, d_model] the input of decoder layer k (resid k, noise included)
    keys: list[torch.Tensor]  # [L] layer k's cached attention keys: [R, kv heads, T, d_head]
    values: list[torch.Tensor]  # [L] and values
    prob: np.ndarray  # [R] P(o) at the prompt's last position


@dataclass
class _Rows:
    """Restorations to run, one entry each (numpy arrays of equal length)."""

    fact: np.ndarray
    sample: np.ndarray
    comp: np.ndarray  # index into cfg.components
    layer: np.ndarray
    position: np.ndarray
    start: np.ndarray  # first decoder layer whose output differs from the corrupted run
    stop: np.ndarray  # mlp/attn: end of the restored window (exclusive); resid: start

    def __len__(self) -> int:
        return int(self.fact.size)

    def take(self, idx: np.ndarray) -> _Rows:
        return _Rows(*(getattr(self, k)[idx] for k in ("fact", "sample", "comp", "layer", "position", "start", "stop")))


def _replace_hidden(value: torch.Tensor) -> Callable[..., Any]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    return hook


class _Incremental:
    """Restorations computed from the corrupted run instead of from scratch.

    A restoration of fact f (noise sample s) at position p whose first changed decoder layer is
    ``start`` (resid at layer l: l + 1, the clean output of layer l is the next layer's input; mlp
    and attn: the first layer of the window) leaves every state of the corrupted run at layers
    below ``start`` and at positions before p as it was: causal attention keeps positions < p
    from seeing p, and layers below the window are not touched.  So a restoration runs only layers
    start..L-1 on positions p..T-1: its input is the corrupted run's input of layer ``start`` at those
    positions (position p of a resid restoration: the clean state), and the attention reads the
    corrupted run's cached keys and values of positions < p.  The window's mlp / attn outputs at
    position p (the first position run) are set to their clean values by hooks, as the full
    runner's edits do.  A resid restoration of the last layer changes nothing that is run: its
    probability is the corrupted one (p < T-1) or the clean one (p = T-1, the clean final state).

    Rows of one ``start`` share a forward pass of the backbone, with the layers below ``start``
    replaced by pass-throughs and the layer-0 input replaced by the rows' start states; rows are
    sorted by the number of positions they run, batched ``batch_size`` at a time, right-padded,
    and their past keys/values are left-padded so that every row's real tokens stay contiguous (the
    masks, Gemma's sliding windows included, see real distances).  Caches are plain
    :class:`transformers.DynamicCache` layers (a sliding layer keeps every token; its mask applies
    the window).
    """

    def __init__(self, tracer: CausalTracer, facts: Sequence[StoredFact], cleans: Sequence[_Clean]) -> None:
        self.tracer = tracer
        self.cfg = tracer.cfg
        self.facts = list(facts)
        self.cleans = list(cleans)
        runner = tracer.runner
        self.model: Any = runner.model
        self.arch = runner.arch
        self.device = runner.device
        self.L = tracer.n_layers
        self.blocks = self.arch.blocks(self.model)
        self.backbone = self.arch.backbone(self.model)
        self.T = max(f.n_tokens for f in facts)
        # The last layer's MLP: the module holding its down projection (None when it is the layer itself).
        top = self.blocks.layers[-1]
        self.last_mlp = next((m for m in top.modules() if m is not top
                              and any(c is self.blocks.down_proj[-1] for c in m.children())), None)
        # transformers 5 names the backbone's cache argument ``cache`` (``past_key_values`` before).
        params = inspect.signature(self.backbone.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.corrupted = self._corrupted_runs()
        comps = self.cfg.components
        self.grid_sums = np.zeros((len(facts), len(comps), self.L, self.T))
        # Clean states restorations set, stacked: component -> [facts, L, T, d_model] (resid l: layer l's output).
        d = runner.geometry.d_model
        self.clean_stack: dict[str, torch.Tensor] = {}
        for c in comps:
            stack = torch.zeros((len(facts), self.L, self.T, d), dtype=self.corrupted.resid.dtype, device=self.device)
            for i, (f, cl) in enumerate(zip(facts, cleans)):
                for k in range(self.L):
                    stack[i, k, :f.n_tokens] = cl.states[_KEY[c](k)]
            self.clean_stack[c] = stack

    # ------------------------------------------------------------------ corrupted runs
    @torch.inference_mode()
    def _corrupted_runs(self) -> _Corrupted:
        S, T, L = self.cfg.samples, self.T, self.L
        rows = [(i, s) for i in range(len(self.facts)) for s in range(S)]
        resid: torch.Tensor | None = None
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        prob = np.zeros(len(rows))
        for b0 in range(0, len(rows), self.cfg.batch_size):
            chunk = rows[b0:b0 + self.cfg.batch_size]
            rec, ks, vs, prob[b0:b0 + len(chunk)] = self._corrupted_chunk(chunk)
            if resid is None:
                resid = rec[0].new_zeros((L, len(rows), T, rec[0].shape[-1]))
                keys = [k.new_zeros((len(rows), *k.shape[1:])) for k in ks]
                values = [v.new_zeros((len(rows), *v.shape[1:])) for v in vs]
            for k in range(L):
                resid[k, b0:b0 + len(chunk)] = rec[k]
                keys[k][b0:b0 + len(chunk)] = ks[k]
                values[k][b0:b0 + len(chunk)] = vs[k]
        assert resid is not None
        return _Corrupted(resid, keys, values, prob)

    def _corrupted_chunk(self, chunk: Sequence[tuple[int, int]]
                         ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor], list[torch.Tensor], np.ndarray]:
        """Corrupted runs of (fact, sample) pairs, right-padded to the group's longest prompt: the inputs of
        every layer, the cached keys and values of every layer, P(o)."""
        from transformers import DynamicCache

        T, L, B = self.T, self.L, len(chunk)
        d = self.tracer.runner.geometry.d_model
        ids = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        noise = torch.zeros((B, T, d), dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        targets = torch.zeros(B, dtype=torch.long)
        for b, (i, s) in enumerate(chunk):
            f = self.facts[i]
            ids[b, :f.n_tokens] = torch.as_tensor(f.input_ids)
            mask[b, :f.n_tokens] = 1
            lengths[b] = f.n_tokens
            targets[b] = f.target_id
            value = self.tracer._noise_edit(f, s).value
            assert value is not None
            noise[b, f.subject_span[0]:f.subject_span[1]] = value.float().cpu()
        noise_d = noise.to(self.device)
        rec: dict[int, torch.Tensor] = {}

        def add_noise(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            h = args[0] if args else kwargs["hidden_states"]
            rec[0] = h + noise_d.to(h.dtype)  # as the full runner's add_noise edit: zero elsewhere
            return _replace_hidden(rec[0])(module, args, kwargs)

        def record(k: int) -> Callable[..., None]:
            def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
                rec[k] = output[0] if isinstance(output, tuple) else output

            return hook

        layers = self.blocks.layers
        handles = [layers[0].register_forward_pre_hook(add_noise, with_kwargs=True)]
        handles += [layers[k - 1].register_forward_hook(record(k)) for k in range(1, L)]
        cache: Any = DynamicCache()  # full layers: a sliding layer keeps every position (its mask slides)
        try:
            out = self.backbone(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=torch.arange(T, device=self.device)[None].expand(B, T),
                                use_cache=True, **{self.cache_kw: cache})
        finally:
            for h in handles:
                h.remove()
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        last = hidden[torch.arange(B, device=self.device), (lengths - 1).to(self.device)]
        prob = np.exp(self._target_logprob(last, targets))
        return rec, [c.keys for c in cache.layers], [c.values for c in cache.layers], prob

    def _target_logprob(self, last: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
        """log P(target) from final hidden states (after the final norm): [B, d_model] -> [B] float64."""
        logits = self.model.get_output_embeddings()(last).float()
        softcap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(1, targets.to(logp.device)[:, None])[:, 0]
        return lp.cpu().numpy().astype(np.float64)

    # ------------------------------------------------------------------ restorations
    def rows(self) -> _Rows:
        """Every restoration of the group (component, layer, position, sample per fact)."""
        cols: dict[str, list[int]] = {k: [] for k in ("fact", "sample", "comp", "layer", "position", "start", "stop")}
        for i, f in enumerate(self.facts):
            positions = list(self.tracer._positions(f))
            for s in range(self.cfg.samples):
                for j, c in enumerate(self.cfg.components):
                    for layer in range(self.L):
                        if c == "resid":
                            start = stop = layer + 1
                        else:
                            win = window_layers(layer, self.cfg.window, self.L)
                            start, stop = win.start, win.stop
                        for p in positions:
                            for k, v in (("fact", i), ("sample", s), ("comp", j), ("layer", layer), ("position", p),
                                         ("start", start), ("stop", stop)):
                                cols[k].append(v)
        return _Rows(*(np.asarray(cols[k], dtype=np.int64) for k in cols))

    def run(self, rows: _Rows) -> np.ndarray:
        """P(o) of every restoration in ``rows``."""
        S = self.cfg.samples
        probs = np.zeros(len(rows))
        n_tokens = np.asarray([f.n_tokens for f in self.facts])[rows.fact]
        done = rows.start >= self.L  # resid at the last layer: nothing left to run
        last = n_tokens - 1 == rows.position
        probs[done & last] = np.asarray([c.p for c in self.cleans])[rows.fact[done & last]]
        probs[done & ~last] = self.corrupted.prob[rows.fact[done & ~last] * S + rows.sample[done & ~last]]
        n_run = n_tokens - rows.position  # positions each restoration runs
        idx = np.flatnonzero(~done)
        idx = idx[np.lexsort((rows.position[idx], rows.fact[idx], rows.start[idx], -n_run[idx]))]
        budget = self.cfg.batch_size * self.T  # positions per pass: what the full runner's batches hold
        for b in _chunks(idx, n_run[idx], budget):
            b = b[np.argsort(rows.start[b], kind="stable")]  # rows that start lower first
            probs[b] = self._batch(rows.take(b), n_run[b])
        return probs

    @torch.inference_mode()
    def _batch(self, rows: _Rows, n_run: np.ndarray) -> np.ndarray:
        """One forward pass over restorations sorted by ``start``: layer k runs the rows with start <= k."""
        from transformers import DynamicCache

        dev, S, L = self.device, self.cfg.samples, self.L
        B, N = len(rows), int(n_run.max())
        P = int(rows.position.max())  # past slots (left-padded)
        active = [int(np.searchsorted(rows.start, k, side="right")) for k in range(L)]  # rows run by layer k
        src = torch.as_tensor(rows.fact * S + rows.sample, device=dev)
        fact = torch.as_tensor(rows.fact, device=dev)
        pos = torch.as_tensor(rows.position, device=dev)
        n = torch.as_tensor(n_run, device=dev)
        ar_n = torch.arange(N, device=dev)
        q_pos = pos[:, None] + ar_n[None]  # [B, N] the positions run
        q_valid = ar_n[None] < n[:, None]
        start = torch.as_tensor(rows.start, device=dev)
        # Each row's input: the corrupted input of its start layer at its positions.
        hidden = self.corrupted.resid[start[:, None], src[:, None], q_pos.clamp(max=self.T - 1)]
        for j, c in enumerate(self.cfg.components):
            sel = torch.as_tensor(np.flatnonzero(rows.comp == j), device=dev)
            if c == "resid" and sel.numel():  # the clean output of layer start - 1 at p
                hidden[sel, 0] = self.clean_stack[c][fact[sel], start[sel] - 1, pos[sel]]
        past_pos = pos[:, None] - P + torch.arange(P, device=dev)[None]  # [B, P]; < 0: padding
        gather = past_pos.clamp(min=0)
        cache_data = []
        for k in range(L):
            m = max(active[k], 1)  # a layer that runs no row keeps one row: the mask reads layer 0's length
            cache_data.append((self.corrupted.keys[k][src[:m, None], :, gather[:m]].transpose(1, 2),
                               self.corrupted.values[k][src[:m, None], :, gather[:m]].transpose(1, 2)))
        cache = DynamicCache(cache_data)
        mask = torch.cat([past_pos >= 0, q_valid], dim=1).long()
        # The last layer's MLP runs only the last position (every row runs N positions, the last is the
        # prompt's last token): its other positions' outputs reach nothing.  Their residual sums
        # broadcast the last position's MLP output and are never read.
        last_mlp = N > 1 and self.last_mlp is not None
        # Edits: the window's clean mlp / attn outputs at position p (the first position run).
        edits: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for j, c in enumerate(self.cfg.components):
            if c == "resid":
                continue
            for k in range(L - 1 if c == "mlp" and last_mlp else L):
                sel_np = np.flatnonzero((rows.comp == j) & (rows.start <= k) & (rows.stop > k))
                if sel_np.size:
                    sel = torch.as_tensor(sel_np, device=dev)
                    edits[(c, k)] = (sel, self.clean_stack[c][fact[sel], k, pos[sel]])
        layers = self.blocks.layers
        handles = [layers[0].register_forward_pre_hook(_replace_hidden(hidden), with_kwargs=True)]
        for (c, k), (sel, val) in edits.items():
            module = self.blocks.down_proj[k] if c == "mlp" else self.blocks.out_proj[k]
            handles.append(module.register_forward_hook(_set_first(sel, val)))
        if last_mlp:
            assert self.last_mlp is not None
            handles.append(self.last_mlp.register_forward_pre_hook(_last_position))
        saved = [layer.__dict__.get("forward") for layer in layers]
        try:
            for k, layer in enumerate(layers):
                layer.forward = _first_rows(layer.forward, active[k], B)
            out = self.backbone(inputs_embeds=hidden, attention_mask=mask, position_ids=q_pos, use_cache=True,
                                **{self.cache_kw: cache})
        finally:
            for layer, old in zip(layers, saved):
                if old is None:
                    del layer.forward
                else:
                    layer.forward = old
            for h in handles:
                h.remove()
        final = out[0] if isinstance(out, tuple) else out.last_hidden_state
        last = final[torch.arange(B, device=dev), n - 1]
        targets = torch.as_tensor([self.facts[i].target_id for i in rows.fact])
        return np.exp(self._target_logprob(last, targets))


def _chunks(idx: np.ndarray, n: np.ndarray, budget: int) -> list[np.ndarray]:
    """Consecutive runs of ``idx`` with one value of ``n`` each (no padding), of at most ``budget``
    positions (``len * n``; one row at least)."""
    out: list[np.ndarray] = []
    b0 = 0
    for j in range(1, idx.size + 1):
        if j == idx.size or n[j] != n[b0] or (j - b0 + 1) * int(n[b0]) > budget:
            out.append(idx[b0:j])
            b0 = j
    return out


def _first_rows(forward: Callable[..., Any], m: int, batch: int) -> Callable[..., Any]:
    """A decoder layer's forward that runs only the batch's first ``m`` rows; the others pass through.

    Every tensor argument of two or more dimensions whose first is the batch (hidden states, masks,
    position ids, rotary cos/sin) is cut to its first ``m`` rows; the cache's layer already holds
    those rows only.
    """
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch:
            return x[:m]
        if isinstance(x, tuple):
            return tuple(cut(y) for y in x)
        return x

    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if m == 0:
            return hidden_states
        if m == batch:
            return forward(hidden_states, *args, **kwargs)
        out = forward(hidden_states[:m], *(cut(a) for a in args), **{k: cut(v) for k, v in kwargs.items()})
        h = out[0] if isinstance(out, tuple) else out
        full = torch.cat([h, hidden_states[m:]], dim=0)
        return (full, *out[1:]) if isinstance(out, tuple) else full

    return run


def _last_position(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the module sees only its input's last position."""
    return (args[0][:, -1:], *args[1:])


def _set_first(rows: torch.Tensor, value: torch.Tensor) -> Callable[..., Any]:
    """Forward hook: the module's output at the first position of ``rows`` set to ``value``."""
    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        out = output.clone()
        out[rows, 0] = value.to(out.dtype)
        return out

    return hook


def trace_facts(runner: InterventionRunner, facts: Sequence[StoredFact], cfg: TraceConfig, noise_std: float,
                progress: Callable[[int], None] | None = None) -> list[TraceResult]:
    """Convenience: :class:`CausalTracer` (cfg, noise_std) over ``facts``."""
    return CausalTracer(runner, cfg, noise_std).trace(facts, progress)


def key_mlp_layer(result: TraceResult) -> int:
    """The layer whose (windowed) MLP restoration has the largest indirect effect at any position."""
    return int(np.argmax(result.indirect_effect("mlp").max(axis=1)))
