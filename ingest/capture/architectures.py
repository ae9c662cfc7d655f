"""Where each supported architecture keeps its blocks, and how its weights map onto the store's.

The store speaks one vocabulary for every model:

    W_O     [L, H, d_head, d_model]   per-head slice of the attention output projection
    b_O     [L, d_model]
    W_V     [L, H_kv, d_model, d_head] value projection, per key/value head
    b_V     [L, H_kv, d_head]
    W_down  [L, d_mlp, d_model]       MLP output projection;  b_down [L, d_model]
    embed   [V, d_model]  (times ``embed_scale``);  unembed [V, d_model] (omitted when tied)
    final_norm_weight/bias [d_model]  (effective weight: Gemma's 1 + w is folded in)

An :class:`Architecture` knows the modules of one family; :func:`architecture_for` picks it.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from actstore.core.manifest import Geometry
from actstore.core.weight_store import source_key


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).numpy().copy()


@dataclass(frozen=True)
class Blocks:
    """The modules capture hooks onto, one entry per layer."""

    layers: list[nn.Module]
    attention: list[nn.Module]
    out_proj: list[nn.Module]
    down_proj: list[nn.Module]


class Architecture:
    """Llama-style layout (Llama, SmolLM2, Qwen2/3, Mistral, Gemma 3): ``model.model.layers[i].self_attn``."""

    name = "llama"
    conv1d = False  # GPT-2 stores Linear weights transposed (Conv1D: [in, out])

    def backbone(self, model: Any) -> Any:
        return model.model

    def blocks(self, model: Any) -> Blocks:
        layers = list(self.backbone(model).layers)
        return Blocks(
            layers=layers,
            attention=[layer.self_attn for layer in layers],
            out_proj=[layer.self_attn.o_proj for layer in layers],
            down_proj=[layer.mlp.down_proj for layer in layers],
        )

    def geometry(self, model: Any) -> Geometry:
        cfg = _text_config(model)
        n_heads = int(cfg.num_attention_heads)
        d_model = int(cfg.hidden_size)
        d_head = int(getattr(cfg, "head_dim", None) or d_model // n_heads)
        return Geometry(
            n_layers=int(cfg.num_hidden_layers),
            n_heads=n_heads,
            n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or n_heads),
            d_head=d_head,
            d_model=d_model,
            d_mlp=int(self._linear(self.blocks(model).down_proj[0])[0].shape[0]),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        )

    # --- weights --------------------------------------------------------------------------
    def _linear(self, mod: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight as [in, out], bias) of a Linear or Conv1D."""
        w: torch.Tensor = mod.weight if self.conv1d else mod.weight.T
        return w, getattr(mod, "bias", None)

    def value_weights(self, attn: Any, g: Geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W_V [d_model, H_kv*d_head], b_V [H_kv*d_head] or None) in kv-head-major order."""
        return self._linear(attn.v_proj)

    def final_norm(self, model: Any) -> Any:
        return self.backbone(model).norm

    def mlp_input(self, model: Any, layer: int, which: str) -> tuple[Any, nn.Module]:
        """(the norm the MLP of ``layer`` reads the residual through, or None, and its input projection):
        ``which`` is ``gate`` (the activation's argument) or ``up`` (gated MLPs)."""
        block: Any = self.blocks(model).layers[layer]
        mlp = block.mlp
        if which not in ("gate", "up") or (which == "up" and not hasattr(mlp, "up_proj")):
            raise ValueError(
                f"this model's MLP has no {which!r} input weights (gate{', up' * hasattr(mlp, 'up_proj')})"
            )
        proj = mlp.gate_proj if which == "gate" else mlp.up_proj
        norm = getattr(block, "pre_feedforward_layernorm", None)  # Gemma: a norm before the MLP of its own
        if norm is None:
            norm = getattr(block, "post_attention_layernorm", None)
        if type(block).__name__.startswith("Olmo2"):
            norm = None  # Olmo 2 normalises the MLP's output, not its input
        return norm, proj

    def neuron_input(self, model: Any, layer: int, index: int, which: str = "gate") -> np.ndarray:
        """Neuron ``index`` of ``layer``'s input weights as a residual direction ``u`` [d_model] (ours):
        the row folded with the norm's weight (``w * gamma``; a LayerNorm's centring folded too:
        ``u - mean(u)``), so that the neuron's pre-activation is ``u . x / scale(x) + c`` for the
        residual ``x`` entering the MLP, where ``scale`` is the norm's RMS or standard deviation
        (positive, one per token) and ``c`` a constant of the weights (the biases)."""
        norm, proj = self.mlp_input(model, layer, which)
        u = self._linear(proj)[0][:, index].detach().to(torch.float32)
        if norm is not None:
            gamma = norm.weight.detach().to(torch.float32)
            if type(norm).__name__.startswith("Gemma"):
                gamma = 1.0 + gamma
            u = u * gamma
            if isinstance(norm, nn.LayerNorm):
                u = u - u.mean()
        return _np(u)

    def embedding(self, model: Any) -> Any:
        return model.get_input_embeddings()

    def norm_params(self, model: Any) -> tuple[str, torch.Tensor, torch.Tensor | None, float]:
        norm: Any = self.final_norm(model)
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        w: torch.Tensor = norm.weight
        if type(norm).__name__.startswith("Gemma"):
            w = 1.0 + w  # Gemma's RMSNorm scales by (1 + weight)
        if isinstance(norm, nn.LayerNorm):
            return "layernorm", w, norm.bias, eps
        return "rmsnorm", w, None, eps

    def weights(self, model: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        g = self.geometry(model)
        b = self.blocks(model)
        L, H, Hkv, dh, d = g.n_layers, g.n_heads, g.n_kv_heads, g.d_head, g.d_model
        W_O = np.zeros((L, H, dh, d), np.float32)
        b_O = np.zeros((L, d), np.float32)
        W_V = np.zeros((L, Hkv, d, dh), np.float32)
        b_V = np.zeros((L, Hkv, dh), np.float32)
        W_down = np.zeros((L, g.d_mlp, d), np.float32)
        b_down = np.zeros((L, d), np.float32)
        for layer in range(L):
            w, bias = self._linear(b.out_proj[layer])
            W_O[layer] = _np(w).reshape(H, dh, d)
            if bias is not None:
                b_O[layer] = _np(bias)
            wv, bv = self.value_weights(b.attention[layer], g)
            W_V[layer] = _np(wv).reshape(d, Hkv, dh).transpose(1, 0, 2)
            if bv is not None:
                b_V[layer] = _np(bv).reshape(Hkv, dh)
            w, bias = self._linear(b.down_proj[layer])
            W_down[layer] = _np(w)
            if bias is not None:
                b_down[layer] = _np(bias)
        emb = self.embedding(model)
        out = model.get_output_embeddings()
        tied = out.weight.data_ptr() == emb.weight.data_ptr()
        kind, nw, nb, eps = self.norm_params(model)
        weights = {
            "W_O": W_O,
            "b_O": b_O,
            "W_V": W_V,
            "b_V": b_V,
            "W_down": W_down,
            "b_down": b_down,
            "embed": _np(emb.weight),
            "final_norm_weight": _np(nw),
        }
        if not tied:
            weights["unembed"] = _np(out.weight)
        if nb is not None:
            weights["final_norm_bias"] = _np(nb)
        if getattr(out, "bias", None) is not None:
            weights["unembed_bias"] = _np(out.bias)
        cfg = _text_config(model)
        attrs: dict[str, Any] = {
            "tied_unembed": bool(tied),
            "final_norm": kind,
            "final_norm_eps": eps,
            "embed_scale": float(getattr(emb, "scalar_embed_scale", 1.0)),
            "final_logit_softcapping": getattr(cfg, "final_logit_softcapping", None),
            "architecture": self.name,
        }
        return weights, attrs


class GPT2(Architecture):
    name = "gpt2"
    conv1d = True

    def backbone(self, model: Any) -> Any:
        return model.transformer

    def blocks(self, model: Any) -> Blocks:
        layers = list(self.backbone(model).h)
        return Blocks(
            layers, [x.attn for x in layers], [x.attn.c_proj for x in layers], [x.mlp.c_proj for x in layers]
        )

    def value_weights(self, attn: Any, g: Geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = g.d_model
        w, b = attn.c_attn.weight, attn.c_attn.bias  # Conv1D: [d, 3d] = q | k | v
        return w[:, 2 * d :], (b[2 * d :] if b is not None else None)

    def final_norm(self, model: Any) -> Any:
        return self.backbone(model).ln_f

    def mlp_input(self, model: Any, layer: int, which: str) -> tuple[Any, nn.Module]:
        if which != "gate":
            raise ValueError("GPT-2's MLP has one input projection: neuron:LAYER:INDEX:in")
        block: Any = self.blocks(model).layers[layer]
        return block.ln_2, block.mlp.c_fc


class GPTNeoX(Architecture):
    name = "gpt_neox"

    def backbone(self, model: Any) -> Any:
        return model.gpt_neox

    def blocks(self, model: Any) -> Blocks:
        layers = list(self.backbone(model).layers)
        return Blocks(
            layers,
            [x.attention for x in layers],
            [x.attention.dense for x in layers],
            [x.mlp.dense_4h_to_h for x in layers],
        )

    def value_weights(self, attn: Any, g: Geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
        # query_key_value packs, per head, [q | k | v] of d_head each.
        H, dh = g.n_heads, g.d_head
        w = attn.query_key_value.weight.view(H, 3, dh, g.d_model)[:, 2]
        b = attn.query_key_value.bias
        bv = b.view(H, 3, dh)[:, 2].reshape(-1) if b is not None else None
        return w.reshape(H * dh, g.d_model).T, bv

    def final_norm(self, model: Any) -> Any:
        return self.backbone(model).final_layer_norm

    def mlp_input(self, model: Any, layer: int, which: str) -> tuple[Any, nn.Module]:
        if which != "gate":
            raise ValueError("GPT-NeoX's MLP has one input projection: neuron:LAYER:INDEX:in")
        block: Any = self.blocks(model).layers[layer]
        return block.post_attention_layernorm, block.mlp.dense_h_to_4h


_BY_TYPE: dict[str, type[Architecture]] = {
    "llama": Architecture,
    "mistral": Architecture,
    "qwen2": Architecture,
    "qwen3": Architecture,
    "gemma3_text": Architecture,
    "gemma3": Architecture,
    "gemma2": Architecture,
    "olmo2": Architecture,
    "gpt2": GPT2,
    "gpt_neox": GPTNeoX,
}


def _text_config(model: Any) -> Any:
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def architecture_for(model: Any) -> Architecture:
    model_type = str(getattr(model.config, "model_type", ""))
    cls = _BY_TYPE.get(model_type)
    if cls is None:
        raise ValueError(
            f"unsupported architecture {model_type!r} (supported: {', '.join(sorted(_BY_TYPE))})"
        )
    arch = cls()
    if model_type.startswith("gemma"):
        arch.name = "gemma3"
    return arch


def weights_key(model: Any, arch: Architecture, weight_hash: str) -> str:
    """The shared weights cache's index key of ``model`` (ours; :func:`actstore.core.weight_store.
    store_model_weights`): ``weight_hash`` (the SHA-256 of its weights as loaded, which ``load_model``
    computes: a changed model file changes it), its config, ``arch`` and the source of the module that
    extracts the weights (:meth:`Architecture.weights`: changed code is extracted again). "" (no
    index) without a ``weight_hash``."""
    if not weight_hash:
        return ""
    code = hashlib.sha256(Path(inspect.getfile(type(arch))).read_bytes()).hexdigest()
    config = model.config.to_json_string(use_diff=False)
    return source_key("actstore-weights-v1", weight_hash, config, arch.name, code)
