"""Incremental causal tracing: restorations computed from the corrupted run instead of from scratch
(see :class:`Incremental` and :mod:`actstore.interventions.tracing`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from actstore.core.dependencies import transformers
from actstore.interventions.facts import StoredFact
from actstore.interventions.runner import Intervention, InterventionRunner
from actstore.interventions.settings import TraceConfig
from actstore.interventions.trace_results import STATE_KEY, CleanStates, window_layers


class TracerLike(Protocol):
    """What :class:`Incremental` reads from its tracer (:class:`actstore.interventions.tracing.CausalTracer`)."""

    runner: InterventionRunner
    cfg: TraceConfig
    n_layers: int

    def _positions(self, fact: StoredFact) -> range: ...

    def _noise_edit(self, fact: StoredFact, sample: int) -> Intervention: ...


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
        return _Rows(
            *(getattr(self, k)[idx] for k in ("fact", "sample", "comp", "layer", "position", "start", "stop"))
        )


def _replace_hidden(value: torch.Tensor) -> Callable[..., Any]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    return hook


class Incremental:
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

    With ``span`` a restoration sets the window's clean mlp / attn outputs at *every* position it runs
    (p..T-1), not at p only: the restore interventions of :mod:`actstore.interventions.effectiveness`
    (p = the subject's first token).  The argument above holds unchanged.
    """

    def __init__(
        self,
        tracer: TracerLike,
        facts: Sequence[StoredFact],
        cleans: Sequence[CleanStates],
        span: bool = False,
    ) -> None:
        self.tracer = tracer
        self.span = span
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
        self.last_mlp = next(
            (
                m
                for m in top.modules()
                if m is not top and any(c is self.blocks.down_proj[-1] for c in m.children())
            ),
            None,
        )
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
            stack = torch.zeros(
                (len(facts), self.L, self.T, d), dtype=self.corrupted.resid.dtype, device=self.device
            )
            for i, (f, cl) in enumerate(zip(facts, cleans)):
                for k in range(self.L):
                    stack[i, k, : f.n_tokens] = cl.states[STATE_KEY[c](k)]
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
            chunk = rows[b0 : b0 + self.cfg.batch_size]
            rec, ks, vs, prob[b0 : b0 + len(chunk)] = self._corrupted_chunk(chunk)
            if resid is None:
                resid = rec[0].new_zeros((L, len(rows), T, rec[0].shape[-1]))
                keys = [k.new_zeros((len(rows), *k.shape[1:])) for k in ks]
                values = [v.new_zeros((len(rows), *v.shape[1:])) for v in vs]
            for k in range(L):
                resid[k, b0 : b0 + len(chunk)] = rec[k]
                keys[k][b0 : b0 + len(chunk)] = ks[k]
                values[k][b0 : b0 + len(chunk)] = vs[k]
        assert resid is not None
        return _Corrupted(resid, keys, values, prob)

    def _corrupted_chunk(
        self, chunk: Sequence[tuple[int, int]]
    ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor], list[torch.Tensor], np.ndarray]:
        """Corrupted runs of (fact, sample) pairs, right-padded to the group's longest prompt: the inputs of
        every layer, the cached keys and values of every layer, P(o)."""
        T, L, B = self.T, self.L, len(chunk)
        d = self.tracer.runner.geometry.d_model
        ids = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        noise = torch.zeros((B, T, d), dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        targets = torch.zeros(B, dtype=torch.long)
        for b, (i, s) in enumerate(chunk):
            f = self.facts[i]
            ids[b, : f.n_tokens] = torch.as_tensor(f.input_ids)
            mask[b, : f.n_tokens] = 1
            lengths[b] = f.n_tokens
            targets[b] = f.target_id
            value = self.tracer._noise_edit(f, s).value
            assert value is not None
            noise[b, f.subject_span[0] : f.subject_span[1]] = value.float().cpu()
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
        cache: Any = (
            transformers.DynamicCache()
        )  # full layers: a sliding layer keeps every position (its mask slides)
        try:
            out = self.backbone(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=torch.arange(T, device=self.device)[None].expand(B, T),
                use_cache=True,
                **{self.cache_kw: cache},
            )
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
        cols: dict[str, list[int]] = {
            k: [] for k in ("fact", "sample", "comp", "layer", "position", "start", "stop")
        }
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
                            for k, v in (
                                ("fact", i),
                                ("sample", s),
                                ("comp", j),
                                ("layer", layer),
                                ("position", p),
                                ("start", start),
                                ("stop", stop),
                            ):
                                cols[k].append(v)
        return _Rows(*(np.asarray(cols[k], dtype=np.int64) for k in cols))

    def site_rows(self, sites: Sequence[tuple[str, int]]) -> _Rows:
        """Restorations of each (component, layer) site with a window of one layer, from each fact's
        first subject token on (``span`` mode), for every noise sample: ordered fact, sample, site."""
        comps = list(self.cfg.components)
        S, n_sites = self.cfg.samples, len(sites)
        comp = np.asarray([comps.index(c) for c, _ in sites], dtype=np.int64)
        layer = np.asarray([lay for _, lay in sites], dtype=np.int64)
        reps = len(self.facts) * S
        fact = np.repeat(np.arange(len(self.facts), dtype=np.int64), S * n_sites)
        first = np.asarray([f.subject_span[0] for f in self.facts], dtype=np.int64)
        return _Rows(
            fact=fact,
            sample=np.tile(np.repeat(np.arange(S, dtype=np.int64), n_sites), len(self.facts)),
            comp=np.tile(comp, reps),
            layer=np.tile(layer, reps),
            position=first[fact],
            start=np.tile(layer, reps),
            stop=np.tile(layer + 1, reps),
        )

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
            cache_data.append(
                (
                    self.corrupted.keys[k][src[:m, None], :, gather[:m]].transpose(1, 2),
                    self.corrupted.values[k][src[:m, None], :, gather[:m]].transpose(1, 2),
                )
            )
        cache = transformers.DynamicCache(cache_data)
        mask = torch.cat([past_pos >= 0, q_valid], dim=1).long()
        # The last layer's MLP runs only the last position (every row runs N positions, the last is the
        # prompt's last token): its other positions' outputs reach nothing.  Their residual sums
        # broadcast the last position's MLP output and are never read.
        last_mlp = N > 1 and self.last_mlp is not None
        # Edits: the window's clean mlp / attn outputs at position p (the first position run); with
        # ``span`` at every position run ([rows, N, d]; the last layer's MLP, run at the last position
        # only, gets that position's: [rows, 1, d]).
        edits: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for j, c in enumerate(self.cfg.components):
            if c == "resid":
                continue
            for k in range(L - 1 if c == "mlp" and last_mlp and not self.span else L):
                sel_np = np.flatnonzero((rows.comp == j) & (rows.start <= k) & (rows.stop > k))
                if not sel_np.size:
                    continue
                sel = torch.as_tensor(sel_np, device=dev)
                stack = self.clean_stack[c]
                if not self.span:
                    edits[(c, k)] = (sel, stack[fact[sel], k, pos[sel]])
                elif c == "mlp" and last_mlp and k == L - 1:
                    edits[(c, k)] = (sel, stack[fact[sel], k, pos[sel] + n[sel] - 1][:, None])
                else:
                    edits[(c, k)] = (sel, stack[fact[sel, None], k, q_pos[sel].clamp(max=self.T - 1)])
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
            out = self.backbone(
                inputs_embeds=hidden,
                attention_mask=mask,
                position_ids=q_pos,
                use_cache=True,
                **{self.cache_kw: cache},
            )
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
    """Forward hook: the module's output at the first position of ``rows`` set to ``value`` ([rows, d]),
    or at its first ``value.shape[1]`` positions ([rows, n, d])."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        out = output.clone()
        if value.dim() == 2:
            out[rows, 0] = value.to(out.dtype)
        else:
            out[rows, : value.shape[1]] = value.to(out.dtype)
        return out

    return hook
