"""The first MLP block as a function of the token embeddings (MAPS's ``apply_first_mlp``).

The MAPS paper's code reads heads of layers >= 1 through "effective embeddings": the first
MLP's output on each token embedding, MLP0(norm(e)), without the residual (as in earlier
vocabulary-projection work on GPT-2, where the first MLP acts as an extension of the
embedding).  The store does not hold that block's input weights, so the function is taken
from the loaded model.  Norm and MLP modules per family:

    Llama-style (SmolLM2, Llama, Qwen)   post_attention_layernorm -> mlp
    Gemma 3                              pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm
    GPT-2                                ln_2 -> mlp
    GPT-NeoX                             post_attention_layernorm -> mlp
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from actstore.ingest.capture.architectures import Architecture, architecture_for


def first_mlp_transform(
    model: Any, arch: Architecture | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [n, d_model] -> the first block's MLP output on x (float32, on the CPU)."""
    arch = arch or architecture_for(model)
    layer = arch.blocks(model).layers[0]
    pre = next(
        (
            getattr(layer, n)
            for n in ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")
            if hasattr(layer, n)
        ),
        None,
    )
    mlp = getattr(layer, "mlp", None)
    if pre is None or mlp is None:
        raise ValueError(f"cannot find the first MLP block and its norm in {type(layer).__name__}")
    post = getattr(layer, "post_feedforward_layernorm", None)
    param = next(model.parameters())

    def transform(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            h = mlp(pre(x.to(param.device, param.dtype)))
            if post is not None:
                h = post(h)
            return h.float().cpu()

    return transform
