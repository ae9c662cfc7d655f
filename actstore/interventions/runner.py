"""Interventions: batched forward passes with edits at chosen (component, layer, positions).

An :class:`Intervention` says *where* (component, layer, positions, and for ``head`` which
heads) and *what* (op).  Components, with the store's vocabulary (docs/format.md):

    resid   layer 0..L    the residual stream: 0 = input of layer 0 (embeddings), l+1 = output
                          of layer l (before the final norm)      [P, d_model]
    attn    layer 0..L-1  the attention block's output (o_proj output, b_O included)   [P, d_model]
    mlp     layer 0..L-1  the MLP's output (down projection output, bias included)     [P, d_model]
    head    layer 0..L-1  per-head inputs of o_proj, z_h (the store's ``z``), for the
                          chosen heads                                         [P, n_heads, d_head]

Ops: ``zero``; ``mean`` and ``set`` (replace by ``value``: a mean for ablation, or clean
activations for patching and restoring); ``add`` (add ``value``); ``add_noise`` (add Gaussian
noise of ``noise_std``, drawn from ``seed``, or exactly ``value`` when given so that several
runs can share one noise sample).  ``value`` broadcasts to the edited slice, whose shape is in
the table (P = number of edited positions).  Positions are the prompt's own token positions
(negative ones count from the end, -1 = the last prompt token, where the model predicts);
``None`` means every position.

Edits hook onto the modules the architecture adapters name (``actstore.ingest.capture.architectures``): a
forward pre-hook on the first decoder layer (resid 0), forward hooks on decoder layers
(resid l+1), on the attention output projection (attn) and on the down projection (mlp), and
a forward pre-hook on the attention output projection that rewrites the per-head slices of its
input (head).  Because the projection is linear, zeroing every head at a position leaves
exactly the bias b_O at its output.

:class:`InterventionRunner` runs many prompts in padded batches; each :class:`RunItem`
carries its own interventions (so one forward pass can hold many different edits, one per
batch row: causal tracing puts one (layer, position) restoration in each row), and
``shared`` interventions apply to every row (head ablation).  It returns the greedy next
token and the target's log-probability at each prompt's last position, optionally the
logits, and optionally recorded activations (after the edits) at any hook point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from actstore.core.errors import InterventionError
from actstore.core.manifest import Geometry
from actstore.ingest.capture.architectures import Architecture, architecture_for
from actstore.ingest.capture.batches import pad_batch
from actstore.ingest.records import PromptRecord, TokenizedPrompt

COMPONENTS = ("resid", "attn", "mlp", "head")
OPS = ("zero", "mean", "set", "add", "add_noise")


@dataclass(frozen=True)
class Intervention:
    """One edit; see the module docstring for components, ops and shapes."""

    component: str
    layer: int
    op: str
    positions: tuple[int, ...] | None = (-1,)
    heads: tuple[int, ...] | None = None
    value: torch.Tensor | None = field(default=None, compare=False)
    noise_std: float = 0.0
    seed: int = 0

    def validate(self, g: Geometry) -> None:
        if self.component not in COMPONENTS:
            raise InterventionError(f"unknown component {self.component!r} (one of {', '.join(COMPONENTS)})")
        if self.op not in OPS:
            raise InterventionError(f"unknown op {self.op!r} (one of {', '.join(OPS)})")
        top = g.n_layers if self.component == "resid" else g.n_layers - 1
        if not 0 <= self.layer <= top:
            raise InterventionError(f"{self.component} layer {self.layer} is out of range 0..{top}")
        if self.heads is not None:
            if self.component != "head":
                raise InterventionError(f"heads apply to the head component, not {self.component!r}")
            bad = [h for h in self.heads if not 0 <= h < g.n_heads]
            if bad or not self.heads:
                raise InterventionError(
                    f"head {bad[0] if bad else '(none)'} of layer {self.layer} is out of range 0..{g.n_heads - 1}"
                )
        if self.op in ("mean", "set", "add") and self.value is None:
            raise InterventionError(f"op {self.op!r} needs a value")
        if self.op == "add_noise" and self.value is None and self.noise_std <= 0:
            raise InterventionError("op 'add_noise' needs noise_std > 0 or a value")

    @property
    def key(self) -> tuple[str, int]:
        return (self.component, self.layer)


@dataclass(frozen=True)
class RunItem:
    """One prompt (token ids, special tokens included), its own edits and an optional target token."""

    input_ids: Sequence[int]
    interventions: tuple[Intervention, ...] = ()
    target_id: int | None = None


@dataclass
class RunResult:
    top_ids: np.ndarray  # [n] greedy next token at each prompt's last position
    target_logprob: np.ndarray  # [n] log-probability of the item's target (nan without one)
    logits: torch.Tensor | None = None  # [n, V] float32, when asked for
    records: list[dict[str, torch.Tensor]] = field(
        default_factory=list
    )  # per item: "head:3" -> [T, H, d_head]

    def accuracy(self, targets: Sequence[int] | np.ndarray) -> float:
        t = np.asarray(targets)
        return float((self.top_ids == t).mean()) if t.size else float("nan")


@dataclass
class _Edit:
    row: int
    positions: torch.Tensor  # padded positions
    iv: Intervention


class InterventionRunner:
    """Runs prompts through ``model`` with interventions; see :meth:`run`."""

    def __init__(self, model: nn.Module, arch: Architecture | None = None) -> None:
        self.model = model
        self.arch = arch or architecture_for(model)
        self.geometry = self.arch.geometry(model)
        self.device = next(model.parameters()).device
        self._edits: dict[tuple[str, int], list[_Edit]] = {}
        self._record: set[tuple[str, int]] = set()
        self._recorded: dict[tuple[str, int], torch.Tensor] = {}

    # --------------------------------------------------------------------------- public
    def run(
        self,
        items: Sequence[RunItem],
        *,
        shared: Sequence[Intervention] = (),
        batch_size: int = 16,
        record: Iterable[tuple[str, int]] = (),
        keep_logits: bool = False,
        padding_side: str = "right",
        pad_id: int = 0,
    ) -> RunResult:
        """Forward ``items`` in batches; ``shared`` edits every row, each item's own edits only its row."""
        g = self.geometry
        for iv in shared:
            iv.validate(g)
        for it in items:
            if len(it.input_ids) == 0:
                raise InterventionError("a prompt has no tokens")
            for iv in it.interventions:
                iv.validate(g)
        rec = {(str(c), int(layer)) for c, layer in record}
        for c, layer in rec:
            Intervention(c, layer, "zero").validate(g)
        self._record = rec
        tops: list[np.ndarray] = []
        lps: list[np.ndarray] = []
        logits_out: list[torch.Tensor] = []
        records: list[dict[str, torch.Tensor]] = []
        handles = self._install()
        try:
            for b0 in range(0, len(items), batch_size):
                chunk = items[b0 : b0 + batch_size]
                top, lp, logits, recs = self._batch(chunk, shared, padding_side, pad_id)
                tops.append(top)
                lps.append(lp)
                if keep_logits:
                    logits_out.append(logits)
                records.extend(recs)
        finally:
            for h in handles:
                h.remove()
            self._edits.clear()
            self._recorded.clear()
        return RunResult(
            top_ids=np.concatenate(tops) if tops else np.zeros(0, np.int64),
            target_logprob=np.concatenate(lps) if lps else np.zeros(0, np.float32),
            logits=torch.cat(logits_out) if keep_logits and logits_out else None,
            records=records if rec else [],
        )

    # --------------------------------------------------------------------------- one batch
    @torch.inference_mode()
    def _batch(
        self, items: Sequence[RunItem], shared: Sequence[Intervention], side: str, pad_id: int
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor, list[dict[str, torch.Tensor]]]:
        prompts = [_as_prompt(it.input_ids) for it in items]
        batch = pad_batch(prompts, pad_id, side, self.device)
        lengths = batch.n_tokens
        T = int(batch.input_ids.shape[1])
        offsets = [T - n if side == "left" else 0 for n in lengths]
        self._edits = {}
        for b, it in enumerate(items):
            for iv in (*shared, *it.interventions):
                pos = _padded_positions(iv.positions, lengths[b], offsets[b], self.device)
                self._edits.setdefault(iv.key, []).append(_Edit(b, pos, iv))
        self._recorded = {}
        backbone = self.arch.backbone(self.model)
        out = backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # after the final norm
        last = hidden[batch.index.target_b, batch.index.target_pos]
        model: Any = self.model
        logits = model.get_output_embeddings()(last).float()
        softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.argmax(-1).cpu().numpy()
        tgt = np.full(len(items), np.nan, np.float32)
        for b, it in enumerate(items):
            if it.target_id is not None and it.target_id >= 0:
                tgt[b] = float(logp[b, int(it.target_id)])
        recs: list[dict[str, torch.Tensor]] = []
        if self._record:
            for b, n in enumerate(lengths):
                d: dict[str, torch.Tensor] = {}
                for (c, layer), t in self._recorded.items():
                    x = t[b, offsets[b] : offsets[b] + n].float().cpu()
                    d[f"{c}:{layer}"] = x.view(n, self.geometry.n_heads, -1) if c == "head" else x
                recs.append(d)
        return top, tgt, logits.cpu(), recs

    # --------------------------------------------------------------------------- hooks
    def _install(self) -> list[Any]:
        blocks = self.arch.blocks(self.model)
        L = self.geometry.n_layers
        handles: list[Any] = [blocks.layers[0].register_forward_pre_hook(self._resid0_hook, with_kwargs=True)]
        for layer in range(L):
            handles.append(
                blocks.layers[layer].register_forward_hook(self._output_hook(("resid", layer + 1)))
            )
            handles.append(blocks.out_proj[layer].register_forward_hook(self._output_hook(("attn", layer))))
            handles.append(blocks.down_proj[layer].register_forward_hook(self._output_hook(("mlp", layer))))
            handles.append(blocks.out_proj[layer].register_forward_pre_hook(self._head_hook(layer)))
        return handles

    def _edit(self, key: tuple[str, int], x: torch.Tensor) -> torch.Tensor | None:
        """``x`` [B, T, X] with the edits at ``key`` applied (a copy), or None when nothing changes."""
        edits = self._edits.get(key)
        if key in self._record and not edits:
            self._recorded[key] = x.detach()
        if not edits:
            return None
        x = x.clone()
        view = x.view(x.shape[0], x.shape[1], self.geometry.n_heads, -1) if key[0] == "head" else x
        for e in edits:
            iv = e.iv
            idx: tuple[Any, ...] = (e.row, e.positions)
            if key[0] == "head":
                hs = torch.as_tensor(
                    iv.heads if iv.heads is not None else range(self.geometry.n_heads), device=x.device
                )
                idx = (e.row, e.positions[:, None], hs[None, :])
            cur = view[idx]
            view[idx] = _apply_op(iv, cur)
        if key in self._record:
            self._recorded[key] = x.detach()
        return x

    def _resid0_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        h = args[0] if args else kwargs["hidden_states"]
        new = self._edit(("resid", 0), h)
        if new is None:
            return None
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}

    def _output_hook(self, key: tuple[str, int]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            h = output[0] if isinstance(output, tuple) else output
            new = self._edit(key, h)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    def _head_hook(self, layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
            new = self._edit(("head", layer), args[0])
            return None if new is None else (new, *args[1:])

        return hook


# ----------------------------------------------------------------------------------- helpers


def _as_prompt(ids: Sequence[int]) -> TokenizedPrompt:
    n = len(ids)
    return TokenizedPrompt(PromptRecord(text=""), [int(i) for i in ids], [(0, 0)] * n, n - 1, None, None)


def _padded_positions(
    positions: tuple[int, ...] | None, n: int, offset: int, device: torch.device
) -> torch.Tensor:
    if positions is None:
        return torch.arange(n, device=device) + offset
    out = []
    for p in positions:
        q = p + n if p < 0 else p
        if not 0 <= q < n:
            raise InterventionError(f"position {p} is outside a prompt of {n} tokens")
        out.append(q + offset)
    return torch.as_tensor(out, dtype=torch.long, device=device)


def _apply_op(iv: Intervention, cur: torch.Tensor) -> torch.Tensor:
    if iv.op == "zero":
        return torch.zeros_like(cur)
    if iv.op == "add_noise" and iv.value is None:
        gen = torch.Generator().manual_seed(int(iv.seed))
        noise = torch.randn(cur.shape, generator=gen, dtype=torch.float32) * float(iv.noise_std)
        return cur + noise.to(cur.device, cur.dtype)
    assert iv.value is not None
    try:
        value = iv.value.to(cur.device, cur.dtype).expand_as(cur)
    except RuntimeError:
        raise InterventionError(
            f"{iv.op} value of shape {list(iv.value.shape)} does not fit the edited {iv.component} slice "
            f"{list(cur.shape)} at layer {iv.layer}"
        ) from None
    return value.clone() if iv.op in ("mean", "set") else cur + value


def head_ablation(
    heads: Iterable[tuple[int, int]],
    *,
    mode: str = "zero",
    means: np.ndarray | torch.Tensor | None = None,
    positions: tuple[int, ...] | None = (-1,),
) -> list[Intervention]:
    """Interventions removing ``heads`` ((layer, head) pairs): one per layer.

    ``mode="zero"`` sets z_h to 0; ``mode="mean"`` sets it to ``means[layer, head]`` (e.g.
    :func:`stored_head_means`).  ``positions``: the last prompt token by default (as in the
    MAPS paper), ``None`` for every position.
    """
    if mode not in ("zero", "mean"):
        raise InterventionError(f"ablation mode must be zero or mean, not {mode!r}")
    by_layer: dict[int, list[int]] = {}
    for layer, h in heads:
        by_layer.setdefault(int(layer), []).append(int(h))
    out = []
    for layer, hs in sorted(by_layer.items()):
        hs = sorted(set(hs))
        if mode == "zero":
            out.append(Intervention("head", layer, "zero", positions, tuple(hs)))
        else:
            if means is None:
                raise InterventionError("mean ablation needs the heads' mean activations")
            m = torch.as_tensor(np.asarray(means)[layer, hs], dtype=torch.float32)  # [n_heads, d_head]
            out.append(Intervention("head", layer, "mean", positions, tuple(hs), value=m))
    return out


def stored_head_means(sel: Any, batch_rows: int = 512) -> np.ndarray:
    """Mean of the stored z over the target rows of the selection ``sel``: [L, H, d_head] float32
    (float64 sums)."""
    if len(sel) == 0:
        raise InterventionError(f"{sel.store.url}: no stored rows to average")
    total: np.ndarray | None = None
    n = 0
    for _, z in sel.iter_features("z", batch_rows=batch_rows):
        s = z.astype(np.float64).sum(axis=0)
        total = s if total is None else total + s
        n += z.shape[0]
    assert total is not None
    return (total / n).astype(np.float32)
