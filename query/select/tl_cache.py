"""TransformerLens names and caches of a store's kinds (``Store.hook_names``, ``Selection.to_activation_cache``).

Each stored kind at layer ``l`` has a TransformerLens hook name and a transformers module path (the
module whose output, or input, it is; ``model.layers.{l}`` for Llama-style models, ``transformer.h.{l}``
for GPT-2, ``gpt_neox.layers.{l}`` for GPT-NeoX):

====================  ===============================  =========================================
kind (layer ``l``)    TransformerLens hook              transformers module
====================  ===============================  =========================================
``resid`` index ``i``  ``blocks.{i}.hook_resid_pre``;   output of block ``i - 1`` (``i = 0``: the
                       ``i = L``:                       embedding); ``i = L`` is before the final
                       ``blocks.{L-1}.hook_resid_post`` norm (transformers' ``hidden_states[L]`` is after it)
``z``                  ``blocks.{l}.attn.hook_z``       input of the attention's output projection
``attn_head``          ``blocks.{l}.attn.hook_result``  that projection split by head (no module)
``attn``               ``blocks.{l}.hook_attn_out``     output of the attention's output projection
``attn_prob``          ``blocks.{l}.attn.hook_pattern`` attention weights (the row's query)
``mlp``                ``blocks.{l}.hook_mlp_out``      output of the MLP
stored ``mlp`` array   ``blocks.{l}.mlp.hook_post``     input of the MLP's down projection (``d_mlp``)
====================  ===============================  =========================================

``to_activation_cache`` hands a selection's rows back as the mapping TransformerLens's analysis code
reads: every entry ``[rows, 1, ...]`` (a row is a batch item of one position), with
``ln_final.hook_scale`` from the last residual, wrapped in ``transformer_lens.ActivationCache`` when
transformer-lens is installed (the ``tlens`` extra) with a stand-in model that knows the store's
geometry, final norm and unembedding, so ``stack_head_results``, ``accumulated_resid(apply_ln=True)``
(the logit lens), ``decompose_resid`` and ``logit_attrs`` run without the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.errors import MissingDependency, QueryError


@dataclass(frozen=True)
class Modules:
    """The transformers module names of one model family, the one table of them (``kind_names`` and
    the SAELens export's column names, :func:`actstore.query.select.hf_export.module_path`, read it):
    ``embed``, whose output is residual index 0; ``block``, block ``l``'s path; a block's attention,
    its output projection, its MLP and the MLP's down projection; ``export_embed``, the export's name
    for residual index 0 (None: refused, the caller names the column)."""

    embed: str
    block: str
    attn: str
    o_proj: str
    mlp: str
    down: str
    export_embed: str | None


_LLAMA = Modules(
    "model.embed_tokens",
    "model.layers.{l}",
    "self_attn",
    "self_attn.o_proj",
    "mlp",
    "mlp.down_proj",
    "model.embed_tokens",
)
# Keyed by the store's architecture (``manifest.model["architecture"]``) or family; Qwen2, Mistral and
# Gemma 3 name their modules as Llama does.
MODULES = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "mistral": _LLAMA,
    "gemma3": _LLAMA,
    "gemma3_text": _LLAMA,
    "gpt2": Modules(
        "transformer.drop", "transformer.h.{l}", "attn", "attn.c_proj", "mlp", "mlp.c_proj", None
    ),
    "gpt_neox": Modules(
        "gpt_neox.emb_dropout",
        "gpt_neox.layers.{l}",
        "attention",
        "attention.dense",
        "mlp",
        "mlp.dense_4h_to_h",
        "gpt_neox.embed_in",
    ),
}
TL_KINDS = ("resid", "z", "attn_head", "attn", "attn_prob", "mlp", "mlp_post")


def kind_names(kind: str, layer: int, n_layers: int, family: str = "llama") -> dict[str, str]:
    """``{"hook": TransformerLens hook name, "module": transformers module path, "side": "output" |
    "input"}`` of ``kind`` at ``layer`` (``mlp_post``: the stored ``mlp`` array, ``d_mlp`` wide)."""
    if kind not in TL_KINDS:
        raise QueryError(f"no TransformerLens name for kind {kind!r} (one of {', '.join(TL_KINDS)})")
    top = n_layers if kind == "resid" else n_layers - 1
    if not 0 <= layer <= top:
        raise QueryError(f"{kind} has layers 0..{top}, not {layer}")
    m = MODULES.get(family, _LLAMA)
    embed, block, attn, o_proj, mlp, down = m.embed, m.block, m.attn, m.o_proj, m.mlp, m.down
    b = block.format(l=layer)
    if kind == "resid":
        if layer == n_layers:
            return {
                "hook": f"blocks.{n_layers - 1}.hook_resid_post",
                "module": block.format(l=n_layers - 1),
                "side": "output",
            }
        return {
            "hook": f"blocks.{layer}.hook_resid_pre",
            "module": embed if layer == 0 else block.format(l=layer - 1),
            "side": "output",
        }
    return {
        "z": {"hook": f"blocks.{layer}.attn.hook_z", "module": f"{b}.{o_proj}", "side": "input"},
        "attn_head": {"hook": f"blocks.{layer}.attn.hook_result", "module": f"{b}.{o_proj}", "side": "input"},
        "attn": {"hook": f"blocks.{layer}.hook_attn_out", "module": f"{b}.{o_proj}", "side": "output"},
        "attn_prob": {"hook": f"blocks.{layer}.attn.hook_pattern", "module": f"{b}.{attn}", "side": "output"},
        "mlp": {"hook": f"blocks.{layer}.hook_mlp_out", "module": f"{b}.{mlp}", "side": "output"},
        "mlp_post": {"hook": f"blocks.{layer}.mlp.hook_post", "module": f"{b}.{down}", "side": "input"},
    }[kind]


def hook_names(store: Any) -> dict[str, list[dict[str, str]]]:
    """Every kind of ``store`` with TransformerLens names, per layer (:func:`kind_names`)."""
    L = store.geometry.n_layers
    family = str((store.manifest.architecture or {}).get("family", "llama"))
    return {
        k: [kind_names(k, layer, L, family) for layer in range(L + 1 if k == "resid" else L)]
        for k in TL_KINDS
    }


class StoreModel:
    """What ``ActivationCache``'s analysis methods read of a model, from the store: ``cfg`` (geometry),
    ``ln_final``, ``W_U`` and ``tokens_to_residual_directions``, as a HookedTransformer loaded with
    ``fold_ln=True`` has them: the final norm's weight folded into ``W_U`` (``d_model x V``), ``ln_final``
    the normalisation alone.  So ``accumulated_resid(apply_ln=True) @ W_U`` is the logit lens and
    ``logit_attrs`` the direct logit attribution (the final norm's bias, where a model has one, is left
    out of both, as TransformerLens's folding moves it into an unembedding bias)."""

    def __init__(self, store: Any) -> None:
        import torch

        try:
            from transformer_lens import HookedTransformerConfig
        except ImportError:
            raise MissingDependency(
                "transformer_lens is not installed: pip install 'actstore[tlens]'"
            ) from None

        g = store.geometry
        attrs = store.weight_attrs
        self.unembed = torch.from_numpy(np.asarray(store.weight("unembed"), np.float32))  # [V, d]
        self.kind = str(attrs.get("final_norm", "rmsnorm"))
        self.eps = float(attrs.get("final_norm_eps", 1e-6))
        self.weight = torch.from_numpy(np.asarray(store.weight("final_norm_weight"), np.float32))
        has_bias = store.has_weight("final_norm_bias")
        self.bias = (
            torch.from_numpy(np.asarray(store.weight("final_norm_bias"), np.float32)) if has_bias else None
        )
        self.cfg = HookedTransformerConfig(
            n_layers=g.n_layers,
            d_model=g.d_model,
            n_ctx=1,
            d_head=g.d_head,
            n_heads=g.n_heads,
            d_mlp=g.d_mlp,
            d_vocab=int(self.unembed.shape[0]),
            act_fn="silu",
            normalization_type="LN" if self.kind == "layernorm" else "RMS",
            device="cpu",
        )
        self.W_U = self.weight[:, None] * self.unembed.T  # [d, V], the final norm's weight folded in

    def ln_final(self, h: Any) -> Any:
        """The final normalisation without its weight (folded into ``W_U``), as a folded model's ``ln_final``."""
        return h.float() / self.ln_scale(h)

    def ln_scale(self, h: Any) -> Any:
        """``ln_final.hook_scale`` of the residual ``h`` [..., d]: [..., 1]."""
        import torch

        h = h.float()
        if self.kind == "layernorm":
            h = h - h.mean(-1, keepdim=True)
        return torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def tokens_to_residual_directions(self, tokens: Any) -> Any:
        """The (folded) unembedding directions of ``tokens``: [..., d_model]."""
        import torch

        return self.W_U.T[torch.as_tensor(tokens)]


def activation_cache(
    selection: Any,
    kinds: Sequence[str] = ("resid", "attn_head", "attn", "mlp", "z"),
    layers: Sequence[int] | None = None,
) -> Any:
    """``selection``'s rows as a TransformerLens cache (see the module notes); a dict of torch tensors
    without transformer-lens."""
    import torch

    store = selection.store
    L = store.geometry.n_layers
    out: dict[str, torch.Tensor] = {}
    for kind in kinds:
        top = L + 1 if kind == "resid" else L
        chosen = [x for x in (range(top) if layers is None else layers) if x < top]
        x = torch.from_numpy(np.ascontiguousarray(selection.features(kind, layers=chosen), np.float32))
        for j, layer in enumerate(chosen):
            out[str(kind_names(kind, layer, L)["hook"])] = x[:, j].unsqueeze(1)  # [rows, pos=1, ...]
            if kind == "resid" and layer == 0:
                out["hook_embed"] = out["blocks.0.hook_resid_pre"]  # decompose_resid's embedding
            if kind == "resid" and 0 < layer < L:
                out[f"blocks.{layer - 1}.hook_resid_post"] = out[f"blocks.{layer}.hook_resid_pre"]
    try:
        from transformer_lens import ActivationCache
    except ImportError:
        return out
    model = StoreModel(store)
    final = f"blocks.{L - 1}.hook_resid_post"
    if final in out:
        out["ln_final.hook_scale"] = model.ln_scale(out[final])
    return ActivationCache(out, model, has_batch_dim=True)
