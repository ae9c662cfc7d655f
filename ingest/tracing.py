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

Batching: every (component, layer, position, sample) restoration is one row of a batch of
corrupted copies (:class:`ingest.interventions.RunItem` carries its own edits), so one forward
pass holds many restorations, of several facts.  Positions before the subject are not run: the
noise cannot reach them under causal attention, so their clean and corrupted states are equal and
their indirect effect is exactly 0 (``skip_before_subject``; off runs them anyway).
"""

from __future__ import annotations

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
    batch_size: int = 64  # corrupted copies per forward pass
    skip_before_subject: bool = True  # positions before the subject have IE = 0 exactly; do not run them
    max_rows_per_call: int = 8192  # restorations held in memory at once (several facts)

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


def trace_facts(runner: InterventionRunner, facts: Sequence[StoredFact], cfg: TraceConfig, noise_std: float,
                progress: Callable[[int], None] | None = None) -> list[TraceResult]:
    """Convenience: :class:`CausalTracer` (cfg, noise_std) over ``facts``."""
    return CausalTracer(runner, cfg, noise_std).trace(facts, progress)


def key_mlp_layer(result: TraceResult) -> int:
    """The layer whose (windowed) MLP restoration has the largest indirect effect at any position."""
    return int(np.argmax(result.indirect_effect("mlp").max(axis=1)))
